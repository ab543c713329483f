"""Review of `Endpoints._register_node` (a node's common batch in one task): attacks.

Against a real nats-server, as `test_node_batch_one_task.py`. Each case checks what one task
per rank (`NodeWrite`) answered: the quota a batch fills, a request cancelled mid-write, the
job forgotten mid-write, two batches of the same ranks at once, a batch sent again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import endpoints, node_writes
from tests.shell.coordinator_kit import (
    NODE,
    collect,
    rank_request,
    register_job,
    start,
    stop,
    wait_for,
)
from tests.shell.node_batch_kit import OPTIONS, ask_batch, described
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus, Reply
from zeus_agent.wire.rank_batch import RegisterRanks


def _held(coord: Any) -> tuple[dict[str, int], set[Any]]:
    """The quota places and the ranks being recorded that the replica still holds."""
    return coord.jobs.registry._reserved, coord.jobs._registering  # noqa: SLF001


def _stalled(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """`write_node` held until released: (entered, release)."""
    entered, release, real = asyncio.Event(), asyncio.Event(), endpoints.write_node

    async def stalled(*args: Any) -> Any:
        entered.set()
        await release.wait()
        return await real(*args)

    monkeypatch.setattr(endpoints, "write_node", stalled)
    return entered, release


async def test_a_described_batch_that_fills_the_node_quota_is_recorded_whole(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    """Two ranks on a node allowed two: both pass (as one task per rank lets them).

    Each rank gives its place back as it registers, as its own task did: a rank registered
    and its place still held were counted twice, and the last ranks of a node that fills its
    quota were refused `quota` while recorded (in the bucket, and here once their entry came).
    """
    coord, task = await start(nats_server, tmp_path / "coord", max_ranks_per_node=2)
    try:
        job_id = await register_job(nc, dp=2)
        replies = await ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)])
        assert [(r.ok, r.code, r.result.get("registered")) for r in replies] == [
            (True, "", 1), (True, "", 2)]
        assert sorted(coord.jobs.record(job_id).ranks) == [0, 1]
        assert _held(coord) == ({}, set())
    finally:
        await stop(coord, task)


async def test_a_request_cancelled_mid_write_gives_its_places_back(
        coord: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = _stalled(monkeypatch)
    job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
    data = codec.encode(RegisterRanks(ranks=[described(rank_request(job_id, r))
                                             for r in (0, 1)]))
    request = asyncio.create_task(
        coord.endpoints.register_rank(data, subjects.coord_register_rank(NODE)))
    await asyncio.wait_for(entered.wait(), 5)
    assert _held(coord)[0] == {NODE: 2}
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert _held(coord) == ({}, set())
    release.set()  # (The service keeps serving: the same batch again is recorded.)
    replies = await ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)])
    assert [(r.ok, r.result.get("registered")) for r in replies] == [(True, 1), (True, 2)]
    assert _held(coord) == ({}, set())


async def test_a_job_forgotten_mid_write_answers_each_rank_unknown(
        coord: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = _stalled(monkeypatch)
    job_id = await register_job(nc, dp=2, power_limit=OPTIONS)
    batch = asyncio.create_task(
        ask_batch(nc, [described(rank_request(job_id, r)) for r in (0, 1)]))
    await asyncio.wait_for(entered.wait(), 5)
    coord.jobs.forget(job_id)
    release.set()
    replies = await batch
    assert [(r.ok, r.code) for r in replies] == [(False, "unknown_job")] * 2, replies
    assert _held(coord) == ({}, set())
    assert coord.jobs.record(job_id) is None and job_id not in coord.optimisers


async def test_two_batches_of_the_same_ranks_at_once_are_answered_as_one_task_per_rank(
        coord: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same two ranks in two batches at once, both checked before either is written:
    described (one task) and not (one task per rank), the same answers and events."""
    entered, release = _stalled(monkeypatch)
    monkeypatch.setattr(node_writes, "write_node", endpoints.write_node)
    statuses = await collect(nc, subjects.all_job_status(), JobStatus)
    answers, events = [], []
    for describe in (True, False):
        entered.clear()
        release.clear()
        job_id = await register_job(nc, dp=2, power_limit=OPTIONS, job_metadata=f"{describe}")
        ranks = [rank_request(job_id, r) for r in (0, 1)]
        ranks = [described(r) for r in ranks] if describe else ranks
        first = asyncio.create_task(ask_batch(nc, ranks))
        await asyncio.wait_for(entered.wait(), 5)
        second = asyncio.create_task(ask_batch(nc, ranks))
        await wait_for(lambda: _held(coord)[0] == {NODE: 4})  # (Both wait at their write.)
        release.set()
        answers.append([[(r.ok, r.result.get("registered")) for r in replies]
                        for replies in await asyncio.gather(first, second)])
        assert sorted(coord.jobs.record(job_id).ranks) == [0, 1]
        assert _held(coord) == ({}, set())
        await wait_for(lambda: job_id in coord.optimisers)  # noqa: B023 - awaited here
        await asyncio.sleep(0.2)
        events.append(sum(s.job_id == job_id and s.state == "rank_registered"
                          for s in statuses))
    assert answers[0] == answers[1] == [[(True, 1), (True, 2)], [(True, 2), (True, 2)]], answers
    assert events == [2, 2]


async def test_a_batch_sent_again_is_answered_as_each_rank_alone(
        coord: Any, nc: Any) -> None:
    """A node's batch whose reply was lost, sent again (some ranks new): the same answers,
    described or not."""
    answers = []
    for describe in (True, False):
        job_id = await register_job(nc, dp=4, job_metadata=f"again-{describe}")
        first = [rank_request(job_id, r) for r in (0, 1)]
        again = [rank_request(job_id, r) for r in (0, 1, 2, 3)]
        if describe:
            first, again = [described(r) for r in first], [described(r) for r in again]
        await ask_batch(nc, first)
        replies = await ask_batch(nc, again)
        answers.append([(r.ok, r.code, r.result.get("registered")) for r in replies])
        assert sorted(coord.jobs.record(job_id).ranks) == [0, 1, 2, 3]
    assert answers[0] == answers[1], answers
    assert _held(coord) == ({}, set())


def test_each_reply_of_a_batch_is_its_own_dict() -> None:
    one, two = endpoints.plain_success(rank=0), endpoints.plain_success(rank=1)
    assert one is not two and one["result"] is not two["result"]
    assert Reply.model_validate(one) == Reply.success(rank=0)
