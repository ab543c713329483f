"""`ActionExecutor`: carries out what an optimiser returns, and is the one way GPUs are commanded.

An optimiser's input goes in through `act` (under the job's lock); its actions come out here:
power limits and schedules go to the agents of the job's GPUs over one reply inbox
(`request_all`), only while this replica drives the job (`command`: ownership is checked just
before the send, so a replica paused while another took its job over never sets a GPU again);
profiles and dumps are written under names the coordinator makes; progress is recorded
(`SaveProgress`); statuses are published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from coordinator.power_limit.machine import PowerLimitError
from zeus_agent.errors import PayloadError
from zeus_agent.models import save_power_limit_profile
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

if TYPE_CHECKING:
    from coordinator.service import CoordinatorService

__all__ = ["ActionExecutor"]

LOG = logging.getLogger(__name__)


def _ticker(job: JobOptimizer) -> Callable[[int, Any], list[Action]]:
    """`job.tick` in the shape `act` feeds (rank, item): the item is the time."""
    return lambda _rank, now_s: job.tick(now_s)


class ActionExecutor:
    """Executes a job's actions for the service `svc`.

    Attributes:
        fenced_commands: GPU commands not sent: the job was no longer this replica's.
    """

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc
        self.fenced_commands = 0

    async def act(
        self, job_id: str, step: Callable[[int, Any], list[Action]], rank: int, item: Any
    ) -> None:
        """Feed `item` of `rank` to the job's optimiser through `step`; execute what it says.

        The caller holds the job's lock.
        """
        svc = self.svc
        driver = svc.jobs.get(job_id)
        record = driver.record if driver is not None else None
        if driver is None or record is None or driver.failed:
            return
        async with svc.failures.contained(job_id, "driving the job"):
            try:
                actions = step(rank, item)
            except PowerLimitError as e:
                await svc.status(job_id, "error", f"power-limit optimiser: {e}")
                return
            await self.execute(record, actions)

    async def tick_jobs(self) -> None:
        """Let time pass for every optimiser driven here (overdue windows...)."""
        svc = self.svc
        now = svc.clock()
        for driver in svc.jobs.drivers():
            job = driver.optimiser
            if job is None or job.done:
                continue
            async with driver.lock:
                await self.act(driver.job_id, _ticker(job), 0, now)

    async def execute(self, record: JobRecord, actions: list[Action]) -> None:
        """Carry out `actions` of the job, in order (none if this replica's lease is lapsing)."""
        svc = self.svc
        if actions and not await svc.replicas.owns_now(record.job_id):
            # Fenced: this replica's lease on the job is about to lapse (it could not renew
            # it), so another replica may take over: it sends no more commands.
            LOG.warning("job %s: %d action(s) not carried out: this replica's lease on the job "
                        "is lapsing", record.job_id, len(actions))
            # What is no command still happens: its progress is kept (written once the lease is
            # renewed or before this replica gives its jobs up, dropped once another replica
            # holds the job), and the files its scheduler produced are written: they record
            # what it computed, whoever carries out its commands.
            actions = [a for a in actions if isinstance(a, SaveProgress | WriteFile)]
        for action in actions:
            if isinstance(action, ApplyPowerLimit):
                await self.apply_power_limit(record, action.watts)
            elif isinstance(action, SaveProfile):
                await self.save_profile(record, action)
            elif isinstance(action, SaveProgress):
                svc.durable.save_progress(record.job_id, action.kind, action.state)
            elif isinstance(action, InstallSchedules):
                await self.install_schedules(record, action)
            elif isinstance(action, ClearSchedules):
                await self.clear_schedules(record)
            elif isinstance(action, KeepFile):
                await self.keep_file(record, action)
            elif isinstance(action, WriteFile):
                await asyncio.to_thread(write_file, action.path, action.content, action.what)
            elif isinstance(action, StatusUpdate):
                await svc.status(record.job_id, action.state, action.message, action.progress)
            elif isinstance(action, AskSelector):
                await self.ask_selector(record, action)

    async def ask_selector(self, record: JobRecord, action: AskSelector) -> None:
        """Ask a rank's process, through its GPU's agent, to run the user's selector.

        The answer comes as the rank's `selection` event; a rank that cannot be asked (its
        trainer left, no agent answers) is told to the optimiser at once, which falls back.
        """
        svc = self.svc
        rr = record.ranks.get(action.rank)
        reply: Reply | str = f"rank {action.rank} is not registered"
        if len(action.measurements) > MAX_PROFILE_ROWS:
            reply = (f"the profile has {len(action.measurements)} limits, more than the "
                     f"{MAX_PROFILE_ROWS} a question to a trainer carries: profile fewer "
                     "(a larger pl_step)")
        elif rr is not None:
            cmd = SelectCmd(job_id=record.job_id, request=action.request,
                            measurements=list(action.measurements))
            subject = subjects.gpu_command(rr.gpu.node, rr.gpu.gpu_index, svc.settings.prefix)
            replies = await self.command(record, f"asking rank {action.rank} to choose",
                                         [(subject, codec.encode(CommandEnvelope(cmd=cmd)))])
            if replies is None:
                return  # Fenced: the job's new owner asks again.
            reply = replies[0]
        if isinstance(reply, Reply) and reply.ok:
            return
        why = (f"rank {action.rank}'s process cannot be asked ("
               f"{reply if isinstance(reply, str) else reply.error})")
        job = svc.jobs.optimiser(record.job_id)
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
            await self.svc.durable.record(record.job_id, "chosen", {
                "measurements": measurements, "power_limit": action.optimal_power_limit})
        else:
            await self.svc.durable.record(record.job_id, "profile", measurements)
        await self.svc.status(
            record.job_id, "profile_saved",
            f"profile measured ({where}); the trainer's drop-in writes its profile_path",
            {"optimal_power_limit_w": action.optimal_power_limit, "measurements": measurements})

    def profile_path(self, record: JobRecord) -> Path:
        """The coordinator's own copy of a job's profile (a name it makes, in its state dir)."""
        return self.svc.state_dir / "profiles" / f"{subjects.token(record.job_id)}.json"

    async def apply_power_limit(
        self, record: JobRecord, watts: int, gpus: list[GpuBinding] | None = None
    ) -> None:
        """Command every GPU of the job (or only `gpus`) to `watts`, under the job's lease."""
        s = self.svc.settings
        cmd = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(
            power_limit_w=watts, holder=record.job_id, lease_s=s.lease_s)))
        gpus = record.gpus() if gpus is None else gpus
        replies = await self.command(record, f"setting {watts} W", [
            (subjects.gpu_command(g.node, g.gpu_index, s.prefix), cmd) for g in gpus])
        if replies is not None:
            await self.report_failures(record, f"setting {watts} W", gpus, replies)

    async def reapply(self, record: JobRecord, job: JobOptimizer, why: str) -> None:
        """Apply the job's desired settings again on all its GPUs."""
        limit = job.desired_power_limit
        if limit is not None:
            await self.svc.status(record.job_id, "resumed", f"{why}; re-applying {limit} W")
            await self.apply_power_limit(record, limit)
        wanted = [w for r in sorted(record.ranks) if (w := job.desired_schedule(r)) is not None]
        if wanted:
            await self.svc.status(record.job_id, "resumed",
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
        svc = self.svc
        s = svc.settings
        requests, targets = [], []
        limit = int(getattr(svc.nc, "max_payload", 0) or 1 << 20)
        now = svc.clock()
        driver = svc.jobs.get(record.job_id)
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
                job = svc.jobs.optimiser(record.job_id)
                if job is not None:
                    await self.execute(record, job.abort(why))
                else:
                    await svc.status(record.job_id, "error", why)
                return
            if driver is not None:
                driver.installed_at[schedule.rank] = now
            requests.append((subjects.gpu_command(rr.gpu.node, rr.gpu.gpu_index, s.prefix),
                             payload))
            targets.append(rr.gpu)
        # Not the job's error: an agent that did not answer gets it back when it announces
        # itself again (reconciliation).
        what = f"installing schedule {action.version}"
        replies = await self.command(record, what, requests)
        if replies is not None:
            await self.report_failures(record, what, targets, replies, state="install_failed")

    async def clear_schedules(self, record: JobRecord) -> None:
        """Remove the job's schedules from its GPUs (clocks back to default)."""
        cmd = codec.encode(CommandEnvelope(cmd=ClearScheduleCmd()))
        gpus = record.gpus()
        prefix = self.svc.settings.prefix
        replies = await self.command(record, "clearing the schedules", [
            (subjects.gpu_command(g.node, g.gpu_index, prefix), cmd) for g in gpus])
        if replies is not None:
            await self.report_failures(record, "clearing the schedules", gpus, replies)

    async def command(self, record: JobRecord, what: str,
                      requests: list[tuple[str, bytes]]) -> list[Reply | str] | None:
        """Send a job's commands to its GPUs if this replica drives the job now (else None).

        The one way a job's GPUs are commanded: ownership is checked just before the send, so
        a replica that was paused (SIGSTOP, a stalled event loop) while another took its job
        over never sets a GPU again, whatever path led here (events after a quiet spell, a
        heartbeat, a lapse, a plan that finished meanwhile).
        """
        if not requests:
            return []
        if not await self.svc.replicas.owns_now(record.job_id):
            self.fenced_commands += len(requests)
            LOG.warning("job %s: %s not sent to %d GPU(s): this replica no longer drives the job",
                        record.job_id, what, len(requests))
            return None
        return await self.request_all(requests)

    async def report_failures(self, record: JobRecord, what: str, gpus: list[GpuBinding],
                              replies: list[Reply | str], state: str = "error") -> None:
        """Say which GPUs did not take a command.

        A GPU whose trainer left (`trainer_left`) is no failure of the job: a command may cross
        the trainer's goodbye, and a trainer that died is reported by its agent (`trainer_gone`).
        """
        errors = [
            f"{g.node}/gpu{g.gpu_index}: {r if isinstance(r, str) else r.error}"
            for g, r in zip(gpus, replies, strict=True)
            if isinstance(r, str) or not (r.ok or r.code == "trainer_left")
        ]
        if errors:
            more = f"; ... ({len(errors)} in all)" if len(errors) > 8 else ""
            await self.svc.status(record.job_id, state,
                                  f"{what} failed on " + "; ".join(errors[:8]) + more)

    def dump_dir(self, record: JobRecord) -> Path:
        """The job's dump directory: `<dump_dir>/<job id>` (a token if the id is unsafe)."""
        return Path(self.svc.pfo.dump_dir) / job_dir_name(record.job_id)

    async def keep_file(self, record: JobRecord, action: KeepFile) -> None:
        """Write a dump file of the job when dumping is on (`ZEUS_PFO_DUMP_DATA`)."""
        if not self.svc.pfo.dump_data:
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

    async def request_all(self, requests: list[tuple[str, bytes]]) -> list[Reply | str]:
        """Send many requests at once over one reply inbox, within `command_timeout_s`.

        Cheaper than one `nc.request` per GPU (no future, timer and task each), which matters
        when a job has thousands of GPUs.

        Returns:
            Per request, in order: the `Reply`, or a text saying why there is none.
        """
        if not requests:
            return []
        nc, timeout_s = self.svc.nc, self.svc.settings.command_timeout_s
        inbox = nc.new_inbox()
        results: list[Reply | str | None] = [None] * len(requests)
        left = len(requests)
        all_in = asyncio.Event()

        async def on_reply(msg: Any) -> None:
            nonlocal left
            try:
                i = int(msg.subject.rsplit(".", 1)[1])
                if results[i] is not None:
                    return
            except (ValueError, IndexError):
                return
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                results[i] = "no agent answers (is zeus-agent running there?)"
            else:
                try:
                    results[i] = codec.decode(msg.data, Reply)
                except PayloadError as e:
                    results[i] = f"bad reply: {e}"
            left -= 1
            if left == 0:
                all_in.set()

        sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
        try:
            for i, (subject, payload) in enumerate(requests):
                await nc.publish(subject, payload, reply=f"{inbox}.{i}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        timeout = f"no reply within {timeout_s:g} s"
        return [timeout if r is None else r for r in results]
