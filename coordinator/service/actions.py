"""`ActionExecutor`: carries out what an optimiser returns.

An optimiser's input goes in through `act` (under the job's lock); its actions come out here:
power limits and schedules go to the agents of the job's GPUs through `GpuCommands` (the one
way GPUs are commanded, only while this replica drives the job); profiles and dumps are written
under names the coordinator makes; progress is recorded (`SaveProgress`); statuses are
published.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord
from coordinator.optimizer import (
    Action,
    ApplyPowerLimit,
    AskSelector,
    ClearSchedules,
    DesiredSchedule,
    InstallSchedules,
    JobOptimizer,
    KeepFile,
    SaveProfile,
    SaveProgress,
    StatusUpdate,
    WriteFile,
)
from coordinator.pipeline.dumps import job_dir_name, keep_dump, write_file
from coordinator.pipeline.schedulers.settings import PFOServerSettings
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.machine import PowerLimitError
from coordinator.service.commands import GpuCommands
from coordinator.service.driver import JobDriver
from coordinator.service.failures import JobFailures
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.progress import ProgressWriter
from coordinator.service.table import JobTable
from zeus_agent.models import MAX_POWER_W, save_power_limit_profile
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    MAX_PROFILE_ROWS,
    ClearScheduleCmd,
    CommandEnvelope,
    GpuBinding,
    InstallScheduleCmd,
    Reply,
    SelectCmd,
    SetPowerLimitCmd,
)

__all__ = ["ActionExecutor"]

LOG = logging.getLogger(__name__)


def _ticker(job: JobOptimizer) -> Callable[[int, Any], list[Action]]:
    """`job.tick` in the shape `act` feeds (rank, item): the item is the time."""
    return lambda _rank, now_s: job.tick(now_s)


def _not_awaited(job: JobOptimizer, ask: AskSelector) -> bool:
    """Whether the job no longer awaits the answer to `ask` (it fell back, or asked again)."""
    choice = job.choice if isinstance(job, PowerLimitJob) else None
    return choice is not None and not choice.answers(ask.rank, ask.request)


class ActionExecutor:
    """Executes the jobs' actions (commands through `commands`, progress through `progress`)."""

    def __init__(self, *, settings: CoordinatorSettings, pfo: PFOServerSettings,
                 clock: Callable[[], float], jobs: JobTable, link: Link, leases: Leases,
                 commands: GpuCommands, failures: JobFailures,
                 progress: ProgressWriter) -> None:
        self.settings = settings
        self.pfo = pfo
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.commands = commands
        self.failures = failures
        self.progress = progress

    async def act(
        self, job_id: str, step: Callable[[int, Any], list[Action]], rank: int, item: Any
    ) -> None:
        """Feed `item` of `rank` to the job's optimiser through `step`; execute what it says.

        The caller holds the job's lock.
        """
        driver = self.jobs.get(job_id)
        record = driver.record if driver is not None else None
        if driver is None or record is None or driver.failed:
            return
        async with self.failures.contained(job_id, "driving the job"):
            try:
                actions = step(rank, item)
            except PowerLimitError as e:
                await self.link.status(job_id, "error", f"power-limit optimiser: {e}")
                return
            await self.execute(record, actions)

    async def act_all(
        self, job_id: str, step: Callable[[int, Any], list[Action]], rank: int,
        items: list[Any], yield_every: int = 256,
    ) -> None:
        """`act` for each of `items` in order, in one containment.

        What a batch of marks or measurements costs is then the optimiser's work, not a context
        manager and a coroutine per item. Each item's actions are carried out before the next
        is fed (as `act` does); one the power-limit machine refuses is reported and the next
        goes on; any other error fails the job (`JobFailures.contained`) and the rest are not
        fed. The caller holds the job's lock.
        """
        driver = self.jobs.get(job_id)
        record = driver.record if driver is not None else None
        if driver is None or record is None or driver.failed:
            return
        async with self.failures.contained(job_id, "driving the job"):
            for i, item in enumerate(items, 1):
                try:
                    actions = step(rank, item)
                except PowerLimitError as e:
                    await self.link.status(job_id, "error", f"power-limit optimiser: {e}")
                    continue
                if actions:
                    await self.execute(record, actions)
                    if driver.failed:
                        return
                if i % yield_every == 0:
                    await asyncio.sleep(0)  # A huge batch lets the lease loops run meanwhile.

    async def tick_jobs(self) -> None:
        """Let time pass for every optimiser driven here (overdue windows...)."""
        now = self.clock()
        for driver in self.jobs.drivers():
            job = driver.optimiser
            if job is None or job.done:
                continue
            async with driver.lock:
                await self.act(driver.job_id, _ticker(job), 0, now)

    async def execute(self, record: JobRecord, actions: list[Action]) -> None:
        """Carry out `actions` of the job, in order (none if this replica's lease is lapsing)."""
        driver = self.jobs.get(record.job_id)
        if actions and not await self.leases.owns_now(record.job_id):
            # Fenced: this replica's lease on the job is about to lapse (it could not renew
            # it), so another replica may take over: it sends no more commands.
            LOG.warning("job %s: %d action(s) not carried out: this replica's lease on the job "
                        "is lapsing", record.job_id, len(actions))
            # What is no command still happens: its progress is kept (written once the lease is
            # renewed or before this replica gives its jobs up, dropped once another replica
            # holds the job), and the files its scheduler produced are written: they record
            # what it computed, whoever carries out its commands.
            kept: list[Action] = [a for a in actions if isinstance(a, SaveProgress | WriteFile)]
            if driver is not None:  # The rest once the lease is this replica's again.
                driver.fence(a for a in actions if not isinstance(a, SaveProgress | WriteFile))
            actions = kept
        elif actions and driver is not None and driver.fenced:
            # The lease is back and these come before the catch-up's task had the job's lock:
            # what was fenced goes first (a stale status after a newer one misleads).
            actions = self.caught_up(driver) + actions
        for action in actions:
            if isinstance(action, ApplyPowerLimit):
                await self.apply_power_limit(record, action.watts)
            elif isinstance(action, SaveProfile):
                await self.save_profile(record, action)
            elif isinstance(action, SaveProgress):
                self.progress.save_progress(record.job_id, action.kind, action.state)
            elif isinstance(action, InstallSchedules):
                await self.install_schedules(record, action)
            elif isinstance(action, ClearSchedules):
                await self.clear_schedules(record)
            elif isinstance(action, KeepFile):
                await self.keep_file(record, action)
            elif isinstance(action, WriteFile):
                await asyncio.to_thread(write_file, action.path, action.content, action.what)
            elif isinstance(action, StatusUpdate):
                await self.link.status(record.job_id, action.state, action.message,
                                       action.progress)
            elif isinstance(action, AskSelector):
                await self.ask_selector(record, action)

    async def catch_up(self, driver: JobDriver) -> None:
        """Carry out what was fenced while this replica's lease was lapsing, as the job stands.

        The lease is this replica's again (no other replica took the job over meanwhile), so
        nothing else will: the job's GPUs get its current limit and schedules (not the ones the
        fenced commands carried: a later command may have gone out since), then its fenced
        statuses, files and questions go out in order. Fenced again if the lease lapses again.
        """
        todo = self.caught_up(driver)
        if todo and driver.record is not None:
            await self.execute(driver.record, todo)

    def caught_up(self, driver: JobDriver) -> list[Action]:
        """`catch_up`'s actions, the fenced ones now taken: none without an optimiser."""
        fenced, job, record = driver.take_fenced(), driver.optimiser, driver.record
        if not fenced or job is None or record is None:
            return []
        LOG.info("job %s: carrying out %d action(s) not carried out while this replica's lease "
                 "was lapsing", driver.job_id, len(fenced))
        todo: list[Action] = []
        watts = job.desired_power_limit
        if watts is not None and any(isinstance(a, ApplyPowerLimit) for a in fenced):
            todo.append(ApplyPowerLimit(watts))
        if any(isinstance(a, InstallSchedules | ClearSchedules) for a in fenced):
            wanted = [w for r in sorted(record.ranks) if (w := job.desired_schedule(r))]
            todo.append(InstallSchedules(tuple(w.schedule for w in wanted), wanted[0].version,
                                         wanted[0].from_step) if wanted else ClearSchedules())
        todo += [a for a in fenced
                 if not isinstance(a, ApplyPowerLimit | InstallSchedules | ClearSchedules)
                 and not (isinstance(a, AskSelector) and _not_awaited(job, a))]
        return todo

    def fenced_at_send(self, record: JobRecord, action: Action) -> None:
        """Keep a command `GpuCommands.command` did not send (fenced at its send).

        The lease lapsed since `execute`'s check: caught up with the others once it is back.
        """
        driver = self.jobs.get(record.job_id)
        if driver is not None:
            driver.fence([action])

    async def ask_selector(self, record: JobRecord, action: AskSelector) -> None:
        """Ask a rank's process, through its GPU's agent, to run the user's selector.

        The answer comes as the rank's `selection` event; a rank that cannot be asked (its
        trainer left, no agent answers) is told to the optimiser at once, which falls back.
        """
        rr = record.ranks.get(action.rank)
        reply: Reply | str = f"rank {action.rank} is not registered"
        if len(action.measurements) > MAX_PROFILE_ROWS:
            reply = (f"the profile has {len(action.measurements)} limits, more than the "
                     f"{MAX_PROFILE_ROWS} a question to a trainer carries: profile fewer "
                     "(a larger pl_step)")
        elif rr is not None:
            cmd = SelectCmd(job_id=record.job_id, request=action.request,
                            measurements=list(action.measurements))
            subject = subjects.gpu_command(rr.gpu.node, rr.gpu.gpu_index, self.settings.prefix)
            envelope = codec.encode(CommandEnvelope(cmd=cmd))
            replies = await self.commands.command(
                record, f"asking rank {action.rank} to choose", [(subject, envelope)])
            if replies is None:  # Fenced: asked again once the lease is back, else by
                self.fenced_at_send(record, action)  # the job's new owner.
                return
            reply = replies[0]
        if isinstance(reply, Reply) and reply.ok:
            return
        why = (f"rank {action.rank}'s process cannot be asked ("
               f"{reply if isinstance(reply, str) else reply.error})")
        job = self.jobs.optimiser(record.job_id)
        if job is not None:
            await self.act(record.job_id, lambda _r, _i: job.selector_unreachable(
                action.request, why), action.rank, None)

    async def save_profile(self, record: JobRecord, action: SaveProfile) -> None:
        """Keep a measured profile: a file of the coordinator's, the state, the job's status."""
        path = self.profile_path(record)
        try:
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(save_power_limit_profile, path, list(action.measurements))
            where = "kept by the coordinator"
        except OSError as e:
            where = f"not kept by the coordinator ({e.strerror or e})"
        measurements = [m.model_dump() for m in action.measurements]
        # A replica taking the job over serves it at once.
        if action.chosen_by_trainer:  # The user's selector chose: a new owner pins the same.
            await self.progress.record(record.job_id, "chosen", {
                "measurements": measurements, "power_limit": action.optimal_power_limit})
        else:
            await self.progress.record(record.job_id, "profile", measurements)
        await self.link.status(
            record.job_id, "profile_saved",
            f"profile measured ({where}); the trainer's drop-in writes its profile_path",
            {"optimal_power_limit_w": action.optimal_power_limit, "measurements": measurements})

    def profile_path(self, record: JobRecord) -> Path:
        """The coordinator's own copy of a job's profile (a name it makes, in its state dir)."""
        return Path(self.settings.state_dir) / "profiles" / f"{subjects.token(record.job_id)}.json"

    async def apply_power_limit(
        self, record: JobRecord, watts: int, gpus: list[GpuBinding] | None = None
    ) -> None:
        """Command every GPU of the job (or only `gpus`) to `watts`, under the job's lease."""
        s = self.settings
        cmd = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(
            power_limit_w=watts, holder=record.job_id, lease_s=s.lease_s)))
        gpus = record.gpus() if gpus is None else gpus
        replies = await self.commands.command(record, f"setting {watts} W", [
            (subjects.gpu_command(g.node, g.gpu_index, s.prefix), cmd) for g in gpus])
        if replies is None:
            self.fenced_at_send(record, ApplyPowerLimit(watts))
        else:
            await self.commands.report_failures(record, f"setting {watts} W", gpus, replies)
            await self.learn_cap(record, replies)

    async def learn_cap(self, record: JobRecord, replies: list[Reply | str]) -> None:
        """An agent clamped the limit to a budget's cap (`capped_w`): profile only under it.

        A power-limit job still profiling is told (`PowerLimitJob.set_cap`); only a lower cap.
        """
        said = [r.result["capped_w"] for r in replies
                if isinstance(r, Reply) and r.ok and "capped_w" in (r.result or {})]
        # (Not a limit, from an agent of another version say: left out, the job not ended.)
        capped = [int(w) for w in said if isinstance(w, int | float) and not isinstance(w, bool)
                  and 1 <= w <= MAX_POWER_W and w == int(w)]
        if len(capped) < len(said):
            LOG.warning("job %s: a reply's capped_w is not a power limit: %s", record.job_id,
                        said)
        job = self.jobs.optimiser(record.job_id)
        if not capped or not isinstance(job, PowerLimitJob) or job.profiled:
            return
        if job.machine.cap_w is None or min(capped) < job.machine.cap_w:
            await self.execute(record, job.set_cap(min(capped)))

    async def reapply(self, record: JobRecord, job: JobOptimizer, why: str) -> None:
        """Apply the job's desired settings again on all its GPUs."""
        limit = job.desired_power_limit
        if limit is not None:
            await self.link.status(record.job_id, "resumed", f"{why}; re-applying {limit} W")
            await self.apply_power_limit(record, limit)
        wanted = [w for r in sorted(record.ranks) if (w := job.desired_schedule(r)) is not None]
        if wanted:
            await self.link.status(record.job_id, "resumed",
                                   f"{why}; installing schedule {wanted[0].version} again")
            await self.install_again(record, wanted)

    async def install_again(self, record: JobRecord, wanted: list[DesiredSchedule]) -> None:
        """Install desired schedules again (an agent restarted, a lease lapsed).

        They switch at the step they were first sent for: a rank past it switches at its next
        iteration, one not there yet still waits for the other ranks (after a takeover that
        step is not known: at once).
        """
        first = wanted[0]
        await self.install_schedules(record, InstallSchedules(
            tuple(w.schedule for w in wanted), first.version, first.from_step))

    async def install_schedules(self, record: JobRecord, action: InstallSchedules) -> None:
        """Install each rank's schedule on the agent of its GPU, under the job's lease."""
        s = self.settings
        requests, targets = [], []
        limit = int(getattr(self.link.nc, "max_payload", 0) or 1 << 20)
        now = self.clock()
        driver = self.jobs.get(record.job_id)
        for schedule in action.schedules:
            rr = record.ranks.get(schedule.rank)
            if rr is None:
                continue
            cmd = InstallScheduleCmd(job_id=record.job_id, schedule=schedule,
                                     holder=record.job_id, lease_s=s.lease_s,
                                     version=action.version, from_step=action.from_step)
            payload = codec.encode(CommandEnvelope(cmd=cmd))
            if len(payload) > limit:
                why = (f"the schedule of rank {schedule.rank} is {len(payload)} bytes, more than "
                       f"one NATS message carries ({limit}): too many instructions per "
                       "iteration, or names too long")
                job = self.jobs.optimiser(record.job_id)
                if job is not None:
                    await self.execute(record, job.abort(why))
                else:
                    await self.link.status(record.job_id, "error", why)
                return
            if driver is not None:
                driver.schedule_sent(schedule.rank, now)
            requests.append((subjects.gpu_command(rr.gpu.node, rr.gpu.gpu_index, s.prefix),
                             payload))
            targets.append(rr.gpu)
        # Not the job's error: an agent that did not answer gets it back when it announces
        # itself again (reconciliation).
        what = f"installing schedule {action.version}"
        replies = await self.commands.command(record, what, requests)
        if replies is None:
            self.fenced_at_send(record, action)
        else:
            await self.commands.report_failures(record, what, targets, replies,
                                                state="install_failed")

    async def clear_schedules(self, record: JobRecord) -> None:
        """Remove the job's schedules from its GPUs (clocks back to default)."""
        cmd = codec.encode(CommandEnvelope(cmd=ClearScheduleCmd()))
        gpus = record.gpus()
        prefix = self.settings.prefix
        replies = await self.commands.command(record, "clearing the schedules", [
            (subjects.gpu_command(g.node, g.gpu_index, prefix), cmd) for g in gpus])
        if replies is None:
            self.fenced_at_send(record, ClearSchedules())
        else:
            await self.commands.report_failures(record, "clearing the schedules", gpus, replies)

    def dump_dir(self, record: JobRecord) -> Path:
        """The job's dump directory: `<dump_dir>/<job id>` (a token if the id is unsafe)."""
        return Path(self.pfo.dump_dir) / job_dir_name(record.job_id)

    async def keep_file(self, record: JobRecord, action: KeepFile) -> None:
        """Write a dump file of the job when dumping is on (`ZEUS_PFO_DUMP_DATA`)."""
        if not self.pfo.dump_data:
            return
        path = self.dump_dir(record) / action.name
        try:
            written = await asyncio.to_thread(keep_dump, path, action.content)
        except OSError as e:
            LOG.warning("job %s: could not write %s: %s", record.job_id, path, e)
            return
        if written is not None and written != path:
            LOG.info("job %s: %s holds other data (dumped before a restart, its progress not "
                     "recorded yet): kept, the new dump is %s", record.job_id, path.name,
                     written.name)
