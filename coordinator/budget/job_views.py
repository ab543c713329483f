"""What the budgets know of the jobs: each job's GPUs, and its profile or frontier if known.

The budget loop (`coordinator.budget.loop`) asks this every round, over the drivers of the
replica (`job_views`); a power-limit job another replica drives comes with the profile its
owner recorded in the state bucket (`recorded_profile`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from coordinator.budget import enforce, remote
from coordinator.pipeline import budget_point
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.phase import Phase
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.job_parts import make_selector
from zeus_agent.models import PowerLimitMeasurement

if TYPE_CHECKING:  # (coordinator.service builds the loop: no import cycle at run time)
    from coordinator.service.driver import JobDriver

LOG = logging.getLogger(__name__)


def job_views(drivers: Iterable[JobDriver],
              follows: remote.Recorded | None = None) -> list[enforce.JobView]:
    """What the budgets know of the jobs: their GPUs; their profiles where known.

    A power-limit job with its optimum known brings its measurements: driven by this replica,
    its own; driven by another, the profile its owner recorded in the state bucket
    (`recorded_profile`); a pipeline job serving a plan of its frontier (Perseus) its
    frontier: driven here, its own; driven by another, the one that replica recorded
    (`follows`, `budget.remote`), with what its record says of how it was planned
    (`planned_capped`); every other job (profiling: `profiling`, a job another replica drives
    with nothing recorded, one that failed here: its frontier record is then purged) is
    capped proportionally. Each job's slowdown counts as its registered `priority`.
    """
    views = []
    for driver in drivers:
        record = driver.record
        if record is None or not record.ranks:
            continue
        gpus = tuple(sorted((r.gpu.node, r.gpu.gpu_index) for r in record.ranks.values()))
        job = driver.optimiser
        weight = record.power_limit.priority if record.power_limit is not None else 1.0
        if driver.failed is not None:  # (Driven by no replica: not one another drives.)
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight))
            continue
        frontier = budget_point.frontier_of(job) if isinstance(job, PipelineJob) else None
        if isinstance(job, PowerLimitJob) and job.optimal_power_limit is not None:
            views.append(enforce.JobView(driver.job_id, gpus,
                                         tuple(job.machine.measurements),
                                         job.optimal_power_limit, weight))
        elif job is None and (known := recorded_profile(driver)) is not None:
            views.append(enforce.JobView(driver.job_id, gpus, *known, weight, remote=True))
        elif job is None and follows is not None and (
                theirs := follows.frontier(driver.job_id)) is not None:
            views.append(enforce.JobView(
                driver.job_id, gpus, weight=weight, frontier=theirs,
                own_draw_w=follows.own_draw_w(driver.job_id), remote=True,
                planned_capped=follows.planned_capped(driver.job_id, theirs)))
        elif frontier is not None and isinstance(job, PipelineJob):
            capped = follows is not None and follows.planned_capped(driver.job_id, frontier)
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight, frontier=frontier,
                                         own_point=not job.straggling.stragglers.factors(),
                                         step_times=tuple(job.straggling.step_times),
                                         own_step_s=job.straggling.own_step_s(),
                                         own_draw_w=job.straggling.own_draw_w(),
                                         planned_capped=capped))
        else:
            views.append(enforce.JobView(
                driver.job_id, gpus, weight=weight, remote=job is None,
                profiling=isinstance(job, PipelineJob) and job.phase is Phase.PROFILING))
    return views


def recorded_profile(driver: JobDriver) -> tuple[tuple[PowerLimitMeasurement, ...], int] | None:
    """(measurements, optimum) of a power-limit job another replica drives, as recorded.

    From the profile its owner recorded (`v.prog.<h>`: "profile", or "chosen" by the user's
    own selector). The optimum of a plain profile is the job's selector's choice, as its
    owner made it (a user's own selector records its choice). None: no profile recorded, or
    not readable.
    """
    record, recorded = driver.record, driver.recorded
    if record is None or record.power_limit is None or not recorded:
        return None
    kind, state = recorded.get("kind"), recorded.get("state")
    try:
        if kind == "chosen" and isinstance(state, dict):
            rows = tuple(PowerLimitMeasurement(**m) for m in state["measurements"])
            return (rows, int(state["power_limit"])) if rows else None
        if kind != "profile" or not isinstance(state, list) or not state:
            return None
        rows = tuple(PowerLimitMeasurement(**m) for m in state)
        selector = make_selector(record.power_limit, record.job.world_size)
        return rows, int(selector.select(list(rows)))
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as e:
        LOG.debug("job %s: its recorded profile is not usable for budgets: %s", driver.job_id, e)
        return None
