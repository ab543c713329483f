"""`ScheduleEvents`: a `GpuAgent`'s trainer events while a frequency schedule is installed.

What `on_event` does at once with the bound rank's events (the measuring is later): install a
schedule waiting for its step, take each instruction's pair from the `ScheduleCursor`, apply
its clock (`ClockLane`) unless a doorbell's thread did (`zeus_agent.agent.doorbell`), plan a
raise ahead (`EarlyRaises`), arm the doorbell for the next instruction, and report mismatches.
A mixin of `GpuAgent`, which owns the state declared below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from zeus_agent.agent.clock_lane import ClockLane, EarlyRaises
from zeus_agent.agent.core import LeaseTable, ScheduleCursor
from zeus_agent.agent.core.boundaries import BoundaryForecast
from zeus_agent.agent.doorbell import ClockDoorbell
from zeus_agent.agent.measuring import Binding, RankMeasurer
from zeus_agent.gpu.base import GPU
from zeus_agent.wire.trainer import EventDatagram, Kind

SCHEDULE = "schedule"
"""The lease kind of a frequency schedule."""


class ScheduleEvents:
    """The schedule's side of `GpuAgent.on_event` (a mixin: the state is `GpuAgent`'s)."""

    gpu: GPU
    cursor: ScheduleCursor
    leases: LeaseTable
    clocks: ClockLane
    raises: EarlyRaises
    doorbell: ClockDoorbell | None
    boundaries: BoundaryForecast
    measurer: RankMeasurer
    binding: Binding | None
    caller: Any
    schedule_version: int | None
    _pending_schedule: tuple[int, int, int, tuple[tuple[str, int], ...]] | None
    _clock_mhz: int | None
    _last_instruction: int
    _expiring: bool
    _report: Callable[..., None]

    if TYPE_CHECKING:  # `GpuAgent`'s

        def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]: ...

        async def expire_leases(self) -> list[str]:
            """Restore every setting whose lease lapsed (`GpuAgent.expire_leases`)."""

    def on_event(self, ev: EventDatagram) -> None:
        """Called on the event loop as soon as a datagram arrives: act now, measure later."""
        pending = self._pending_schedule
        if ev.kind is Kind.STEP_BEGIN and pending is not None and ev.a >= pending[0]:
            _, version, rank, pairs = pending
            self.cursor.install(rank, pairs)  # Validated when it arrived.
            self._schedule_changed()
            self.schedule_version = version
            self._pending_schedule = None
            if self.doorbell is not None:
                self._arm_doorbell()  # (Its first instruction: nothing was armed for it.)
        if ev.kind is Kind.STEP_BEGIN and self.cursor.installed:
            self.boundaries.on_step_begin(ev.t_ns)
        if ev.kind is Kind.INSTRUCTION_BEGIN and self.cursor.installed:
            lease = self.leases.get(SCHEDULE)
            if lease is None or time.monotonic_ns() >= lease.deadline_ns:
                # The lease lapsed and the expiry tick has not run yet: never apply a clock
                # without a live lease; restore now.
                self._spawn(self._expire_now())
                self.measurer.submit(ev, self.schedule_version)
                return
            step = self.cursor.on_instruction_begin(ev.name)
            mhz = step.frequency_mhz
            early = self.raises.begun(step.index, ev.t_ns)  # Its raise was issued ahead.
            before = self._clock_mhz
            if self.doorbell is not None:
                self._last_instruction = ev.a
                rung = self.doorbell.claim(ev.a)
                if rung is not None:
                    self._clock_mhz = rung  # Its thread applies it (the arm was a forecast).
            # No clock for it (a mismatch): the instruction keeps the clock it found.
            target = mhz if mhz is not None else before
            if mhz is not None and (mhz != before or early):
                self.boundaries.on_clock_change(ev.t_ns)
            if target is not None and target != self._clock_mhz:
                self._apply_frequency(target, ev.t_ns)
            if self.raises.enabled:
                self._plan_raise(step.index, ev.t_ns)
            if self.doorbell is not None:
                self._arm_doorbell(self.raises.ahead.forecast(step.index, ev.t_ns))
            if step.error is not None:
                self._report("mismatches", "schedule_mismatch", step.error,
                             {"instruction": ev.name, "index": ev.a})
        elif ev.kind is Kind.STEP_END and self.cursor.installed:
            error = self.cursor.on_step_end()
            if error is not None:
                self._report("mismatches", "schedule_mismatch", error, {})
        # A scheduled rank's events on a GPU whose calls block are measured a moment later, so
        # the setters' thread gets the GIL for the clock change at once.
        self.measurer.submit(ev, self.schedule_version,
                             hold=self.caller.blocking and self.cursor.installed)

    async def _expire_now(self) -> None:
        if self._expiring:
            return  # One is already waiting: every instruction of a burst need not queue one.
        self._expiring = True
        try:
            await self.expire_leases()
        finally:
            self._expiring = False

    def _apply_frequency(self, mhz: int, event_ns: int | None = None) -> None:
        """Lock the schedule's clock `mhz` now (`ClockLane`: no task, no lock on the way)."""
        self._clock_mhz = mhz
        self.clocks.want(mhz, event_ns)

    def _schedule_changed(self) -> None:
        """A schedule was installed, replaced or cleared: what was wanted or forecast is stale."""
        self.clocks.invalidate()
        # A change wanted before may now be dropped in the GPU's thread: the clock is unknown
        # (else the next schedule's instruction at that clock would send nothing).
        self._clock_mhz = None
        self.raises.clear()
        self.boundaries.clear()
        if self.doorbell is not None:
            self.doorbell.forget()

    def _arm_doorbell(self, due_ns: int | None = None) -> None:
        """Let the ring of the next instruction apply its clock, if it changes it.

        Past the iteration's last pair, the next iteration's first (after its `step_end`),
        unless a schedule waits for a step. The arm is a forecast: the loop applies its own
        clock if the event says otherwise (an iteration that ended early, an extra instruction).
        `due_ns`: when that instruction is forecast to begin (the doorbell spins around it).
        """
        assert self.doorbell is not None
        b = self.binding
        pair = self.cursor.next_pair()
        if (pair is None or b is None or b.pid is None or pair[1] == self._clock_mhz
                or (self._pending_schedule is not None
                    and self.cursor.position >= len(self.cursor.frequencies))):
            self.doorbell.disarm()  # No change, nobody to ring, or the next schedule's turn.
            return
        self.doorbell.arm(b.pid, self._last_instruction + 1, pair[0], pair[1], due_ns)

    def _plan_raise(self, position: int, t_ns: int) -> None:
        """If the next instruction raises the clock, issue the raise a lead before it begins."""
        pair = self.cursor.next_pair()
        if pair is None or self._clock_mhz is None or pair[1] <= self._clock_mhz:
            return  # A lowering (or no change) waits for its event.
        if self._pending_schedule is not None and self.cursor.position >= len(
                self.cursor.frequencies):
            return  # The next iteration may run another schedule.
        self.boundaries.lead_ns = self.raises.ahead.lead_ns
        self.raises.plan(position, t_ns, pair[1], self._raise_now)

    def _raise_now(self, mhz: int) -> bool:
        """The timer of a raise planned ahead: apply it under a live lease (True: issued)."""
        lease = self.leases.get(SCHEDULE)
        if not self.cursor.installed or lease is None or time.monotonic_ns() >= lease.deadline_ns:
            return False
        self._apply_frequency(mhz)
        if self.doorbell is not None:
            self.doorbell.disarm()  # The instruction's ring has nothing left to do (or spin for).
        return True

    def _clock_failed(self, mhz: int, error: str | None) -> None:
        """On the loop: a change was not applied (`error` None: the lease had lapsed)."""
        self._clock_mhz = None  # Unknown: the next instruction asks again.
        if error is None:
            self._spawn(self._expire_now())
        else:
            self._report("clock_failures", "frequency_failed", error, {"mhz": mhz})

    def _lock_if_leased(self, mhz: int) -> bool:
        """In the GPU's thread: lock the clock if the schedule's lease is still live.

        Checked here, just before the call: the change may have waited in the driver behind a
        counter read (milliseconds on a real GPU) while a short lease ran out.
        """
        lease = self.leases.get(SCHEDULE)
        if lease is None or time.monotonic_ns() >= lease.deadline_ns:
            return False
        self.gpu.lock_sm_clocks_mhz(mhz, mhz)
        return True
