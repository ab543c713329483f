"""A failure while starting or driving one job stays in that job (issue 33), on a real server.

An optimiser that raises anything (`MemoryError`, `RecursionError`) ends its job: status
`failed` naming the error, GPUs back at their defaults, a quarantine note in the state bucket
that a restarted replica honours; the replica keeps serving every other job.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.power_limit.job import PowerLimitJob
from coordinator.state import records
from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    collect,
    gpu_info,
    measurements,
    rank_request,
    register_job,
    start,
    stop,
    wait_for,
)
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    JobQuery,
    JobStatus,
    PowerLimitOptions,
    TrainerEvent,
    TrainerEventBatch,
    join_token_digest,
)

pytestmark = pytest.mark.timeout(60)

PROFILE = measurements([(300, 1000.0, 10.0), (250, 700.0, 10.5), (200, 800.0, 13.0)])


def states(statuses: list[JobStatus], job_id: str) -> list[str]:
    return [s.state for s in statuses if s.job_id == job_id]


async def register_one_rank_job(nc, gpu: int, **options) -> str:
    job_id = await register_job(nc, dp=1, power_limit=PowerLimitOptions(**options))
    reply = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0, gpu=gpu))
    assert reply.ok, reply
    return job_id


async def test_a_job_whose_optimiser_cannot_start_fails_alone_and_stays_quarantined(
        nats_server, agent, nc, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "coord")
    start_job = PowerLimitJob.start

    def explode(self: PowerLimitJob) -> list:
        if "boom" in self.job_id:
            raise MemoryError("a hostile description")
        return start_job(self)

    monkeypatch.setattr(PowerLimitJob, "start", explode)
    try:
        bad = await register_job(nc, dp=1, job_metadata="boom",
                                 power_limit=PowerLimitOptions(selector="Energy"))
        assert (await ask(nc, subjects.coord_register_rank(NODE),
                          rank_request(bad, 0, gpu=0))).ok
        await wait_for(lambda: "failed" in states(statuses, bad))
        failed = next(s for s in statuses if s.job_id == bad and s.state == "failed")
        assert "MemoryError" in failed.message and "quarantine" in failed.message
        assert records.job_hash(bad) in coord.failures.quarantined
        assert coord.failures.failed == 1
        # The replica serves every other job: one on the other GPU is optimised to its end.
        good = await register_one_rank_job(nc, 1, selector="Energy", profile=PROFILE)
        await wait_for(lambda: "done" in states(statuses, good))
        assert (await gpu_info(nc, 1))["gpu"]["power_limit_w"] == 250
        assert not task.done()
        query = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=bad))
        assert query.ok and query.result["quarantine"]["job_id"] == bad
        healthy, detail = coord.health()
        assert healthy and detail["quarantined"] == 1
    finally:
        await stop(coord, task)
    monkeypatch.setattr(PowerLimitJob, "start", start_job)  # The cause is gone...
    seen = len(states(statuses, bad))
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        await asyncio.sleep(1.5)  # ...but a restarted replica does not start it again
        # (it may own it, and say so: the owner collects it once idle),
        assert set(states(statuses, bad)[seen:]) <= {"taken_over"}
        assert records.job_hash(bad) in coord.failures.quarantined
        assert coord.jobs.optimiser(bad) is None
        assert coord.link.state is not None
        await coord.link.state.release_quarantine(records.job_hash(bad))  # ...until released.
        await wait_for(lambda: "profiling" in states(statuses, bad)[seen:])
        assert records.job_hash(bad) not in coord.failures.quarantined
    finally:
        await stop(coord, task)
        for index in (0, 1):
            await ask(nc, subjects.gpu_command(NODE, index),
                      {"v": 1, "cmd": {"op": "reset_power_limit"}})


async def test_a_job_that_fails_while_driven_resets_its_gpus_and_the_replica_serves_on(
        nats_server, agent, nc, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        job_id = await register_one_rank_job(nc, 0, selector="Energy", profile=PROFILE)
        await wait_for(lambda: "done" in states(statuses, job_id))
        assert (await gpu_info(nc, 0))["gpu"]["power_limit_w"] == 250

        def recurse(*_args, **_kwargs) -> list:
            raise RecursionError("maximum recursion depth exceeded")

        monkeypatch.setattr(PowerLimitJob, "on_events", recurse)
        batch = TrainerEventBatch(
            job_id=job_id, rank=0, node=NODE, gpu=0,
            events=[TrainerEvent(kind="step_begin", t_ns=1, epoch=0, step=50)],
            join_digest=join_token_digest(JOIN_TOKENS[job_id]))
        await nc.publish(subjects.job_events(job_id, 0, NODE), codec.encode(batch))
        await wait_for(lambda: "failed" in states(statuses, job_id))
        failed = next(s for s in statuses if s.job_id == job_id and s.state == "failed")
        assert "RecursionError" in failed.message
        assert "back at their defaults" in failed.message
        assert (await gpu_info(nc, 0))["gpu"]["power_limit_w"] == 300  # the A40's default
        assert coord.jobs.optimiser(job_id) is None and not task.done()
        monkeypatch.undo()
        other = await register_one_rank_job(nc, 1, selector="Energy", profile=PROFILE)
        await wait_for(lambda: "done" in states(statuses, other))
    finally:
        await stop(coord, task)
        for index in (0, 1):
            await ask(nc, subjects.gpu_command(NODE, index),
                      {"v": 1, "cmd": {"op": "reset_power_limit"}})
