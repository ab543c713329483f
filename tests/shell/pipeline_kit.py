"""A two-pipeline job brought to a served plan in-process, for the shell tests that need one
(budgets moving a Perseus job along its frontier, straggler notices)."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from coordinator.service import CoordinatorService
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import Measurement

ORDER = ["forward", "backward"]
"""Each rank's instructions per iteration (one stage, so one forward and one backward)."""

Scheduler = Callable[[JobInfo, list[RankInfo]], FrequencyScheduler]


def serve_two_pipelines(coord: CoordinatorService, job_id: str,
                        scheduler: Scheduler) -> PipelineJob:
    """The registered job (dp 2, pp 1) as a `PipelineJob` of `scheduler`, fed three iterations
    of both ranks' instructions and steps so that it serves the scheduler's plan, and driven
    by the coordinator from then on."""
    record = coord.registry.jobs[job_id]
    job = PipelineJob(job_id, JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2),
                      [rr.info for rr in record.ranks.values()],
                      scheduler, profiling_iterations=1)
    version: int | None = None
    for step in range(3):
        for rank in (0, 1):
            for i, name in enumerate(ORDER):
                job.on_measurement(rank, Measurement(
                    kind="instruction", name=name, epoch=0, step=step, index=i, t0_ns=10 * i,
                    t1_ns=10 * i + 5, time_s=0.1, energy_j=1.0, schedule=version), 0.0)
            job.on_measurement(rank, Measurement(
                kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=30,
                time_s=1.0, energy_j=10.0, schedule=version), 0.0)
        version = job.version
    assert job.phase == "serving" and not job.done
    coord.jobs.driver(job_id).drive(job)
    return job
