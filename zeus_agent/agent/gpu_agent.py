"""`GpuAgent`: the asyncio shell around one GPU (sampling, settings, leases, schedules, meter).

It owns one GPU through a `GPUCaller` and the sans-I/O cores of `zeus_agent.agent.core`:
an `EnergyRing` of counter reads (`CounterReader`), a `LeaseTable` of non-default settings and
a `ScheduleCursor`; a `ClockLane` applies the schedule's clocks and a `RankMeasurer`
(`zeus_agent.agent.measuring`) measures the bound rank's steps and instructions. It publishes
through a `publish(subject, bytes)` callable and never touches NATS itself, so it is driven
the same way by the node server (`zeus_agent.agent.server`) and by tests.

Pieces:
* sampling: `sample()` reads the GPU into the ring and the pending sample batch;
* settings: `set_power_limit`, `lock_clocks`, `install_schedule`... validate, apply, lease;
* `restore(kinds)`: put settings back to default (lease expiry, trainer death, shutdown);
* the node cap (`set_node_cap`): a budget's ceiling on the power limit, under a lease of its
  own; every limit applied (a job's, a reset's, a restore's default) is clamped to it, and it
  outlives jobs, trainers and the coordinator until its lease ends or its holder lifts it;
* trainer events: `on_event` (the schedule acts at once: its `ScheduleEvents`, in
  `schedule_events.py`, then `RankMeasurer` measures) and `process_events`;
* `flush_*()`: publish pending samples, trainer events, marks/measurements (`NodeMeasurements`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from types import EllipsisType

from zeus_agent.agent.cap_lane import CapLane
from zeus_agent.agent.clock_lane import ClockLane, EarlyRaises
from zeus_agent.agent.core import (
    EnergyRing,
    Lease,
    LeaseTable,
    LimitHistory,
    ScheduleCursor,
)
from zeus_agent.agent.core.fencing import DEFAULT_SKEW_S, CommandFence
from zeus_agent.agent.core.leases import check_ttl
from zeus_agent.agent.counter_reader import CounterReader
from zeus_agent.agent.credentials import Received
from zeus_agent.agent.doorbell import ClockDoorbell
from zeus_agent.agent.measuring import Binding, RankMeasurer
from zeus_agent.agent.node_batch import NodeMeasurements
from zeus_agent.agent.reports import GpuReports
from zeus_agent.agent.schedule_events import SCHEDULE, PendingSchedule, ScheduleEvents
from zeus_agent.errors import (
    GPUError,
    GPUPermissionError,
    GPUUnavailableError,
    GPUValueError,
    PayloadError,
    TrainerLeftError,
)
from zeus_agent.gpu.base import GPU, GPUInfo
from zeus_agent.gpu.observe_only import ObserveOnlyGPU
from zeus_agent.gpu.threaded import GPUCaller
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    MAX_LEASE_S,
    GpuDescription,
    Sample,
    SampleBatch,
)
from zeus_agent.wire.trainer import EventDatagram, ScheduleNotice, SelectRequest

LOG = logging.getLogger(__name__)
Publish = Callable[[str, bytes], Awaitable[None]]
NotifyTrainer = Callable[[ScheduleNotice | SelectRequest], None]

MIN_LEASE_S = 0.1
"""Shortest lease held for a setting (s): a shorter one (down to 5e-324 s) would lapse before
the setting is even applied; it is held this long instead, one tick of the expiry loop."""

POWER_LIMIT = "power_limit"
SM_CLOCKS = "sm_clocks"
NODE_CAP = "node_cap"
MAX_DEPARTED = 64
"""Jobs remembered per GPU as 'its trainer left' (their settings are refused)."""
FORECAST_NS = 250_000_000
"""How far ahead the counter reader looks for clock changes to avoid (beyond one read's span
and its longest postponement)."""

class GpuAgent:
    """One GPU's agent. Create, then `await start()` before use.

    The server's callbacks: `on_restored(agent, kinds)` after each restore, whatever restored
    (`--history`); `on_control_lost()` when NVML refuses a setter (announced at once).
    `measurements`: the node's publisher of marks and measurements (None: one of its own).
    """

    def __init__(
        self,
        gpu: GPU,
        node: str,
        publish: Publish,
        prefix: str = subjects.DEFAULT_PREFIX,
        sample_hz: float = 10.0,
        ring_seconds: float = 600.0,
        default_lease_s: float = 60.0,
        fence_skew_s: float = DEFAULT_SKEW_S,
        *,
        on_restored: Callable[[GpuAgent, list[str]], None] | None = None,
        on_control_lost: Callable[[], None] | None = None,
        measurements: NodeMeasurements | None = None,
    ) -> None:
        self.gpu = gpu
        self.node = node
        self.prefix = prefix
        self._publish = publish
        self.caller = GPUCaller(gpu)
        self.leases = LeaseTable(max_ttl_s=MAX_LEASE_S)
        try:
            self.default_lease_s = check_ttl(default_lease_s, MAX_LEASE_S)
        except ValueError as e:
            raise ValueError(f"default_lease_s: {e}") from None
        self.fence = CommandFence(fence_skew_s)
        """Refuses commands whose sender's ownership lease is over (`Zeus-Lease`)."""
        self._on_restored, self._on_control_lost = on_restored, on_control_lost
        self.ring = EnergyRing(max(16, int(sample_hz * ring_seconds) + 1024))
        self.counter = CounterReader(
            self.caller, self.ring, int(1e9 / sample_hz),
            # (Called once started: the schedule and measurer are made below.) Reads avoid the
            # schedule's changes; the measurer takes each knot, and waits for one while marks do.
            due_boundaries=lambda now_ns: self.schedule.boundaries.due(now_ns, FORECAST_NS),
            on_knot=lambda: self.measurer.release_measured(),
            wants_knots=lambda: bool(self.measurer.unread),  # (else knots wait)
            # Every update is read while a trainer is bound or marks wait; else ~1 per second.
            is_active=lambda: self.binding is not None or bool(self.measurer.unread))
        """Reads the energy counter when its policy says (never per event) into the ring."""
        self.binding: Binding | None = None
        self._departed: dict[str, None] = {}
        """Jobs whose trainer left this GPU, oldest first (bounded: `MAX_DEPARTED`)."""
        self.limits = LimitHistory()
        """When the power limit changed: step marks carry the limit in force at their event."""
        self.cap = CapLane(self.caller, lambda: self.gpu, self.limits, self.counter)
        """The budget's cap on the power limit (`set_node_cap`)."""
        self.info: GPUInfo | None = None
        self.index = gpu.index
        self._changed: set[str] = set()
        self._settings = asyncio.Lock()
        """Held while a setting is changed or restored: with a blocking backend (NVML) each
        call awaits its thread, and an expiry's restore interleaved with a new set would
        release the lease that set had just granted (the GPU then kept the new limit with no
        lease, and the next tick reset it under the job's renewals)."""
        self._pending_samples: list[Sample] = []
        self._notify_trainer: NotifyTrainer | None = None
        """Pushes a notice (a schedule, a question) to the trainer that said HELLO (`bind`)."""
        self._background: set[asyncio.Future[None]] = set()
        self.last_sample: Sample | None = None
        self.counters = {"mismatches": 0, "gaps": 0, "clock_failures": 0, "restores": 0,
                         "sample_errors": 0, "refused": 0, "fenced": 0}
        self.reports = GpuReports(self.index, node, prefix, publish, self.counters,
                                  lambda: self.binding, self._spawn)
        """Error events; mismatches, measurement gaps, failed clock changes throttled."""
        self.error_event = self.reports.error_event
        self.schedule = ScheduleEvents(
            index=self.index, caller=self.caller, gpu=lambda: self.gpu, leases=self.leases,
            binding=lambda: self.binding, expire_leases=self.expire_leases, spawn=self._spawn,
            report=self.reports.report)
        """The frequency schedule, applied at the bound trainer's events."""
        self.measurements = measurements or NodeMeasurements(node, prefix, publish)
        self.measurer = RankMeasurer(
            index=self.index, node=node, prefix=prefix, ring=self.ring, counter=self.counter,
            limits=self.limits, publish=publish, batches=self.measurements,
            binding=lambda: self.binding, report=self.reports.report,
            refused=self.reports.refused, spawn=self._spawn, counters=self.counters)
        """Measures the bound rank's events once reads bracket them, and publishes them."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self, reset: bool = True) -> GPUInfo:
        """Read the GPU's static facts, reset its settings (unless told not to), sample it.

        Resetting at start is the failsafe for the agent itself: an agent killed with SIGKILL
        cannot restore what it changed, so its successor does.
        """
        self.info = await self.caller.call(self.gpu.info)
        self.cap.start(self.info)
        if not self.info.has_energy_counter:
            self.counter.use_integrator()
        if reset and self.controllable:
            await self.reset_at_start()
        self.power_limit_w = await self.caller.call(self.gpu.get_power_limit_w)
        await self.counter.read_once()
        await self.sample()
        return self.info

    def open_doorbell(self, path: str, deliver: Callable[[list[Received]], None], mode: int,
                      gid: int | None = None, spin_us: float = 0.0) -> bool:
        """Open this GPU's doorbell (`zeus_agent.agent.doorbell`); False: it runs without one.

        Only for a GPU whose calls block: inline calls are already on the loop. `spin_us`: how
        long its thread spins before and after a forecast clock change (0: never).
        """
        return self.schedule.open_doorbell(path, deliver, mode, gid, int(spin_us * 1000))

    def close_doorbell(self, timeout_s: float = 1.0) -> None:
        """Stop the doorbell's threads and remove its socket (shutdown: before the restore)."""
        self.schedule.close_doorbell(timeout_s)

    async def reset_at_start(self) -> None:
        """Put the power limit and SM clocks back to default, whoever changed them."""
        assert self.info is not None
        try:
            limit = await self.caller.call(self.gpu.get_power_limit_w)
            if limit != self.info.default_power_limit_w:
                await self.caller.call(self.gpu.reset_power_limit)
                LOG.warning("GPU %d: power limit %d W at start; reset to the default %d W",
                            self.index, limit, self.info.default_power_limit_w)
            await self.caller.call(self.gpu.reset_sm_clocks)
        except GPUPermissionError as e:
            self.lose_control(str(e))
        except GPUError as e:
            LOG.warning("GPU %d: could not reset settings at start: %s", self.index, e)

    @property
    def controllable(self) -> bool:
        """Whether this agent may change the GPU's settings (not observe-only, privileged)."""
        return not isinstance(self.gpu, ObserveOnlyGPU)

    def observe_only(self, why: str) -> None:
        """From now on, never change this GPU's settings (`why`: the refusals' explanation)."""
        if self.controllable:
            self.gpu = ObserveOnlyGPU(self.gpu, why)

    def lose_control(self, error: str) -> None:
        """NVML answered NO_PERMISSION to a setter: observe only from now on, say so once.

        Privileges are found out, not assumed: an agent without CAP_SYS_ADMIN measures as
        usual, announces the GPU as not controllable (the coordinator then refuses jobs that
        need control there) and refuses settings at once instead of failing command by command.
        """
        if not self.controllable:
            return
        self.observe_only(
            "the agent lacks the privilege to change GPU settings (NVML: NO_PERMISSION); "
            "run it as root or grant CAP_SYS_ADMIN, or pass --observe-only to say it is meant")
        LOG.warning("GPU %d: observe-only from now on: %s", self.index, error)
        self.schedule.clear(forget_version=False)  # Its clocks can no longer be applied.
        if self._on_control_lost is not None:
            self._on_control_lost()

    def count(self, counter: str) -> None:
        """One more of `counter` (`counters`: reported with the GPU's status and metrics)."""
        self.counters[counter] += 1

    def _check_controllable(self) -> None:
        if isinstance(self.gpu, ObserveOnlyGPU):
            raise self.gpu._refuse("changing a setting")

    async def describe(self) -> GpuDescription:
        """The announcement of this GPU, with its current power limit."""
        assert self.info is not None
        limit = await self.caller.call(self.gpu.get_power_limit_w)
        self.power_limit_w = limit
        job_id = self.binding.job_id if self.binding is not None else None
        return GpuDescription.from_info(self.info, limit, job_id,
                                        self.counter.update_period_ms).model_copy(
            update={"schedule_version": self.schedule.announced_version,
                    "controllable": self.controllable})

    @property
    def power_limit_w(self) -> int | None:
        """The power limit this agent last set or read (W)."""
        return self.limits.current

    @power_limit_w.setter
    def power_limit_w(self, limit_w: int | None) -> None:
        self.limits.record(time.monotonic_ns(), limit_w)

    # ------------------------------------------------------------------ sampling
    async def sample(self) -> Sample | None:
        """Take one telemetry sample into the pending batch.

        Its energy is the ring's at the sample's time (`CounterReader.energy_for_sample`): a
        sample never reads the counter itself (a read costs milliseconds and holds the driver).
        Its status is the one read with the newest counter read while that is recent (~1 s old
        at most when no trainer is bound).
        """
        taken, max_age_ns = self.counter.status, self.counter.status_max_age_ns
        try:
            if taken is not None and time.monotonic_ns() - taken[0] < max_age_ns:
                status = taken[1]  # Read with the newest counter read, in the same call.
            else:
                status = await self.caller.call(self.gpu.read_status)  # never the counter
        except GPUError as e:
            self.counters["sample_errors"] += 1
            LOG.warning("GPU %d: sampling failed: %s", self.index, e)
            return None
        t_ns = time.monotonic_ns()
        energy_j = self.counter.energy_for_sample(t_ns)
        if energy_j is None:
            return None  # no counter read has succeeded yet
        s = Sample(t_ns=t_ns, energy_j=energy_j, power_w=status.power_w,
                   power_limit_w=status.power_limit_w, sm_clock_mhz=status.sm_clock_mhz,
                   memory_clock_mhz=status.memory_clock_mhz)  # fmt: skip
        self._pending_samples.append(s)
        self.last_sample = s
        return s

    def energy_between(self, t0_ns: int, t1_ns: int) -> float:
        """Energy (J) between two host-local stamps, at once (may raise WindowOutOfRange).

        From the phase-locked reads; past the newest, the last full update period's power.
        """
        return self.counter.energy_between(t0_ns, t1_ns)

    async def energy_between_exact(self, t0_ns: int, t1_ns: int) -> tuple[float, bool]:
        """`(energy J, exact)` once a read brackets `t1_ns` (see `CounterReader`)."""
        return await self.counter.energy_between_exact(t0_ns, t1_ns)

    # ------------------------------------------------------------------ settings
    def _grant(self, kind: str, holder: str, lease_s: float | None) -> Lease | None:
        """Grant the lease of `kind` before its setting is applied; return the one it replaced.

        A command that names no lease gets the agent's default one: no setting is ever applied
        without a finite lease. A valid lease shorter than `MIN_LEASE_S` is held for
        `MIN_LEASE_S`, so it is still live when the setting is applied.

        Raises:
            PayloadError: `lease_s` is not a finite number of seconds in (0, MAX_LEASE_S]; the
                lease table (and so the GPU) is unchanged.
        """
        previous = self.leases.get(kind)
        ttl_s = self.default_lease_s if lease_s is None else lease_s
        try:
            check_ttl(ttl_s, MAX_LEASE_S)
            self.leases.grant(
                kind, holder or "anonymous", time.monotonic_ns(), max(ttl_s, MIN_LEASE_S)
            )
        except ValueError as e:
            raise PayloadError(str(e), "lease_s") from None
        return previous

    @staticmethod
    def _check_lease_s(lease_s: float | None) -> None:
        if lease_s is None:
            return
        try:
            check_ttl(lease_s, MAX_LEASE_S)
        except ValueError as e:
            raise PayloadError(str(e), "lease_s") from None

    async def set_power_limit(self, power_limit_w: int, holder: str, lease_s: float | None) -> int:
        """Validate, lease, then set (skipped when unchanged) a power limit; return the old one.

        Everything is checked before the GPU is touched; the lease is granted before the limit
        is applied and put back as it was if applying fails. Setting the default limit needs
        no lease (and drops the one held).
        """
        assert self.info is not None
        self._check_controllable()
        self.info.check_power_limit(power_limit_w)
        self._check_lease_s(lease_s)
        self._check_holder(holder)
        to_default = power_limit_w == self.info.default_power_limit_w
        async with self._settings:
            # Again: the trainer may have left while this waited for a restore to finish.
            self._check_holder(holder)
            return await self._set_power_limit(power_limit_w, holder, lease_s, to_default)

    async def _set_power_limit(
        self, power_limit_w: int, holder: str, lease_s: float | None, to_default: bool
    ) -> int:
        previous = None if to_default else self._grant(POWER_LIMIT, holder, lease_s)
        applied = self.cap.capped(power_limit_w)
        try:
            old = await self.caller.call(self.gpu.get_power_limit_w)
            t_ns = time.monotonic_ns()  # Steps that began before the set ran at the old limit.
            if old != applied:
                await self.caller.call(self.gpu.set_power_limit_w, applied)
                self.counter.refresh_limit()  # Samples show it at once, read back.
            self.limits.record(t_ns, applied)
        except GPUPermissionError as e:
            if not to_default:
                self.leases.reinstate(POWER_LIMIT, previous)
            self.lose_control(str(e))  # Said once; later settings are refused at once.
            raise
        except BaseException as e:
            if not to_default:
                self.leases.reinstate(POWER_LIMIT, previous)
            if isinstance(e, GPUUnavailableError):
                # Timed out: the call may still complete in its thread. Count the limit as
                # changed, so the expiry loop restores it unless a lease covers it.
                self._changed.add(POWER_LIMIT)
            raise
        self.cap.job_asks(None if to_default else power_limit_w)
        if to_default:
            self.leases.release(POWER_LIMIT)
            self._changed.discard(POWER_LIMIT)
        else:
            self._changed.add(POWER_LIMIT)
        return old

    async def set_node_cap(self, cap_w: int | None, holder: str, lease_s: float) -> bool:
        """Hold a budget's cap for `lease_s` (None: lift `holder`'s); the limit follows at once.

        Returns False for a lift by another holder than the cap's (nothing changes).
        """
        self._check_controllable()
        async with self._settings:
            if cap_w is None:
                if not self.cap.holder.lift(holder):
                    return False
            else:
                self.cap.holder.set(cap_w, holder, lease_s, time.monotonic_ns())
            await self.cap.follow(self.leases.get(POWER_LIMIT) is not None)
        LOG.info("GPU %d: node cap %s (%s)", self.index, cap_w or "lifted", holder)
        return True

    async def drop_node_cap(self) -> None:
        """Forget the node cap, whoever holds it (the agent stops: the defaults come back)."""
        async with self._settings:
            if self.cap.holder.drop():
                await self.cap.follow(self.leases.get(POWER_LIMIT) is not None)

    async def reset_power_limit(self) -> int:
        """Put the limit back to the default, or to the node cap while one holds below it."""
        await self.restore({POWER_LIMIT}, reason="reset command")
        async with self._settings:
            self.cap.job_asks(None)
            await self.cap.follow(False)
            self.power_limit_w = await self.caller.call(self.gpu.get_power_limit_w)
        return self.power_limit_w or 0

    async def lock_clocks(self, min_mhz: int, max_mhz: int, holder: str,
                          lease_s: float | None) -> None:
        """Validate, lease, then lock an SM clock range (the lease is undone if locking fails)."""
        if min_mhz > max_mhz:
            raise GPUValueError(f"min_mhz ({min_mhz}) must not exceed max_mhz ({max_mhz})")
        assert self.info is not None
        self.info.check_sm_clock(min_mhz)
        self.info.check_sm_clock(max_mhz)
        self._check_controllable()
        self._check_holder(holder)
        async with self._settings:
            self._check_holder(holder)  # The trainer may have left meanwhile.
            previous = self._grant(SM_CLOCKS, holder, lease_s)
            # A schedule's change wanted or rung before it must not land after it.
            self.schedule.clocks.invalidate()
            try:
                await self.caller.call(self.schedule.clocks.exclusive(self.gpu.lock_sm_clocks_mhz),
                                       min_mhz, max_mhz, setter=True)
            except GPUPermissionError as e:
                self.leases.reinstate(SM_CLOCKS, previous)
                self.lose_control(str(e))  # Said once; later settings are refused at once.
                raise
            except BaseException:
                self.leases.reinstate(SM_CLOCKS, previous)
                raise
            self._changed.add(SM_CLOCKS)
            self.schedule.forget_clock()  # Locked by hand: a schedule's next instruction asks.

    async def install_schedule(self, job_id: str, schedule: FrequencySchedule, holder: str,
                               lease_s: float | None, version: int = 0,
                               from_step: int | None = None) -> None:
        """Validate, lease, then install a frequency schedule for the bound rank.

        With `from_step`, the schedule waits for the rank's first `step_begin` whose step
        counter is >= `from_step` (all ranks switch at the same iteration boundary); the bound
        trainer is told at once (a `ScheduleNotice`) so its drop-in switches there too.
        """
        assert self.info is not None
        clocks = set(self.info.supported_graphics_clocks_mhz) or None
        self._check_controllable()
        self._check_lease_s(lease_s)
        self._check_holder(holder or job_id)
        try:
            ScheduleCursor().install(schedule.rank, list(schedule.frequencies), clocks)
        except ValueError as e:
            raise GPUValueError(f"schedule refused for GPU {self.index}: {e}") from None
        pairs = tuple((name, freq) for name, freq in schedule.frequencies)
        async with self._settings:
            self._check_holder(holder or job_id)  # The trainer may have left meanwhile.
            self._grant(SCHEDULE, holder or job_id, lease_s)
            if from_step is None:
                self.schedule.install(schedule.rank, pairs, version)
            else:
                self.schedule.install_at(PendingSchedule(from_step, version, schedule.rank, pairs))
            self._changed.add(SCHEDULE)
        b = self.binding
        if self.reaches_trainer and b is not None and b.job_id == job_id:
            notice = ScheduleNotice(job_id=job_id, rank=schedule.rank, version=version,
                                    from_step=from_step or 0, frequencies=list(pairs))
            try:
                self.tell_trainer(notice)
            except Exception as e:  # noqa: BLE001 - the trainer is told best-effort
                LOG.warning("GPU %d: could not tell the trainer its schedule: %s", self.index, e)

    @property
    def changed(self) -> frozenset[str]:
        """The settings now away from their defaults (what a lapsed lease restores)."""
        return frozenset(self._changed)

    def renew_leases(self, holder: str, lease_s: float) -> list[str]:
        """Renew every lease of `holder` on this GPU (a bad `lease_s` raises PayloadError)."""
        try:
            renewed: list[str] = list(self.leases.renew(holder, time.monotonic_ns(), lease_s))
        except ValueError as e:
            raise PayloadError(str(e), "lease_s") from None
        if self.cap.holder.renew(holder, lease_s, time.monotonic_ns()):
            renewed.append(NODE_CAP)
        return renewed

    async def restore(self, kinds: Collection[str] | None = None, reason: str = "") -> list[str]:
        """Put settings back to default; `kinds` None means everything changed. Idempotent."""
        async with self._settings:
            return await self._restore(kinds, reason)

    async def _restore(self, kinds: Collection[str] | None, reason: str) -> list[str]:
        todo = set(self._changed) if kinds is None else set(kinds) & self._changed
        restored: list[str] = []
        if SCHEDULE in todo:
            self.schedule.clear()
            self.leases.release(SCHEDULE)
            todo.add(SM_CLOCKS)  # the schedule locked clocks: unlock them too
            restored.append(SCHEDULE)
        # Observe-only: nothing was set (`_changed` is empty), so nothing is reset. A GPU that
        # lost control (NVML said NO_PERMISSION to one setter) gets back what another did set:
        # never left throttled.
        gpu = self.gpu.wrapped if isinstance(self.gpu, ObserveOnlyGPU) else self.gpu
        reset_limit, capped_w = self.cap.restore_call(gpu)  # The default, or a cap below it.
        for kind, call in (
            (POWER_LIMIT, reset_limit),
            (SM_CLOCKS, gpu.reset_sm_clocks),
        ):
            if kind not in todo:
                continue
            t_ns = time.monotonic_ns()
            try:
                if kind == SM_CLOCKS:  # Never overtaken by a change rung from the doorbell.
                    await self.caller.call(self.schedule.clocks.exclusive(call), setter=True)
                else:
                    await self.caller.call(call)
            except GPUError as e:
                LOG.error("GPU %d: restoring %s failed: %s", self.index, kind, e)
                continue
            if kind == POWER_LIMIT and self.info is not None:
                self.cap.job_asks(None)
                self.limits.record(t_ns, capped_w)
                self.counter.refresh_limit()
            if kind == SM_CLOCKS:
                self.schedule.forget_clock()
            self.leases.release(kind)
            restored.append(kind)
        self._changed -= set(restored)
        if restored:
            self.counters["restores"] += 1
            LOG.info("GPU %d: restored %s to default%s", self.index, ", ".join(restored),
                     f" ({reason})" if reason else "")
            if self._on_restored is not None:
                self._on_restored(self, restored)
        return restored

    async def expire_leases(self) -> list[str]:
        """Restore every setting whose lease lapsed; returns the kinds restored.

        A changed setting that holds no lease (its restore failed before, or a set that timed
        out completed in its thread afterwards) is restored again on every call until it is.
        """
        async with self._settings:
            if self.cap.holder.expire(time.monotonic_ns()) is not None:
                LOG.info("GPU %d: the node cap's lease ended; the limit may rise", self.index)
                try:
                    await self.cap.follow(self.leases.get(POWER_LIMIT) is not None)
                except GPUError as e:
                    LOG.error("GPU %d: could not raise the limit past the cap: %s", self.index, e)
            lapsed = self.leases.expire(time.monotonic_ns())
            orphaned = {k for k in self._changed if self.leases.get(k) is None}
            if orphaned and not lapsed:
                return await self._restore(orphaned, reason="setting left without a lease")
            if not lapsed:
                return []
            kinds = {lease.kind for lease in lapsed}
            holders = sorted({lease.holder for lease in lapsed})
            restored = await self._restore(kinds, reason="lease expired")
        await self.error_event(
            "lease_expired",
            f"GPU {self.index}: lease of {', '.join(sorted(kinds))} held by {', '.join(holders)} "
            "expired without renewal; restored defaults",
            detail={"restored": restored},
        )
        return restored

    # ------------------------------------------------------------------ trainer events
    def on_event(self, ev: EventDatagram) -> None:
        """Called on the loop as soon as a datagram arrives: the schedule acts, measuring waits."""
        hold = self.schedule.on_event(ev)
        self.measurer.submit(ev, self.schedule.version, hold=hold)

    # The schedule's parts, as other modules and tests name them on the agent.
    @property
    def cursor(self) -> ScheduleCursor:
        """Where the bound rank stands in the installed schedule (`ScheduleEvents.cursor`)."""
        return self.schedule.cursor

    @property
    def clocks(self) -> ClockLane:
        """The schedule's clock lane (`ScheduleEvents.clocks`)."""
        return self.schedule.clocks

    @property
    def raises(self) -> EarlyRaises:
        """The schedule's raises ahead (`ScheduleEvents.raises`)."""
        return self.schedule.raises

    @property
    def doorbell(self) -> ClockDoorbell | None:
        """The GPU's doorbell, if open (`open_doorbell`)."""
        return self.schedule.doorbell

    def bind(self, job_id: str, rank: int, pid: int | None = None, uid: int | None = None,
             join_digest: str | None = None,
             notify: NotifyTrainer | None | EllipsisType = ...) -> None:
        """Measure the events of `job_id`'s `rank` (driven by process `pid`) on this GPU.

        `notify`: pushes notices to the trainer (the gateway's, from its HELLO); None: it cannot
        be told; left out (the coordinator's bind): the trainer told so far still is.
        """
        if not isinstance(notify, EllipsisType):
            self._notify_trainer = notify
        self.measurer.release_held()  # Those held back are measured as bound when they came.
        self.schedule.trainer_bound()
        if self.binding is None or (self.binding.job_id, self.binding.rank) != (job_id, rank):
            self.measurer.reset()
            self.reports.rebound()
        self._departed.pop(job_id, None)
        self.binding = Binding(job_id, rank, pid, uid, join_digest)
        self.counter.wake()  # Bound: its reader reads every update from the next one on.

    @property
    def reaches_trainer(self) -> bool:
        """Whether notices can be pushed to a trainer here (`tell_trainer`)."""
        return self._notify_trainer is not None

    def tell_trainer(self, notice: ScheduleNotice | SelectRequest) -> None:
        """Push `notice` to the trainer (nothing when it cannot be told: `reaches_trainer`)."""
        if self._notify_trainer is not None:
            self._notify_trainer(notice)

    def unbind(self) -> None:
        """Forget the bound rank (a trainer that left: its job may not set this GPU again)."""
        self.measurer.release_held()
        self.schedule.trainer_unbound()
        if self.binding is not None and self.binding.pid is not None:
            self._departed[self.binding.job_id] = None
            while len(self._departed) > MAX_DEPARTED:
                del self._departed[next(iter(self._departed))]
        self.binding = None
        self.measurer.reset()

    def _check_holder(self, holder: str) -> None:
        """Refuse a job's setting once its trainer has left this GPU (until it binds again)."""
        if holder in self._departed and (self.binding is None or self.binding.job_id != holder):
            raise TrainerLeftError(
                f"the trainer of job {holder!r} has left GPU {self.index}: its settings are not "
                "applied again (the GPU stays at its default until a trainer binds it)"
            )

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        """Run a side task (error events, clock changes), keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def process_events(self) -> None:
        """Forever: read the counter (`CounterReader.run`), measure and flush queued events.

        Energies go out once reads bracket them (`RankMeasurer`). No event reads the counter:
        on a real GPU a read costs milliseconds and a clock change would queue behind it.
        """
        reads = asyncio.ensure_future(self.counter.run())
        try:
            await self.measurer.run()
        finally:
            reads.cancel()
            # Its reader thread has ended (`CounterReader.run`) before the agent restores the
            # GPU and closes its caller at shutdown.
            with contextlib.suppress(asyncio.CancelledError):
                await reads

    # ------------------------------------------------------------------ publishing
    async def flush_samples(self) -> Sample | None:
        """Publish the pending samples as one batch; the newest of them (None: none)."""
        if not self._pending_samples or self.info is None:
            return None
        batch, self._pending_samples = self._pending_samples, []
        msg = SampleBatch(node=self.node, gpu=self.index, uuid=self.info.uuid, samples=batch)
        await self._publish(subjects.gpu_samples(self.node, self.index, self.prefix),
                            codec.encode(msg))
        return batch[-1]

    async def flush_measurements(self) -> None:
        """Forward pending trainer events; publish the node's pending marks/measurements now."""
        await self.measurer.flush()
        await self.measurements.flush()
