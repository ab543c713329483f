"""`RegisterRanks`: a node's rank registrations, relayed together by its agent.

The ranks on one node's GPUs register at about the same time (a job's local ranks leave its
rendezvous together), each through the node's agent. The agent sends those that arrive together
in one request on the node's `coord_register_rank` subject instead of one request each: a
registration of 16,384 ranks on 8-GPU nodes is then 2,048 requests and replies, not 16,384.
The coordinator checks and records each rank as it does a `RegisterRank` and answers one
`Reply` per rank, in order, in `result["replies"]` (each `Reply.model_dump()`). A coordinator
that predates batches refuses one (`bad_request`: not a `RegisterRank`), and the agent then
relays each rank on its own.

Kept apart from `messages` (at its size limit); it depends on `messages` only.
"""

from __future__ import annotations

from pydantic import Field

from zeus_agent.wire.messages import MAX_GPUS_PER_NODE, Message, RegisterRank

__all__ = ["RegisterRanks"]


class RegisterRanks(Message):
    """Ranks of one node registered together (each for a GPU of the subject's node)."""

    ranks: list[RegisterRank] = Field(
        min_length=1, max_length=MAX_GPUS_PER_NODE,
        description="The registrations, each as its own `RegisterRank` would be; answered in "
        "this order, one `Reply` each in the reply's `result.replies`")
