"""`ScheduleEvents`: one GPU's frequency schedule, applied at its trainer's events.

A `GpuAgent` owns one (`GpuAgent.schedule`), built with what it needs: the GPU's caller (its
`ClockLane` runs on the setters' lane), the agent's current GPU, its lease table, the bound
rank, and the agent's callbacks to expire leases, spawn side tasks and report. What
`on_event` does at once with the bound rank's events (the measuring is the agent's, later):
install a schedule waiting for its step, take each instruction's pair from the
`ScheduleCursor`, apply its clock (`ClockLane`) unless a doorbell's thread did
(`zeus_agent.agent.doorbell`), plan a raise ahead (`EarlyRaises`), arm the doorbell for the
next instruction, and report mismatches. The agent's settings commands install, clear and
forget through its methods; it owns every piece of state it reads.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from zeus_agent.agent.clock_lane import ClockLane, EarlyRaises
from zeus_agent.agent.core import LeaseTable, ScheduleCursor
from zeus_agent.agent.core.boundaries import BoundaryForecast
from zeus_agent.agent.credentials import Received
from zeus_agent.agent.doorbell import ClockDoorbell
from zeus_agent.agent.measuring import Binding
from zeus_agent.gpu.base import GPU
from zeus_agent.gpu.threaded import GPUCaller
from zeus_agent.wire.trainer import EventDatagram, Kind

__all__ = ["SCHEDULE", "PendingSchedule", "ScheduleEvents"]

SCHEDULE = "schedule"
"""The lease kind of a frequency schedule."""


class PendingSchedule(NamedTuple):
    """A validated schedule waiting for the bound rank's step `from_step` to begin."""

    from_step: int
    version: int
    rank: int
    pairs: tuple[tuple[str, int], ...]


