"""Review of registrations in atomic batches (`group_commit`) and node batches of ranks.

Against a real nats-server. Each test shows a defect found in review of the `h-register`
change: what should hold, and fails while the defect is there.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from coordinator.jobs import RankRecord
from coordinator.state import records
from coordinator.state.jetstream import JetStreamState
from tests.shell.coordinator_kit import (
    NODE,
    ask,
    collect,
    rank_request,
    register_job,
    start,
    state_keys,
    stop,
    wait_for,
)
from tests.shell.node_batch_kit import described
from zeus_agent.models import RankInfo
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    JobStatus,
    Reply,
)
from zeus_agent.wire.rank_batch import RegisterRanks

JOB = "1765000000+dp64+pp1+tp1+PowerLimitOptimizer"


def _rank(rank: int) -> RankRecord:
    return RankRecord(RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 210]),
                      GpuBinding(node=f"n{rank // 8}", gpu_index=rank % 8))


async def _state(nc: Any) -> JetStreamState:
    state = JetStreamState(nc, "zeus", bucket=f"rv-{uuid.uuid4().hex[:12]}")
    await state.open()
    return state


async def test_closing_while_a_batch_starts_answers_its_registration(nc: Any) -> None:
    """`GroupCommit.close` ("batches in flight are abandoned (their units False)") cancels a
    batch's task that has not run yet: its units' futures are then never set, and the
    registration waiting on it waits forever (closing must answer every waiter, as it does
    for units still queued)."""
    state = await _state(nc)
    assert state.batches is not None and state.batches.enabled
    batches = state.batches
    waiter = asyncio.ensure_future(batches.create(
        ((records.gpu_key(JOB, "n0", 0), b"x"), (records.rank_key(JOB, 0), b"y"))))
    try:
        await asyncio.sleep(0)  # the unit is queued, its batch scheduled (call_soon)
        await asyncio.sleep(0)  # the batch taken from the queue: its task created, not yet run
        assert not batches._pending and batches._tasks  # (where close finds it)
        await batches.close()
        assert (await asyncio.wait_for(waiter, 5)).committed is False
    finally:
        waiter.cancel()
        await state.close()


async def test_a_batch_acknowledged_after_its_timeout_still_reports_a_new_rank(nc: Any) -> None:
    """A batch whose acknowledgement comes after `timeout_s` (a slow synced write) has landed:
    the one-by-one creates then find both keys holding this very rank and `create_rank` says
    False, "a retry", for a rank registered for the first time (the endpoint then sends no
    `rank_registered` and, for a job's last rank, never starts the job)."""
    state = await _state(nc)
    try:
        assert state.batches is not None and state.batches.enabled
        state.batches.timeout_s = 0.0  # the acknowledgement always comes after the timer
        assert await state.create_rank(JOB, _rank(5)) is True
        entry = await state.kv.get(records.rank_key(JOB, 5))
        assert records.decode(entry.key, entry.value, False, 0).rank == _rank(5)
    finally:
        await state.close()


async def test_a_rank_acknowledged_late_still_gets_its_rank_registered_status(
        coord: Any, nc: Any) -> None:
    """The coordinator's side of the late acknowledgement above: the rank's registration is
    answered ok, but the handler takes the new rank for a retry, so its `rank_registered`
    status is never published (and the job's start is left to another path)."""
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=2, job_metadata="late-ack")
    batches = coord.link.require_state().batches
    assert batches is not None and batches.enabled
    batches.timeout_s = 0.0  # the batch lands; its acknowledgement comes after the timer
    reply = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))
    assert reply.ok and reply.result["registered"] == 1
    await wait_for(lambda: len([s for s in statuses if s.job_id == job_id]) >= 2)
    assert [s.state for s in statuses if s.job_id == job_id][:2] == [
        "registered", "rank_registered"]


async def test_a_nodes_batch_keeps_to_max_ranks_per_node(nats_server: Any, agent: Any, nc: Any,
                                                         tmp_path: Any) -> None:
    """`max_ranks_per_node` bounds what one node's agent makes every replica keep (issue 33).
    The ranks of a `RegisterRanks` are checked side by side, each before any is recorded, and
    checked again (`registry.register_rank`) only after their keys are in the state bucket:
    the rank over the quota is answered `quota`, but stays recorded in the bucket and in every
    replica. One at a time, the second is refused and leaves nothing. (The same happens on
    main with concurrent single requests; a node's batch makes it happen every time.)"""
    coord, task = await start(nats_server, tmp_path / "coord", max_ranks_per_node=1)
    try:
        alone = await register_job(nc, dp=2, job_metadata="quota-alone")
        first = await ask(nc, subjects.coord_register_rank(NODE), rank_request(alone, 0))
        second = await ask(nc, subjects.coord_register_rank(NODE), rank_request(alone, 1))
        assert first.ok and (second.ok, second.code) == (False, "quota")

        await stop(coord, task)
        coord, task = await start(nats_server, tmp_path / "coord2", max_ranks_per_node=1)
        job_id = await register_job(nc, dp=2, job_metadata="quota-batch")
        reply = await ask(nc, subjects.coord_register_rank(NODE), RegisterRanks(
            ranks=[rank_request(job_id, 0), rank_request(job_id, 1)]))
        assert reply.ok, reply
        oks = [Reply.model_validate(r).ok for r in reply.result["replies"]]
        # The second is answered `quota`, yet its keys were written before the check that
        # refused it: the bucket (and so every replica, through its watch) holds both ranks.
        assert oks.count(True) == 1, reply.result["replies"]
        keys = await state_keys(coord)
        assert sum(k.startswith("rank.") for k in keys) == 1, keys
        assert sum(k.startswith("v.ranks.") for k in keys) == 1, keys
        await asyncio.sleep(0.5)  # (the watch applies what the bucket holds)
        record = coord.jobs.record(job_id)
        assert record is not None and len(record.ranks) == 1
    finally:
        await stop(coord, task)


async def test_a_known_retry_does_not_spoil_the_batch_of_the_nodes_other_ranks(
        coord: Any, nc: Any) -> None:
    """A rank the coordinator already holds (the handler knows it for a retry before writing)
    still goes into the group commit's batch: the server refuses that whole batch (its keys
    are taken), and every other rank in it falls back to two synced creates each. Retries
    come when registrations are slow (trainers time out and ask again): then each spoils a
    batch of up to 128 ranks, which makes registrations slower still."""
    job_id = await register_job(nc, dp=2, job_metadata="retry-spoils")
    subject = subjects.coord_register_rank(NODE)
    first = await ask(nc, subject, described(rank_request(job_id, 0)))
    assert first.ok, first
    batches = coord.link.require_state().batches
    assert batches is not None and batches.enabled
    before = batches.batches
    reply = await ask(nc, subject, RegisterRanks(ranks=[described(rank_request(job_id, 0)),
                                                        described(rank_request(job_id, 1))]))
    assert reply.ok, reply
    assert [Reply.model_validate(r).ok for r in reply.result["replies"]] == [True, True]
    assert batches.batches == before + 1  # rank 1's keys, committed in a batch
