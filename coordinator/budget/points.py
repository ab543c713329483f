"""The frontier points the budgets give the Perseus (pipeline) jobs, and telling them.

The plans give a pipeline job one of its frontier's points (`frontier_points`); the replica
driving the job serves it (`serve_points`), and measures the option it runs (`told_key`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from coordinator.budget import enforce, frontier_options
from coordinator.optimizer import Action
from coordinator.pipeline import budget_point
from coordinator.pipeline.job import PipelineJob

if TYPE_CHECKING:  # (coordinator.service builds the loop: no import cycle at run time)
    from coordinator.jobs.registry import JobRecord
    from coordinator.service.driver import JobDriver

Execute = Callable[["JobRecord", list[Action]], Awaitable[None]]
"""Runs a job's actions (`ActionExecutor.execute`)."""


async def serve_points(drivers: Iterable[JobDriver], execute: Execute,
                       points: Mapping[str, tuple[int, float]]) -> None:
    """Tell each pipeline job driven here the frontier point a budget gives it, or none.

    `points`: job -> (frontier index, power per GPU); a job absent from it goes back to its
    own chosen point (`budget_point.serve`). The actions run under the job's lock.
    """
    for driver in drivers:
        job, record = driver.optimiser, driver.record
        if not isinstance(job, PipelineJob) or record is None:
            continue
        want = points.get(driver.job_id)
        if want is None and job.straggling.budget is None and not job.straggling.governed:
            continue
        async with driver.lock:
            actions = budget_point.serve(job, want)
            if actions:
                await execute(record, actions)


async def reprofile_jobs(drivers: Iterable[JobDriver], execute: Execute,
                         job_ids: set[str]) -> set[str]:
    """Ask the pipeline jobs `job_ids` driven here to profile again; those that will.

    Their frontiers were planned under a budget's caps and no budget governs their GPUs now
    (`CappedProfiles.to_reprofile`). The actions (the progress recorded) run under the job's
    lock.
    """
    asked: set[str] = set()
    for driver in drivers:
        job, record = driver.optimiser, driver.record
        if driver.job_id not in job_ids or not isinstance(job, PipelineJob) or record is None:
            continue
        async with driver.lock:
            actions = budget_point.reprofile(job)
            if actions is not None:
                asked.add(driver.job_id)
                await execute(record, actions)
    return asked


def frontier_points(plans: Iterable[enforce.CapPlan], jobs: Iterable[enforce.JobView],
                    ratios: Mapping[str, float] | None = None) -> dict[str, tuple[int, float]]:
    """Job -> (frontier index, power per GPU) the plans give its pipeline jobs.

    A job governed by several budgets serves the point of least power among theirs (along a
    frontier, the slowest); a job given its own chosen point is told that one (it keeps its
    plan, capped). A job no plan governs is absent. The power is the job's planned one: for
    a frontier point, its plan's (the allocator counts a point served at its measured draw,
    which `budget_point.pick` would take for a changed frontier); for a throttled option, the
    allocator's; over the job's calibration `ratios`.
    """
    frontiers = {j.job_id: j.frontier for j in jobs if j.frontier is not None}
    points: dict[str, tuple[int, float]] = {}
    for p in plans:
        for share in p.allocation.shares:
            f = frontiers.get(share.job_id)
            if f is None or share.key is None:
                continue
            if 0 <= share.key < len(f.powers):
                power = f.powers[share.key]
            else:
                power = share.expected_w / max(1, len(p.members.get(share.job_id, ())))
            power /= (ratios or {}).get(share.job_id, 1.0)
            if share.job_id not in points or power < points[share.job_id][1]:
                points[share.job_id] = (share.key, power)
    return points


def told_key(job: enforce.JobView, told: tuple[int, float] | None) -> int | None:
    """The option a pipeline job runs, told `told` (None: its own point, or a straggler's).

    The point it serves (`frontier_options.served`), not the index told: a point recorded
    for a frontier it planned before is served as another of this one.
    """
    f = job.frontier
    if told is None or f is None or not job.own_point:
        return None
    key = frontier_options.served(f, *told)
    return None if key == f.chosen else key
