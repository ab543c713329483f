"""`NodeCommandBatch`: one request carrying the commands of several GPUs of one node.

A coordinator that commands many GPUs of one node at once (a job's first power limit: 8 per
node, 16,384 for a 2,048-node job) sends one request per node on `<p>.agent.<node>.cmd`
(`subjects.node_command`) instead of one per GPU, and gets one `NodeCommandReply` back with each
item's `Reply` in the items' order. Each item is the `CommandEnvelope` its GPU's own subject
takes, and the agent runs it exactly as that subject's request (the same `Zeus-Lease` fencing,
holders, caps and errors): a GPU the agent does not have gets an error in its own slot. A batch
that does not decode or validate is answered with one `Reply` (`bad_request`), and nothing in it
is run. The per-GPU subjects stay: observers, tools and older coordinators use them.

Kept apart from `messages` (at its size limit); it depends on `messages` only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeus_agent.wire.messages import CommandEnvelope, GpuIndex, Message, Reply

__all__ = ["MAX_NODE_COMMANDS", "NodeCommand", "NodeCommandBatch", "NodeCommandReply"]

MAX_NODE_COMMANDS = 256
"""Most GPU commands in one node's batch (a node holds 8 to 72 GPUs); a batch of one GPU's
settings stays far under nats-server's 1 MB payload limit (an installed schedule is the largest
command, bounded by its own limits)."""


class NodeCommand(BaseModel):
    """One GPU's command in a node's batch: the GPU's index and its command envelope."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpu: GpuIndex
    envelope: CommandEnvelope


class NodeCommandBatch(Message):
    """Commands for several GPUs of one node, each GPU at most once; the items run side by side."""

    items: list[NodeCommand] = Field(min_length=1, max_length=MAX_NODE_COMMANDS, fail_fast=True)

    @model_validator(mode="after")
    def _unique_gpus(self) -> NodeCommandBatch:
        gpus = [item.gpu for item in self.items]
        if len(set(gpus)) != len(gpus):
            raise ValueError("each GPU may appear once in a node's command batch")
        return self


class NodeCommandReply(Message):
    """The replies of a `NodeCommandBatch`: one `Reply` per item, in the items' order."""

    replies: list[Reply] = Field(max_length=MAX_NODE_COMMANDS)
