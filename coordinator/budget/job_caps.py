"""Tell the power-limit jobs still profiling the cap a budget holds their GPUs to.

A job still profiling is capped proportionally by its budget (`enforce`); its agents clamp
every limit to that cap, so a window at a limit above it would measure the cap. The job is
told its cap (`PowerLimitJob.set_cap`) and profiles only the limits at or under it; the rest
once the budget lifts (`coordinator.power_limit.capped`). It learns it two ways:

* from the budgets' owner, every round, for the jobs driven on its replica: the lowest cap the
  plan gives the job's GPUs (`planned`);
* from the agents, on any replica: a power-limit command's reply says `capped_w` when the
  agent clamped it (`ActionExecutor.apply_power_limit`).

While a budget governs the job's GPUs its cap only goes down (`job_cap`): a proportional cap
moves a little every round with the measured draws, and each rise would send the job to a limit
it leaves again at the next fall. Every replica knows which GPUs the active budgets govern
(their state bucket and the agents' announcements): once none of the job's is, the cap is
lifted and the job profiles the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Set
from typing import TYPE_CHECKING

from coordinator.budget.budgets import GpuKey
from coordinator.optimizer import Action
from coordinator.power_limit.job import PowerLimitJob

if TYPE_CHECKING:  # (coordinator.service builds this: no import cycle at run time)
    from coordinator.jobs.registry import JobRecord
    from coordinator.service.driver import JobDriver

LOG = logging.getLogger(__name__)

Execute = Callable[["JobRecord", list[Action]], Awaitable[None]]
"""Runs a job's actions (`ActionExecutor.execute`)."""


def job_cap(current: int | None, gpus: Iterable[GpuKey], planned: Mapping[GpuKey, int],
            governed: Set[GpuKey]) -> int | None:
    """A profiling job's cap this round (pure).

    `current`: the cap it knows; `planned`: the owner's caps (empty on another replica);
    `governed`: the GPUs an active budget governs. None once no budget governs its GPUs;
    while one does, the lowest of its current cap and the plan's for its GPUs.
    """
    mine = list(gpus)
    if not any(k in governed for k in mine):
        return None
    caps = [planned[k] for k in mine if k in planned]
    if not caps:
        return current
    return min(caps) if current is None else min(current, *caps)


async def cap_profiling_jobs(drivers: Iterable[JobDriver], execute: Execute,
                             planned: Mapping[GpuKey, int], governed: Set[GpuKey]) -> None:
    """Tell each power-limit job still profiling here its cap (`job_cap`), under its lock."""
    for driver in drivers:
        job, record = driver.optimiser, driver.record
        if not isinstance(job, PowerLimitJob) or job.profiled or record is None:
            continue
        gpus = [(r.gpu.node, r.gpu.gpu_index) for r in record.ranks.values()]
        cap = job_cap(job.machine.cap_w, gpus, planned, governed)
        if cap == job.machine.cap_w:
            continue
        async with driver.lock:
            actions = job.set_cap(cap)
            if actions:
                LOG.info("job %s: %s", driver.job_id,
                         "budget lifted" if cap is None else f"capped at {cap} W")
                await execute(record, actions)
