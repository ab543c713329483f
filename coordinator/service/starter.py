"""`OptimiserStarter`: builds a job's optimiser once every rank is in and this replica owns it.

A power-limit job gets a `PowerLimitJob` over the limits every GPU of the job supports (asked of
the agents when the state bucket did not have them); a pipeline job gets a `PipelineJob` with
this coordinator's scheduler (`ZEUS_PFO_*`). Either resumes from the progress its previous
owner recorded, read from JetStream itself (`DurableState.read_progress`); progress that cannot
be resumed is said in the job's status and the optimiser starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord
from coordinator.optimizer import JobOptimizer
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.memory import MB, NodeBudget
from coordinator.pipeline.schedulers.base import SchedulerError
from coordinator.pipeline.schedulers.settings import PFOServerSettings
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.machine import PowerLimitError
from coordinator.power_limit.search import WindowResult
from coordinator.service.actions import ActionExecutor
from coordinator.service.driver import JobDriver
from coordinator.service.failures import JobFailures
from coordinator.service.gpus import GpuDirectory
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.progress import ProgressWriter
from coordinator.service.table import JobTable
from zeus_agent.models import JobInfo, PowerLimitMeasurement, RankInfo

__all__ = ["OptimiserStarter"]

LOG = logging.getLogger(__name__)

RETRY_S = 30.0
"""How long a job whose GPUs' agents did not describe them waits before it is tried again."""


