"""Two replicas giving two jobs one id at once, against a real nats-server: the loser's view.

Defect (found by a 2,000-job reproduction of `bench/cluster_scale.py`'s "jobs not removed"):
replica B registered a job, and while its record was being written replica A gave another job
the same id and won it. B's watch delivered A's record while B's own registration still held
the id (so B's view kept its own); B's ownership loop took the lease of that id (a job it knew
of, with no lease yet); then B dropped its registration, and with it the id, from its view. A
job was left that only A knew, whose lease B held and renewed forever: A never collected it
(not its owner), B never did (not in its view). 1 of 2,000 jobs stayed registered 300 s after
its idle limit.

Now a registration still being written is pending: the ownership loop takes no lease on it,
and when it loses its id the record the bucket delivered meanwhile is kept. The race is forced
here: B's write waits until A's job with the same id is in B's view and B's ownership loop has
run.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import CoordinatorService
from coordinator.state import records
from coordinator.state.jetstream import StateUnavailableError
from tests.shell.coordinator_kit import start, state_keys, stop, wait_for
from zeus_agent.models import JobInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import PowerLimitOptions, RegisterJob

SECOND = datetime(2026, 12, 6, 14, 0, 0)
ID = "2026-12-06-14-00-00+dp2+pp1+tp1+PowerLimitOptimizer"
IDLE_S = 3


class Frozen(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return SECOND


def holder(coord: CoordinatorService, job_id: str) -> str | None:
    lease = coord.book.leases.get(records.job_hash(job_id))
    return None if lease is None else lease.owner


async def test_a_replica_that_loses_a_jobs_id_still_knows_the_winners_job(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("coordinator.service.endpoints.datetime", Frozen)
    kw: dict[str, Any] = {"state_bucket": "id-race", "max_job_idle_time": IDLE_S}
    a, a_task = await start(nats_server, tmp_path / "a", replica_name="a", **kw)
    b, b_task = await start(nats_server, tmp_path / "b", replica_name="b", **kw)
    try:
        a_won = asyncio.Event()
        create = b.link.require_state().create_job

        async def late(record: Any) -> bool:
            await a_won.wait()
            await asyncio.sleep(1.0)  # B's watch (A's record) and ownership loop (0.5 s) ran.
            return await create(record)

        b.link.require_state().create_job = late  # type: ignore[method-assign]
        request = codec.encode(RegisterJob(
            job=JobInfo(dp_degree=2, pp_degree=1, tp_degree=1, world_size=2),
            power_limit=PowerLimitOptions()))
        subject = subjects.coord_register_job("node-a")
        b_reply = asyncio.create_task(b.endpoints.register_job(request, subject))
        await wait_for(lambda: ID in b.jobs)  # B's registration holds the id, being written.
        a_reply = await a.endpoints.register_job(request, subject)
        assert (a_reply.ok, a_reply.result["job_id"]) == (True, ID)
        a_won.set()
        b_result = (await asyncio.wait_for(b_reply, 10)).result
        assert b_result["job_id"] == f"{ID}+2"  # B took the next id.

        both = {ID, f"{ID}+2"}
        await wait_for(lambda: both <= set(a.jobs.ids()) and both <= set(b.jobs.ids()))
        for job_id in both:  # Whoever holds a job's lease knows the job.
            await wait_for(lambda j=job_id: holder(a, j) is not None)
            assert holder(a, job_id) == holder(b, job_id)
            owner = a if holder(a, job_id) == "a" else b
            assert job_id in owner.jobs

        # So both are removed once idle, everywhere.
        await wait_for(lambda: not a.jobs.ids() and not b.jobs.ids(), IDLE_S + 10)
        assert not [k for k in await state_keys(a) if k.startswith("v.job.")]
    finally:
        await stop(b, b_task)
        await stop(a, a_task)


async def test_no_lease_is_taken_on_a_registration_still_being_written(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: the ownership loop took the lease of a job whose record was still being written;
    when the write then failed (`unavailable`), the replica renewed a lease on a job that never
    existed, for as long as it ran. Now the lease waits for the record."""
    monkeypatch.setattr("coordinator.service.endpoints.datetime", Frozen)
    coord, task = await start(nats_server, tmp_path / "c", replica_name="c",
                              state_bucket="pending-lease")
    try:
        state = coord.link.require_state()

        async def unavailable(record: Any) -> bool:
            await asyncio.sleep(1.5)  # Three rounds of the ownership loop.
            raise StateUnavailableError("JetStream did not take it")

        state.create_job = unavailable  # type: ignore[method-assign]
        request = codec.encode(RegisterJob(
            job=JobInfo(dp_degree=2, pp_degree=1, tp_degree=1, world_size=2),
            power_limit=PowerLimitOptions()))
        with pytest.raises(StateUnavailableError):  # (Answered `unavailable`.)
            await coord.endpoints.register_job(request, subjects.coord_register_job("node-a"))
        assert ID not in coord.jobs
        assert holder(coord, ID) is None
        assert await state.read_lease(records.job_hash(ID)) is None
    finally:
        await stop(coord, task)
