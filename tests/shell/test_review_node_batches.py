"""Review of state layout 3: node batches in the cases an adversary would try (real nats-server).

A rank twice in one request, ranks of two jobs in one request, a batch with a rank refused
(its GPU taken by another rank of it), a node batch not answered in time that landed, and a
replica that did not register a node's ranks taking the job over: every rank is answered, and
what is answered registered is recorded once and known to every replica.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coordinator.state import records
from tests.shell.coordinator_kit import (
    NODE,
    ask,
    rank_request,
    register_job,
    replicas,
    start,
    state_keys,
    stop,
    wait_for,
)
from tests.shell.node_entries_kit import JOB
from tests.shell.node_entries_kit import items as _items
from tests.shell.node_entries_kit import keys as _keys
from tests.shell.node_entries_kit import states as _states
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import PowerLimitOptions, Reply
from zeus_agent.wire.rank_batch import RegisterRanks

OPTIONS = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2)


async def _batch(nc: Any, requests: list[Any]) -> list[Reply]:
    reply = await asyncio.wait_for(
        ask(nc, subjects.coord_register_rank(NODE), RegisterRanks(ranks=requests)), 8)
    assert reply.ok, reply
    return [Reply.model_validate(r) for r in reply.result["replies"]]


async def test_a_rank_twice_in_a_batch_and_two_jobs_in_one(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        replies = await _batch(nc, [rank_request(job_id, 0), rank_request(job_id, 0),
                                    rank_request(job_id, 1)])
        assert all(r.ok for r in replies), replies
        h = records.job_hash(job_id)
        assert sorted(k for k in await state_keys(coord) if k.startswith(f"rank.{h}.")) == [
            f"rank.{h}.0", f"rank.{h}.1"]
        await wait_for(lambda: job_id in coord.optimisers)

        a = await register_job(nc, dp=1, power_limit=OPTIONS)
        b = await register_job(nc, dp=1, power_limit=OPTIONS)
        replies = await _batch(nc, [rank_request(a, 0, gpu=0), rank_request(b, 0, gpu=1)])
        assert all(r.ok for r in replies), replies
        keys = await state_keys(coord)
        assert {records.node_key(a, 0), records.node_key(b, 0)} <= keys
        await wait_for(lambda: a in coord.optimisers and b in coord.optimisers)
    finally:
        await stop(coord, task)


async def test_a_job_registering_again_adds_no_entry(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    """A restarted job's ranks register again: retries, one node entry still."""
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        h = records.job_hash(job_id)
        for _ in range(2):
            replies = await _batch(nc, [rank_request(job_id, 0), rank_request(job_id, 1)])
            assert all(r.ok for r in replies), replies
            assert sorted(k for k in await state_keys(coord)
                          if k.startswith(f"v.ranks.{h}.")) == [records.node_key(job_id, 0)]
    finally:
        await stop(coord, task)


async def test_a_batch_with_a_refused_rank_records_the_others(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "c")
    try:
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        replies = await _batch(nc, [rank_request(job_id, 0, gpu=0),
                                    rank_request(job_id, 1, gpu=0)])
        assert [r.ok for r in replies].count(True) == 1, replies
        assert [r.code for r in replies if not r.ok] == ["duplicate"]
        replies = await _batch(nc, [rank_request(job_id, 1, gpu=1)])
        assert all(r.ok for r in replies), replies
        await wait_for(lambda: job_id in coord.optimisers)
    finally:
        await stop(coord, task)


async def test_a_node_batch_that_landed_unanswered_is_new_for_every_rank(nc: Any) -> None:
    (state,) = await _states(nc)
    try:
        timeout, state.batches.timeout_s = state.batches.timeout_s, 1e-9
        outcome = await state.create_node_ranks(JOB, _items(range(8)))
        state.batches.timeout_s = timeout
        assert not outcome.committed and outcome.batch_id is not None
        for _ in range(250):  # Until the batch has landed (no answer came: it still may).
            if records.node_key(JOB, 0) in await _keys(state):
                break
            await asyncio.sleep(0.02)
        assert records.node_key(JOB, 0) in await _keys(state)
        results = await asyncio.gather(*(
            state.create_rank(JOB, rank, limits, period, node_ranks=True,
                              landed=outcome.batch_id)
            for rank, limits, period in _items(range(8))))
        assert results == [True] * 8  # (found holding the batch's id: its ranks, not retries)
    finally:
        await state.close()


async def test_a_replica_that_did_not_register_the_ranks_takes_the_job_over(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    async with replicas(nats_server, tmp_path) as group:
        await group.all_live()
        r1, r2 = group["r1"], group["r2"]
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        await wait_for(lambda: job_id in r1.jobs and job_id in r2.jobs)
        data = codec.encode(RegisterRanks(ranks=[rank_request(job_id, r) for r in (0, 1)]))
        reply = await r1.endpoints.register_rank(data, subjects.coord_register_rank(NODE))
        assert reply.ok and all(Reply.model_validate(r).ok for r in reply.result["replies"])
        await wait_for(lambda: len(r2.jobs.record(job_id).ranks) == 2)
        assert r2.gpus.limits == {(NODE, 0): (100, 300), (NODE, 1): (100, 300)}
        await wait_for(lambda: job_id in r1.optimisers or job_id in r2.optimisers, 10)
        await group.remove("r1" if job_id in r1.optimisers else "r2")
        (other,) = group.coords.values()
        await wait_for(lambda: job_id in other.optimisers, 20)
