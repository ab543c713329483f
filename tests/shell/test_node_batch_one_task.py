"""A node's batch of described ranks handled in one task (`Endpoints._register_node`).

Against a real nats-server. The common batch (one known job, every rank with its GPU's
description from the agent that relayed it) is checked, written and answered in the request's
own task, not one task per rank and one for the write (`NodeWrite`): each rank is still
answered as it would be alone, the quota is shared, a write not committed records each rank
alone, and the other replica learns the ranks and can take the job over.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import endpoints
from coordinator.state import records
from coordinator.state.group_commit import REFUSED
from tests.shell.coordinator_kit import (
    NODE,
    collect,
    rank_request,
    register_job,
    replicas,
    start,
    state_keys,
    stop,
    wait_for,
)
from tests.shell.node_batch_kit import OPTIONS, ask_batch, described
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    JobStatus,
    Reply,
)
from zeus_agent.wire.rank_batch import RegisterRanks


class _NoNodeWrite:
    def __init__(self, *_: Any) -> None:
        raise AssertionError("a described batch took the path of one task per rank")


async def test_a_described_batch_needs_no_task_per_rank(
        coord: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoints, "NodeWrite", _NoNodeWrite)
    statuses = await collect(nc, subjects.all_job_status(), JobStatus)
    job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
    replies = await ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)])
    assert [(r.ok, r.result.get("rank"), r.result.get("registered")) for r in replies] == [
        (True, 0, 1), (True, 1, 2)]
    h = records.job_hash(job_id)
    keys = await state_keys(coord)
    assert sorted(k for k in keys if k.startswith(f"v.ranks.{h}.")) == [
        records.node_key(job_id, 0)]
    assert coord.gpus.limits == {(NODE, 0): (100, 300), (NODE, 1): (100, 300)}
    await wait_for(lambda: job_id in coord.optimisers)
    await wait_for(lambda: sum(s.job_id == job_id and s.state == "rank_registered"
                               for s in statuses) == 2)


async def test_a_described_batch_answers_each_rank_as_the_task_per_rank_path_does(
        coord: Any, nc: Any) -> None:
    """The same hostile batch, described (one task) and not (one task per rank): the same
    answers, rank by rank, and the same ranks recorded."""
    answers, recorded = [], []
    for describe in (True, False):
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS,
                                    job_metadata=f"hostile-{describe}")
        batch = [rank_request(job_id, 0, gpu=0), rank_request(job_id, 0, gpu=0),
                 rank_request(job_id, 1, gpu=0), rank_request(job_id, 3, gpu=1),
                 rank_request(job_id, 1, gpu=1, node="elsewhere")]
        if describe:
            batch = [described(r) for r in batch]
        replies = await ask_batch(nc, batch)
        answers.append([(r.ok, r.code) for r in replies])
        record = coord.jobs.record(job_id)
        recorded.append(sorted(record.ranks) if record is not None else None)
    assert answers[0] == answers[1], answers
    assert [ok for ok, _ in answers[0]] == [True, True, False, False, False]
    assert recorded == [[0], [0]]


async def test_a_described_batch_keeps_to_max_ranks_per_node(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord", max_ranks_per_node=1)
    try:
        job_id = await register_job(nc, dp=2)
        replies = await ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)])
        assert [(r.ok, r.code) for r in replies] == [(True, ""), (False, "quota")]
        keys = await state_keys(coord)
        assert sum(k.startswith("rank.") for k in keys) == 1, keys
        await asyncio.sleep(0.3)  # (the watch applies what the bucket holds)
        record = coord.jobs.record(job_id)
        assert record is not None and sorted(record.ranks) == [0]
        assert not coord.jobs.registry._reserved  # noqa: SLF001 - every place given back
    finally:
        await stop(coord, task)


async def test_a_node_write_not_committed_records_each_rank_alone(
        coord: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refused(*_: Any) -> Any:
        return REFUSED

    monkeypatch.setattr(endpoints, "write_node", refused)
    statuses = await collect(nc, subjects.all_job_status(), JobStatus)
    job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
    replies = await ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)])
    assert [(r.ok, r.result.get("registered")) for r in replies] == [(True, 1), (True, 2)]
    h = records.job_hash(job_id)
    keys = await state_keys(coord)
    assert {f"rank.{h}.0", f"rank.{h}.1"} <= keys
    await wait_for(lambda: job_id in coord.optimisers)
    await wait_for(lambda: sum(s.job_id == job_id and s.state == "rank_registered"
                               for s in statuses) == 2)
    assert not coord.jobs.registry._reserved  # noqa: SLF001


async def test_the_other_replica_learns_a_described_batch_and_takes_the_job_over(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    async with replicas(nats_server, tmp_path) as group:
        await group.all_live()
        r1, r2 = group["r1"], group["r2"]
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
        await wait_for(lambda: job_id in r1.jobs and job_id in r2.jobs)
        data = codec.encode(RegisterRanks(ranks=[described(rank_request(job_id, r))
                                                 for r in (0, 1)]))
        reply = await r1.endpoints.register_rank(data, subjects.coord_register_rank(NODE))
        assert reply.ok and all(Reply.model_validate(r).ok for r in reply.result["replies"])
        await wait_for(lambda: len(r2.jobs.record(job_id).ranks) == 2)
        assert r2.gpus.limits == {(NODE, 0): (100, 300), (NODE, 1): (100, 300)}
        assert not r1.link.require_state().own_entries  # (its own entry applied, not decoded)
        await wait_for(lambda: job_id in r1.optimisers or job_id in r2.optimisers, 10)
        await group.remove("r1" if job_id in r1.optimisers else "r2")
        (other,) = group.coords.values()
        await wait_for(lambda: job_id in other.optimisers, 20)
