"""A node's ranks registered in one request (`RegisterRanks`): one reply per rank, in order.

Each rank of the batch is checked and recorded as if it came alone: one through another node's
subject is refused (`forbidden`), one for another rank's GPU (`duplicate`) too, a retry is
answered as a retry, and the others register; the state bucket then holds what one request per
rank would have left.
"""

from __future__ import annotations

from typing import Any

from tests.shell.coordinator_kit import NODE, ask, rank_request, register_job, state_keys
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import Reply
from zeus_agent.wire.rank_batch import RegisterRanks


async def test_a_nodes_ranks_in_one_request_each_answered_in_order(coord: Any, nc: Any) -> None:
    job_id = await register_job(nc, dp=4, job_metadata="batched")
    subject = subjects.coord_register_rank(NODE)
    first = await ask(nc, subject, RegisterRanks(ranks=[rank_request(job_id, 0)]))
    assert first.ok and [Reply.model_validate(r).ok for r in first.result["replies"]] == [True]

    batch = RegisterRanks(ranks=[
        rank_request(job_id, 1),  # GPU 1 of NODE
        rank_request(job_id, 0),  # a retry of rank 0: the same GPU
        rank_request(job_id, 2, node="elsewhere", gpu=0),  # another node's GPU
        rank_request(job_id, 3, gpu=0),  # rank 0's GPU
    ])
    reply = await ask(nc, subject, batch)
    assert reply.ok, reply
    replies = [Reply.model_validate(r) for r in reply.result["replies"]]
    assert [(r.ok, r.code) for r in replies] == [
        (True, ""), (True, ""), (False, "forbidden"), (False, "duplicate")]
    assert replies[0].result["rank"] == 1 and replies[1].result["rank"] == 0
    keys = await state_keys(coord)
    assert sum(k.startswith("rank.") for k in keys) == 2  # ranks 0 and 1 (created once)
    assert sum(k.startswith("v.ranks.") for k in keys) == 2  # (rank 1's batch: itself only)
    assert sum(k.startswith("gpu.") for k in keys) == 2
    assert sorted(coord.jobs.record(job_id).ranks) == [0, 1]


async def test_a_batch_that_does_not_validate_is_refused_whole(coord: Any, nc: Any) -> None:
    reply = await ask(nc, subjects.coord_register_rank(NODE), {"v": 1, "ranks": []})
    assert (reply.ok, reply.code) == (False, "bad_request")
