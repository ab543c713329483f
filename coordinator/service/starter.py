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
from typing import TYPE_CHECKING, Any

from coordinator.jobs import JobRecord
from coordinator.optimizer import JobOptimizer
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.memory import MB
from coordinator.pipeline.schedulers.base import SchedulerError
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.machine import PowerLimitError
from coordinator.power_limit.search import WindowResult
from coordinator.service.driver import JobDriver
from zeus_agent.models import JobInfo, PowerLimitMeasurement, RankInfo

if TYPE_CHECKING:
    from coordinator.service import CoordinatorService

__all__ = ["OptimiserStarter"]

LOG = logging.getLogger(__name__)

RETRY_S = 30.0
"""How long a job whose GPUs' agents did not describe them waits before it is tried again."""


class OptimiserStarter:
    """Starts the jobs' optimisers for the service `svc`."""

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc

    def maybe_start(self, driver: JobDriver) -> None:
        """Start the job's optimiser if every rank is in and this replica owns the job."""
        svc = self.svc
        if (driver.record is not None and driver.may_start(svc.clock())
                and not svc.failures.is_quarantined(driver.job_id) and svc.owns(driver.job_id)):
            driver.starting = True
            svc.spawn(self.start(driver.record))

    async def start(self, record: JobRecord) -> None:
        """Build and adopt the job's optimiser (unless that happened meanwhile)."""
        svc = self.svc
        driver = svc.jobs.get(record.job_id)
        if driver is None:
            return  # Forgotten (removed) since `maybe_start`.
        try:
            async with driver.lock:
                if driver.optimiser is not None or not svc.owns(record.job_id):
                    return
                if driver.record is not record or svc.jobs.get(record.job_id) is not driver:
                    return  # Collected meanwhile.
                if driver.failed is not None or await svc.failures.still_quarantined(
                        record.job_id):
                    return  # Set aside: never retried (until an operator releases it).
                if not await svc.durable.read_progress(record.job_id):
                    return  # Started again on a later ownership round.
                recorded = driver.recorded or {}
                doing = "resuming the job" if recorded else "starting the job"
                async with svc.failures.contained(record.job_id, doing):
                    job: JobOptimizer | None
                    if record.power_limit is None:
                        job = await self._pipeline(record, recorded)
                    else:
                        job = await self._power_limit(record, recorded)
                    if job is not None and svc.jobs.get(record.job_id) is driver:
                        await self._adopt(record, driver, job)  # (Unless removed meanwhile.)
        finally:
            driver.starting = False
        driver.recorded = None  # Taken in by the optimiser (if it started).

    async def _power_limit(self, record: JobRecord,
                           recorded: dict[str, Any]) -> PowerLimitJob | None:
        """A power-limit job's optimiser (the lock is held), or None (said why)."""
        svc = self.svc
        assert record.power_limit is not None
        gpus = record.gpus()
        limits_of = svc.gpus.limits
        # (Also those whose limits came from the state bucket: their counters' periods.)
        missing = [g for g in gpus if (g.node, g.gpu_index) not in limits_of
                   or (g.node, g.gpu_index) not in svc.gpus.periods]
        await asyncio.gather(*(svc.gpus.describe(g.node, g.gpu_index) for g in missing))
        unknown = [g for g in gpus if (g.node, g.gpu_index) not in limits_of]
        if unknown:
            what = "; ".join(f"{g.node}/gpu{g.gpu_index}: " + svc.gpus.why_not.get(
                (g.node, g.gpu_index), "no description") for g in unknown[:8])
            what += " ..." if len(unknown) > 8 else ""
            if any((g.node, g.gpu_index) in svc.gpus.refused for g in unknown):
                # Asking again gives the same answer: the job fails (once), never retried.
                await svc.failures.fail(record.job_id, f"no usable description of {what}")
                return None
            driver = svc.jobs.driver(record.job_id)
            driver.retry_at = svc.clock() + RETRY_S
            if not driver.waiting_said:
                driver.waiting_said = True
                await svc.status(record.job_id, "waiting",
                                 f"no description of {what}; not optimising until their agents "
                                 f"answer (asked again every {RETRY_S:g} s)")
            return None
        limits = [limits_of[(g.node, g.gpu_index)] for g in gpus]
        lo = max(lim[0] for lim in limits)
        hi = min(lim[1] for lim in limits)
        own = record.power_limit.profile  # the trainer's own profile file, if any
        timeout = svc.settings.mark_timeout_s
        period_s = svc.gpus.energy_period_s([(g.node, g.gpu_index) for g in gpus])

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
                await svc.status(record.job_id, "profiling", f"cannot resume the progress "
                                 f"recorded before ({e}); starting afresh")
        try:
            return build(own, [], None)
        except (PowerLimitError, ValueError, OSError, TypeError, KeyError) as e:
            await svc.failures.fail(record.job_id, f"the power-limit optimiser refused to "
                                    f"start: {e}")
            return None

    async def _pipeline(self, record: JobRecord, recorded: dict[str, Any]) -> PipelineJob | None:
        """A pipeline job's frequency optimiser (the lock is held), or None (said why)."""
        svc = self.svc
        pfo, s = svc.pfo, svc.settings

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
                max_kept_bytes=s.max_pipeline_mb_per_job * MB, budget=svc.pipeline_budget,
                nodes={r: rr.gpu.node for r, rr in record.ranks.items()})

        try:
            try:  # Replaying recorded rounds may plan a frontier: off the event loop.
                return await asyncio.to_thread(build, resume)
            except ValueError as e:
                if resume is None:
                    raise
                await svc.status(record.job_id, "discovering",
                                 f"cannot resume the recorded progress ({e}); starting over")
                return build(None)
        except (SchedulerError, ValueError) as e:
            await svc.failures.fail(record.job_id, f"the pipeline optimiser refused to start: {e}")
            return None

    async def _adopt(self, record: JobRecord, driver: JobDriver, job: JobOptimizer) -> None:
        """Drive the job with `job` from now on (the lock is held): index its GPUs, start."""
        svc = self.svc
        driver.optimiser = job
        for g in record.gpus():  # (The state watch may not have indexed them yet.)
            svc.jobs.bind_gpu(driver, g)
        await svc.actions.execute(record, job.start())

    def _next_dump_number(self, record: JobRecord) -> int:
        """After the schedules already dumped for this job (by a coordinator before a restart)."""
        folder = self.svc.actions.dump_dir(record)
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
