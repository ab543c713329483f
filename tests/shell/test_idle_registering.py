"""A job whose rank is being registered is not collected as idle, against a real nats-server.

Defect (`bench/cluster_scale.py`, 100,000 GPUs, `--idle-s 130`): 48 ranks failed with
`unknown_job ... removed after being idle`: in the registration burst their job's ranks waited
longer than the idle limit for their writes, and only a rank recorded counted as activity, so
the job was collected under them. Now a rank registration restarts the idle clock when it comes
in, and a job with a rank being recorded is not idle.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.shell.coordinator_kit import (
    NODE,
    ask,
    collect,
    rank_request,
    register_job,
    start,
    stop,
)
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus


async def test_a_rank_in_flight_keeps_its_job_past_the_idle_limit(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "c", lease_s=0.3, max_job_idle_time=1)
    try:
        statuses = await collect(nc, subjects.all_job_status(), JobStatus)
        job_id = await register_job(nc, dp=1)
        state = coord.link.require_state()
        create, written = state.create_rank, asyncio.Event()

        async def slow(*args: Any, **kw: Any) -> Any:
            await written.wait()  # A JetStream write stuck in a registration burst.
            return await create(*args, **kw)

        state.create_rank = slow  # type: ignore[method-assign]
        rank = asyncio.create_task(ask(nc, subjects.coord_register_rank(NODE),
                                       rank_request(job_id, 0)))
        await asyncio.sleep(2.5)  # The idle limit (1 s) passes, collected every 0.1 s.
        assert job_id in coord.jobs
        assert not [s for s in statuses if s.state == "removed"]
        written.set()
        reply = await asyncio.wait_for(rank, 10)
        assert reply.ok, reply
        assert coord.jobs.record(job_id) is not None
        assert coord.jobs.record(job_id).complete  # type: ignore[union-attr]
    finally:
        await stop(coord, task)


async def test_a_refused_rank_retried_does_not_keep_its_job(
        nats_server: Any, agent: Any, nc: Any, tmp_path: Path) -> None:
    """A rank refused every time (its GPU's uuid is another) is no activity of its job.

    Defect (review31): the single-rank path touched the job's idle clock before checking the
    rank's GPU, so an agent retrying a refused rank kept its job from ever being collected
    (the node-batch path touches only for ranks it admits).
    """
    coord, task = await start(nats_server, tmp_path / "c", lease_s=0.3, max_job_idle_time=1)
    try:
        statuses = await collect(nc, subjects.all_job_status(), JobStatus)
        job_id = await register_job(nc, dp=1)
        gone = False
        for _ in range(12):  # 3 s of retries, every 0.25 s: past the idle limit (1 s).
            reply = await ask(nc, subjects.coord_register_rank(NODE),
                              rank_request(job_id, 0, uuid="GPU-not-this-one"))
            if not reply.ok and reply.code == "unknown_job":
                gone = True  # Collected while its refused rank was retried.
                break
            assert not reply.ok and reply.code == "conflict", reply
            await asyncio.sleep(0.25)
        assert gone
        assert job_id not in coord.jobs
        assert [s for s in statuses if s.state == "removed" and s.job_id == job_id]
    finally:
        await stop(coord, task)
