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
    wait_for,
)
from zeus_agent.models import RankInfo
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import GpuBinding, JobStatus

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
    """`GroupCommit.close` cancels a batch's task that has not run yet: its units' futures
    are then never set, and the registration waiting on it waits forever (closing must
    answer every waiter, as it does for units still queued)."""
    state = await _state(nc)
    assert state.batches is not None and state.batches.enabled
    batches = state.batches
    waiter = asyncio.ensure_future(batches.create(
        ((records.gpu_key(JOB, "n0", 0), b"x"), (records.rank_key(JOB, 0), b"y"))))
    await asyncio.sleep(0)  # the unit is queued, its batch scheduled (call_soon)
    await asyncio.sleep(0)  # the batch taken from the queue: its task created, not yet run
    assert not batches._pending and batches._tasks  # (where close finds it)
    await state.close()
    try:
        assert await asyncio.wait_for(waiter, 5) is False
    finally:
        waiter.cancel()


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