class ScheduleEvents:
    """A GPU's installed frequency schedule and what the trainer's events do with it.

    Attributes:
        cursor: Where the bound rank stands in the installed schedule.
        clocks: Applies the schedule's clock changes in the GPU's setters' thread, at once.
        raises: Issues the schedule's raises a lead before their instructions begin.
        boundaries: When the schedule's next clock changes are due (counter reads avoid them).
        doorbell: The trainer's direct line to the clock (`open_doorbell`; calls that block
            only), or None.
        version: Version of the installed schedule (None: none installed).
        pending: A validated schedule waiting for its step, or None.
        clock_mhz: The schedule's clock last asked for (applied or being applied); None:
            unknown. An instruction at the same clock asks nothing: each lock call costs ~1 ms
            on a real GPU.
    """

    def __init__(
        self,
        *,
        index: int,
        caller: GPUCaller,
        gpu: Callable[[], GPU],
        leases: LeaseTable,
        binding: Callable[[], Binding | None],
        expire_leases: Callable[[], Awaitable[object]],
        spawn: Callable[[Awaitable[None]], object],
        report: Callable[[str, str, str, dict[str, Any]], None],
    ) -> None:
        """Create it with no schedule installed.

        Args:
            index: The GPU's index (named by its doorbell).
            caller: The GPU's caller: its setters' lane applies the clocks; a caller whose
                calls block may have a doorbell.
            gpu: The agent's GPU now (an observe-only wrapper once control is lost): locks
                the clocks.
            leases: The agent's lease table: a clock is applied only under a live
                `SCHEDULE` lease.
            binding: The bound rank now (its pid is what a doorbell is armed for).
            expire_leases: Restores every setting whose lease lapsed
                (`GpuAgent.expire_leases`).
            spawn: Runs a side task on the loop, keeping a reference until it ends.
            report: Counts and reports a flood-prone problem
                (`GpuReports.report(counter, code, message, detail)`).
        """
        self._index = index
        self._caller = caller
        self._gpu = gpu
        self._leases = leases
        self._binding = binding
        self._expire_leases = expire_leases
        self._spawn = spawn
        self._report = report
        self.cursor = ScheduleCursor()
        self.clocks = ClockLane(caller, self._lock_if_leased, self._clock_failed)
        self.raises = EarlyRaises(self.clocks)
        self.boundaries = BoundaryForecast()
        self.doorbell: ClockDoorbell | None = None
        self.version: int | None = None
        self.pending: PendingSchedule | None = None
        self.clock_mhz: int | None = None
        self._last_instruction = -1
        """The bound trainer's index of its latest `instruction_begin` (the next is armed)."""
        self._expiring = False
        """An expiry started from the event path is pending (at most one at a time)."""

    @property
    def announced_version(self) -> int | None:
        """The version to announce: the one waiting for its step, else the installed one."""
        return self.pending.version if self.pending is not None else self.version

    # ------------------------------------------------------------------ installing
    def install(self, rank: int, pairs: tuple[tuple[str, int], ...], version: int) -> None:
        """Install a validated schedule now."""
        self.cursor.install(rank, pairs)
        self._changed()
        self.version = version
        self.pending = None

    def install_at(self, pending: PendingSchedule) -> None:
        """Install a validated schedule at the bound rank's first step >= `from_step`."""
        self.pending = pending
        # What was armed or planned for the next instruction may be the next iteration's
        # under the old schedule: its event decides.
        self.raises.cancel()
        if self.doorbell is not None:
            self.doorbell.disarm()

    def clear(self, forget_version: bool = True) -> None:
        """Uninstall the schedule (and the one waiting for its step).

        `forget_version` False: the installed version is still announced (control was lost).
        """
        self.cursor.clear()
        self._changed()
        if forget_version:
            self.version = None
        self.pending = None

    def forget_clock(self) -> None:
        """The clock was set otherwise: the schedule's next instruction asks for its own."""
        self.clock_mhz = None

    # ------------------------------------------------------------------ the bound trainer
    def trainer_bound(self) -> None:
        """A trainer was bound: it counts its instructions from 0 again."""
        if self.doorbell is not None:
            self.doorbell.forget()
            self.clocks.forget_rings()
        self._last_instruction = -1

    def trainer_unbound(self) -> None:
        """The trainer left: no instruction will follow (nothing planned or armed is wanted)."""
        self.raises.clear()
        if self.doorbell is not None:
            self.doorbell.forget()

    def open_doorbell(self, path: str, deliver: Callable[[list[Received]], None], mode: int,
                      gid: int | None, spin_ns: int) -> bool:
        """Open the GPU's doorbell (`ClockDoorbell.opened`) if its calls block; False: none."""
        if self._caller.blocking and self.doorbell is None:
            self.doorbell = ClockDoorbell.opened(path, self.clocks, self._index, deliver, mode,
                                                 gid, spin_ns)
        return self.doorbell is not None

    def close_doorbell(self, timeout_s: float) -> None:
        """Stop the doorbell's threads and remove its socket (none is open afterwards)."""
        doorbell, self.doorbell = self.doorbell, None
        if doorbell is not None:
            doorbell.close(timeout_s)

    # ------------------------------------------------------------------ events
    def on_event(self, ev: EventDatagram) -> bool:
        """Act on one of the bound rank's events at once, on the loop.

        Returns whether its measuring is held back a moment: on a GPU whose calls block, a
        scheduled rank's events are measured a moment later, so the setters' thread gets the
        GIL for the clock change at once.
        """
        pending = self.pending
        if ev.kind is Kind.STEP_BEGIN and pending is not None and ev.a >= pending[0]:
            _, version, rank, pairs = pending
            self.cursor.install(rank, pairs)  # Validated when it arrived.
            self._changed()
            self.version = version
            self.pending = None
            if self.doorbell is not None:
                self._arm_doorbell()  # (Its first instruction: nothing was armed for it.)
        if ev.kind is Kind.STEP_BEGIN and self.cursor.installed:
            self.boundaries.on_step_begin(ev.t_ns)
        if ev.kind is Kind.INSTRUCTION_BEGIN and self.cursor.installed:
            lease = self._leases.get(SCHEDULE)
            if lease is None or time.monotonic_ns() >= lease.deadline_ns:
                # The lease lapsed and the expiry tick has not run yet: never apply a clock
                # without a live lease; restore now.
                self._spawn(self._expire_now())
                return False
            step = self.cursor.on_instruction_begin(ev.name)
            mhz = step.frequency_mhz
            early = self.raises.begun(step.index, ev.t_ns)  # Its raise was issued ahead.
            before = self.clock_mhz
            if self.doorbell is not None:
                self._last_instruction = ev.a
                rung = self.doorbell.claim(ev.a)
                if rung is not None:
                    self.clock_mhz = rung  # Its thread applies it (the arm was a forecast).
            # No clock for it (a mismatch): the instruction keeps the clock it found.
            target = mhz if mhz is not None else before
            if mhz is not None and (mhz != before or early):
                self.boundaries.on_clock_change(ev.t_ns)
            if target is not None and target != self.clock_mhz:
                self.apply_frequency(target, ev.t_ns)
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
        return self._caller.blocking and self.cursor.installed

    def apply_frequency(self, mhz: int, event_ns: int | None = None) -> None:
        """Lock the schedule's clock `mhz` now (`ClockLane`: no task, no lock on the way)."""
        self.clock_mhz = mhz
        self.clocks.want(mhz, event_ns)

    async def _expire_now(self) -> None:
        if self._expiring:
            return  # One is already waiting: every instruction of a burst need not queue one.
        self._expiring = True
        try:
            await self._expire_leases()
        finally:
            self._expiring = False

    def _changed(self) -> None:
        """A schedule was installed, replaced or cleared: what was wanted or forecast is stale."""
        self.clocks.invalidate()
        # A change wanted before may now be dropped in the GPU's thread: the clock is unknown
        # (else the next schedule's instruction at that clock would send nothing).
        self.clock_mhz = None
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
        b = self._binding()
        pair = self.cursor.next_pair()
        if (pair is None or b is None or b.pid is None or pair[1] == self.clock_mhz
                or (self.pending is not None
                    and self.cursor.position >= len(self.cursor.frequencies))):
            self.doorbell.disarm()  # No change, nobody to ring, or the next schedule's turn.
            return
        self.doorbell.arm(b.pid, self._last_instruction + 1, pair[0], pair[1], due_ns)

    def _plan_raise(self, position: int, t_ns: int) -> None:
        """If the next instruction raises the clock, issue the raise a lead before it begins."""
        pair = self.cursor.next_pair()
        if pair is None or self.clock_mhz is None or pair[1] <= self.clock_mhz:
            return  # A lowering (or no change) waits for its event.
        if self.pending is not None and self.cursor.position >= len(self.cursor.frequencies):
            return  # The next iteration may run another schedule.
        self.boundaries.raise_lead(self.raises.ahead.lead_ns)
        self.raises.plan(position, t_ns, pair[1], self._raise_now)

    def _raise_now(self, mhz: int) -> bool:
        """The timer of a raise planned ahead: apply it under a live lease (True: issued)."""
        lease = self._leases.get(SCHEDULE)
        if not self.cursor.installed or lease is None or time.monotonic_ns() >= lease.deadline_ns:
            return False
        self.apply_frequency(mhz)
        if self.doorbell is not None:
            self.doorbell.disarm()  # The instruction's ring has nothing left to do (or spin for).
        return True

    def _clock_failed(self, mhz: int, error: str | None) -> None:
        """On the loop: a change was not applied (`error` None: the lease had lapsed)."""
        self.clock_mhz = None  # Unknown: the next instruction asks again.
        if error is None:
            self._spawn(self._expire_now())
        else:
            self._report("clock_failures", "frequency_failed", error, {"mhz": mhz})

    def _lock_if_leased(self, mhz: int) -> bool:
        """In the GPU's thread: lock the clock if the schedule's lease is still live.

        Checked here, just before the call: the change may have waited in the driver behind a
        counter read (milliseconds on a real GPU) while a short lease ran out.
        """
        lease = self._leases.get(SCHEDULE)
        if lease is None or time.monotonic_ns() >= lease.deadline_ns:
            return False
        self._gpu().lock_sm_clocks_mhz(mhz, mhz)
        return True