class OptimiserStarter:
    """Starts the jobs' optimisers.

    Attributes:
        budget: What the pipeline jobs driven here keep of their measurements, per node.
    """

    def __init__(self, *, settings: CoordinatorSettings, pfo: PFOServerSettings,
                 clock: Callable[[], float], jobs: JobTable, link: Link, leases: Leases,
                 gpus: GpuDirectory, progress: ProgressWriter, failures: JobFailures,
                 actions: ActionExecutor,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.settings = settings
        self.pfo = pfo
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.gpus = gpus
        self.progress = progress
        self.failures = failures
        self.actions = actions
        self.spawn = spawn
        self.budget = NodeBudget(settings.max_pipeline_mb_per_node * MB, alive=self._driven)

    def _driven(self, job: object) -> bool:
        """Whether `job` (a pipeline job's optimiser) still drives its job here."""
        return self.jobs.optimiser(getattr(job, "job_id", "")) is job

    def maybe_start(self, driver: JobDriver) -> None:
        """Start the job's optimiser if every rank is in and this replica owns the job."""
        if (driver.record is not None and driver.may_start(self.clock())
                and not self.failures.is_quarantined(driver.job_id)
                and self.leases.owns(driver.job_id)):
            driver.begin_start()
            self.spawn(self.start(driver.record))

    async def start(self, record: JobRecord) -> None:
        """Build and adopt the job's optimiser (unless that happened meanwhile)."""
        driver = self.jobs.get(record.job_id)
        if driver is None:
            return  # Forgotten (removed) since `maybe_start`.
        try:
            async with driver.lock:
                if driver.optimiser is not None or not self.leases.owns(record.job_id):
                    return
                if driver.record is not record or self.jobs.get(record.job_id) is not driver:
                    return  # Collected meanwhile.
                if driver.failed is not None or await self.failures.still_quarantined(
                        record.job_id):
                    return  # Set aside: never retried (until an operator releases it).
                if not await self.progress.read_progress(record.job_id):
                    return  # Started again on a later ownership round.
                recorded = driver.recorded or {}
                doing = "resuming the job" if recorded else "starting the job"
                async with self.failures.contained(record.job_id, doing):
                    job: JobOptimizer | None
                    if record.power_limit is None:
                        job = await self._pipeline(record, recorded)
                    else:
                        job = await self._power_limit(record, recorded)
                    if job is not None and self.jobs.get(record.job_id) is driver:
                        await self._adopt(record, driver, job)  # (Unless removed meanwhile.)
        finally:
            driver.start_ended()
        driver.forget_progress()  # Taken in by the optimiser (if it started).

    async def _power_limit(self, record: JobRecord,
                           recorded: dict[str, Any]) -> PowerLimitJob | None:
        """A power-limit job's optimiser (the lock is held), or None (said why)."""
        assert record.power_limit is not None
        gpus = record.gpus()
        limits_of = self.gpus.limits
        # (Also those whose limits came from the state bucket: their counters' periods.)
        missing = [g for g in gpus if (g.node, g.gpu_index) not in limits_of
                   or (g.node, g.gpu_index) not in self.gpus.periods]
        await asyncio.gather(*(self.gpus.describe(g.node, g.gpu_index) for g in missing))
        unknown = [g for g in gpus if (g.node, g.gpu_index) not in limits_of]
        if unknown:
            what = "; ".join(f"{g.node}/gpu{g.gpu_index}: " + self.gpus.why_not.get(
                (g.node, g.gpu_index), "no description") for g in unknown[:8])
            what += " ..." if len(unknown) > 8 else ""
            if any((g.node, g.gpu_index) in self.gpus.refused for g in unknown):
                # Asking again gives the same answer: the job fails (once), never retried.
                await self.failures.fail(record.job_id, f"no usable description of {what}")
                return None
            driver = self.jobs.driver(record.job_id)
            if driver.wait_for_agents(self.clock() + RETRY_S):
                await self.link.status(record.job_id, "waiting",
                                       f"no description of {what}; not optimising until their "
                                       f"agents answer (asked again every {RETRY_S:g} s)")
            return None
        limits = [limits_of[(g.node, g.gpu_index)] for g in gpus]
        lo = max(lim[0] for lim in limits)
        hi = min(lim[1] for lim in limits)
        own = record.power_limit.profile  # the trainer's own profile file, if any
        timeout = self.settings.mark_timeout_s
        period_s = self.gpus.energy_period_s([(g.node, g.gpu_index) for g in gpus])

        def build(measurements: list[PowerLimitMeasurement] | None,
                  resume: list[WindowResult] | dict[str, Any],
                  chosen: int | None) -> PowerLimitJob:
            assert record.power_limit is not None
            return PowerLimitJob(record.job_id, record.power_limit, record.ranks, lo, hi,
                                 measurements, resume=resume, mark_timeout_s=timeout,
                                 chosen=chosen, energy_period_s=period_s)

        if recorded:
            try:  # What the previous owner recorded, if it can be resumed.
                return build(*_recorded(recorded, own))
            except (PowerLimitError, ValueError, TypeError, KeyError, AttributeError) as e:
                await self.link.status(record.job_id, "profiling", f"cannot resume the "
                                       f"progress recorded before ({e}); starting afresh")
        try:
            return build(own, [], None)
        except (PowerLimitError, ValueError, OSError, TypeError, KeyError) as e:
            await self.failures.fail(record.job_id, f"the power-limit optimiser refused to "
                                     f"start: {e}")
            return None

    async def _pipeline(self, record: JobRecord, recorded: dict[str, Any]) -> PipelineJob | None:
        """A pipeline job's frequency optimiser (the lock is held), or None (said why)."""
        pfo, s = self.pfo, self.settings

        def make_scheduler(job_info: JobInfo, ranks: list[RankInfo]) -> Any:
            return pfo.create_scheduler(job_info, ranks)

        first = await asyncio.to_thread(self._next_dump_number, record)
        resume = recorded.get("state") if recorded.get("kind") == "pipeline" else None

        def build(resume: dict[str, Any] | None) -> PipelineJob:
            return PipelineJob(
                record.job_id, record.job, [rr.info for rr in record.ranks.values()],
                make_scheduler, scheduler_name=pfo.scheduler,
                profiling_iterations=s.profiling_iterations,
                switch_lead_steps=s.switch_lead_steps, first_version=first,
                stall_after_s=s.stall_after_s, straggler_threshold=s.straggler_threshold,
                straggler_window=s.straggler_window, resume=resume,
                max_kept_bytes=s.max_pipeline_mb_per_job * MB, budget=self.budget,
                nodes={r: rr.gpu.node for r, rr in record.ranks.items()})

        try:
            try:  # Replaying recorded rounds may plan a frontier: off the event loop.
                return await asyncio.to_thread(build, resume)
            except ValueError as e:
                if resume is None:
                    raise
                await self.link.status(record.job_id, "discovering",
                                       f"cannot resume the recorded progress ({e}); starting over")
                return build(None)
        except (SchedulerError, ValueError) as e:
            await self.failures.fail(record.job_id,
                                     f"the pipeline optimiser refused to start: {e}")
            return None

    async def _adopt(self, record: JobRecord, driver: JobDriver, job: JobOptimizer) -> None:
        """Drive the job with `job` from now on (the lock is held): index its GPUs, start."""
        driver.drive(job)
        for g in record.gpus():  # (The state watch may not have indexed them yet.)
            self.jobs.bind_gpu(driver, g)
        await self.actions.execute(record, job.start())

    def _next_dump_number(self, record: JobRecord) -> int:
        """After the schedules already dumped for this job (by a coordinator before a restart)."""
        folder = self.actions.dump_dir(record)
        numbers = [int(p.name.split(".", 1)[0]) for p in folder.glob("*.sched.json")
                   if p.name.split(".", 1)[0].isdigit()]
        return max(numbers, default=-1) + 1


def _recorded(recorded: dict[str, Any], own: list[PowerLimitMeasurement] | None) -> tuple[
        list[PowerLimitMeasurement] | None, list[WindowResult] | dict[str, Any], int | None]:
    """(measurements, resume, chosen) from a power-limit job's recorded progress.

    Raises:
        ValueError, TypeError, KeyError, AttributeError: The progress is not readable.
    """
    kind, state = recorded.get("kind"), recorded.get("state")
    if kind == "profile" and own is None:
        if not isinstance(state, list) or not state:
            raise ValueError("a recorded profile must be a non-empty list of measurements")
        return [PowerLimitMeasurement(**m) for m in state], [], None
    if kind == "chosen":  # A user's own selector chose before a takeover.
        if not isinstance(state, dict):
            raise ValueError("a recorded choice must be a map")
        rows = [PowerLimitMeasurement(**m) for m in state["measurements"]]
        if not rows:
            raise ValueError("a recorded choice must come with its profile")
        return rows, [], int(state["power_limit"])
    if kind == "windows":  # Measured before a takeover.
        if not isinstance(state, list | dict) or not state:
            raise ValueError("recorded windows must be a non-empty list or map")
        return own, state, None
    return own, [], None
