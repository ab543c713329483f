"""A node's command batches: one request, the commands of several of its GPUs, one reply.

`handle_node_batch(agents, data, headers)` is what the agent's node endpoint
(`subjects.node_command`) calls. A batch that does not decode or validate is answered with one
`Reply` (`bad_request`) and nothing in it is run. Otherwise each item runs (side by side: each
GPU appears once, as its own endpoint would run them) through
`commands.handle_decoded`, the path of a GPU's own request after decoding (the batch's
`Zeus-Lease` header fences each item as it would fence that request), and its `Reply` takes the
item's slot in a `NodeCommandReply`; an item for a GPU this agent does not have is answered
`out_of_range` in its slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from zeus_agent.agent import recording
from zeus_agent.agent.commands import answer, handle_decoded
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.errors import reply_for
from zeus_agent.history import History
from zeus_agent.wire import codec
from zeus_agent.wire.messages import GpuCommand, Reply
from zeus_agent.wire.node_command import NodeCommandBatch, NodeCommandReply

__all__ = ["handle_node_batch", "node_handler", "unknown_gpu"]

LOG = logging.getLogger(__name__)


def unknown_gpu(node: str, gpu: int, agents: Mapping[int, GpuAgent]) -> Reply:
    """The reply in the slot of an item for a GPU the agent does not have."""
    have = ", ".join(str(i) for i in sorted(agents)) or "none"
    return Reply.failure("out_of_range", f"node {node!r} has no GPU {gpu} (its GPUs: {have})")


async def handle_node_batch(
    node: str, agents: Mapping[int, GpuAgent], data: bytes,
    headers: Mapping[str, str] | None = None,
) -> tuple[NodeCommandReply | Reply, NodeCommandBatch | None]:
    """Decode a node's batch and run its items side by side (never raises).

    Returns:
        The reply (a `NodeCommandReply`, or one `Reply` for a batch that does not decode), and
        the batch (None if it did not decode), whose items the replies answer in order.
    """
    try:
        batch = codec.decode(data, NodeCommandBatch)
    except Exception as e:  # noqa: BLE001 - every failure becomes a reply
        return reply_for(e, f"internal error in the agent of node {node!r}; see its log"), None

    async def run(gpu: int, cmd: GpuCommand) -> Reply:
        agent = agents.get(gpu)
        if agent is None:
            return unknown_gpu(node, gpu, agents)
        return await handle_decoded(agent, cmd, headers)

    # Each GPU at most once: its items run side by side, as their per-GPU endpoints would.
    replies = await asyncio.gather(*(run(i.gpu, i.envelope.cmd) for i in batch.items))
    return NodeCommandReply(replies=list(replies)), batch


def node_handler(node: str, agents: Mapping[int, GpuAgent], history: History | None,
                 before_reply: Callable[[], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """The `nats.micro` endpoint of the node's batches: nothing that goes wrong leaves it.

    Each item run is recorded in the history as its GPU's own command is; `before_reply` runs
    before the answer (the lease renewals' subjects follow the leases the items granted).
    """

    async def handler(req: Any) -> None:
        try:
            reply, batch = await handle_node_batch(node, agents, req.data, req.headers)
            data = codec.encode(reply)
            if history is not None and batch is not None and isinstance(reply, NodeCommandReply):
                for item, one in zip(batch.items, reply.replies, strict=True):
                    if (agent := agents.get(item.gpu)) is not None:
                        recording.record_command(history, agent, item.envelope.cmd.model_dump(),
                                                 req.headers, one)
        except Exception as e:  # noqa: BLE001 - never go silent
            LOG.exception("node %s: command batch handling failed", node)
            data = codec.encode(reply_for(e, f"internal error in the agent of node {node!r}"))
        await answer(req, data, before_reply, f"node {node}", "a command batch")

    return handler
