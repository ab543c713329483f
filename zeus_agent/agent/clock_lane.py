"""How a schedule's clock changes reach the GPU: at once on their event, raises ahead of it.

* `ClockLane`: a change goes from the event path straight to the GPU's setters' thread.
* `EarlyRaises`: a raise is issued a lead before its instruction is forecast to begin.


An `instruction_begin` that changes the clock is issued at once from `GpuAgent.on_event`: the
change is queued on the GPU's setters' lane (`GPUCaller.submit_setter`) with no task, no lock
and no extra loop iteration in between (each would cost a few hundred microseconds on a
2-core VM: a spawned task would run only after the measuring of the same event). The lane still
guarantees:

* a stale clock is never applied: changes wanted while one is being applied are coalesced and
  only the latest is applied (behind a hung GPU: the hung call, then at most two more: a raise
  issued ahead of its instruction does not replace the change of the instruction still
  running, it follows it);
* a change wanted before the schedule was restored, cleared or replaced (`invalidate`) is
  dropped in the GPU's thread, and the schedule's lease is checked there again, just before
  the call (`apply`), since the call may have waited behind a read in the driver;
* a restore is never overtaken: its reset runs on the same lane, in the order issued, and
  holds the lane's apply lock (`exclusive`), which a change holds from its epoch check to its
  call's return.

A change can also come from the GPU's doorbell thread (`ring`, `zeus_agent.agent.doorbell`):
the trainer's own datagram woke it, so the change skips both the loop and the hop to the
setters' thread. It joins the same wanted list and runs in the ringing thread unless a drain is
running; the apply lock keeps it behind any restore that invalidated it.

Failures come back to the loop (`on_failed`); successes only leave their latency (the
trainer's stamp -> the call returned), which calibrates how early a raise is issued
(`zeus_agent.agent.core.raise_ahead`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from zeus_agent.agent.core.raise_ahead import RaiseAhead
from zeus_agent.errors import GPUError, GPUUnavailableError, ReadOnlyError
from zeus_agent.gpu.threaded import GPUCaller

__all__ = ["ClockLane", "EarlyRaises"]

LOG = logging.getLogger(__name__)

T = TypeVar("T")


def _nothing() -> None:
    """A call that marks its place in the setters' lane."""


LATENCIES_KEPT = 256
"""Recent event -> applied latencies kept (ns)."""


class ClockLane:
    """Applies one GPU's schedule clocks in its setters' thread (inline when calls don't block).

    Attributes:
        latencies: The latest event -> applied latencies (ns) of changes issued on an event
            (appended in the GPU's thread; read on the loop).
        epoch: Bumped by `invalidate`; a change carries the epoch it was wanted in.
    """

    def __init__(
        self,
        caller: GPUCaller,
        apply: Callable[[int], bool],
        on_failed: Callable[[int, str | None], None],
    ) -> None:
        """Create the lane.

        Args:
            caller: The GPU's caller (its setters' lane when calls block).
            apply: Called in the GPU's thread with a clock (MHz): locks it and returns True, or
                returns False when the schedule's lease has lapsed (nothing applied).
            on_failed: Called on the loop with the clock and the error (None: the lease had
                lapsed) of a change that was not applied.
        """
        self._caller = caller
        self._apply = apply
        self._on_failed = on_failed
        self._guard = threading.Lock()
        self._wanted: list[tuple[int, int, int | None]] = []
        """(MHz, epoch, event stamp ns or None) of the changes not yet taken: the latest one
        wanted on an event, then the latest raise wanted ahead of its event."""
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._apply_lock = threading.Lock()
        """Held from a change's epoch check to its call's return, and by `exclusive` calls."""
        self._applied: tuple[int, int] | None = None
        """(MHz, epoch) of the last clock locked; None after a restore, failure or hand lock."""
        self.epoch = 0
        self.asked = 0
        """Changes asked for on the loop (`want`) so far: a ring armed before the latest one
        is older than it and is dropped."""
        self._rang = -1
        """The instruction index of the latest ring taken (rings from two threads may race)."""
        self.latencies: deque[int] = deque(maxlen=LATENCIES_KEPT)

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Report failures of changes rung from another thread to `loop` (the agent's)."""
        self._loop = loop

    def invalidate(self) -> None:
        """Drop every change wanted so far (a restore, a clear or a new schedule)."""
        self.epoch += 1

    def exclusive(self, call: Callable[..., T]) -> Callable[..., T]:
        """`call` wrapped to run under the apply lock, forgetting the clock last locked.

        For a call that changes the clocks outside the lane (a restore's reset, a lock by
        hand): a change checked against the old epoch has returned before it starts.
        """

        def run(*args: Any) -> T:
            with self._apply_lock:
                self._applied = None
                return call(*args)

        run.__qualname__ = getattr(call, "__qualname__", "exclusive")
        return run

    def want(self, mhz: int, event_ns: int | None = None) -> None:
        """Apply `mhz` as soon as the GPU allows (on the loop's thread; returns at once).

        Args:
            mhz: The SM clock to lock.
            event_ns: The trainer's stamp of the event that asked for it (its latency is
                kept), or None (an early raise: no event yet).
        """
        if not self._caller.blocking:
            self._run(mhz, self.epoch, event_ns)
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        change = (mhz, self.epoch, event_ns)
        with self._guard:
            self.asked += 1
            wanted = self._wanted
            if event_ns is None and wanted and wanted[0][2] is not None:
                self._wanted = [wanted[0], change]  # The running instruction's, then the raise.
            else:
                self._wanted = [change]
            if self._draining:
                return  # The running drain takes it next.
            self._draining = True
        try:
            self._caller.submit_setter(self._drain)
        except (GPUUnavailableError, RuntimeError) as e:  # closed (shutting down)
            with self._guard:
                self._wanted, self._draining = [], False
            self._on_failed(mhz, str(e))

    def forget_rings(self) -> None:
        """A new trainer: its instruction indices start again.

        The old trainer's arms are stale (`asked` moves on).
        """
        with self._guard:
            self._rang = -1
            self.asked += 1

    def ring(self, mhz: int, epoch: int, event_ns: int, asked: int, instruction: int,
             accept: Callable[[], bool] = lambda: True) -> bool:
        """From a doorbell's thread: apply instruction `instruction`'s `mhz`.

        It was armed in `epoch`, after `asked` changes. Applied in this thread, or, if a
        drain is running in another, next by that drain.
        Dropped (False) if the loop asked for a change since it armed this one (its event
        overtook this thread, or a new schedule began), or if a later instruction's ring got
        here first: either is newer; or if `accept()` (the doorbell's last word, asked under
        the lane's guard) says no.
        """
        with self._guard:
            if asked != self.asked or instruction <= self._rang or not accept():
                return False
            self._rang = instruction
            self._wanted = [(mhz, epoch, event_ns)]  # Older than the arm: stale.
            drain = not self._draining
            self._draining = True
        if drain:
            self._drain()
        return True

    async def drained(self, timeout_s: float = 5.0) -> None:
        """Wait until every change wanted or rung so far has been applied or dropped."""
        if self._caller.blocking:
            deadline = time.monotonic() + timeout_s
            await self._caller.call(_nothing, timeout_s=timeout_s, setter=True)
            while self._draining and time.monotonic() < deadline:  # (a doorbell's thread)
                await asyncio.sleep(0.001)

    def _drain(self) -> None:
        """In the GPU's thread: apply the latest wanted change until none is left."""
        while True:
            with self._guard:
                wanted, self._wanted = self._wanted, []
                if not wanted:
                    self._draining = False
                    return
            for change in wanted:
                self._run(*change)

    def _run(self, mhz: int, epoch: int, event_ns: int | None) -> None:
        with self._apply_lock:
            if epoch != self.epoch:
                return  # Wanted before a restore or another schedule: stale.
            if self._applied == (mhz, epoch):
                return  # Locked there already (a raise issued ahead, then its ring).
            self._applied = None
            try:
                applied = self._apply(mhz)
            except (GPUError, ReadOnlyError) as e:
                self._failed(mhz, str(e))
                return
            except Exception as e:  # noqa: BLE001 - the lane must outlive a backend's bug
                # Raised out of `_drain`, it would leave `_draining` set: every later change
                # would be taken for queued behind it and none would ever be applied (silently).
                LOG.exception("locking the SM clock at %d MHz failed unexpectedly", mhz)
                self._failed(mhz, f"{type(e).__name__}: {e}")
                return
            if applied:
                self._applied = (mhz, epoch)
        if not applied:
            self._failed(mhz, None)
        elif event_ns is not None:
            self.latencies.append(time.monotonic_ns() - event_ns)

    def _failed(self, mhz: int, error: str | None) -> None:
        loop = self._loop
        if loop is None:  # Inline: already on the loop.
            self._on_failed(mhz, error)
            return
        with contextlib.suppress(RuntimeError):  # A closed loop: nothing left to report to.
            loop.call_soon_threadsafe(self._on_failed, mhz, error)


class EarlyRaises:
    """Issues a schedule's clock raises a lead before their instructions (a loop timer).

    The agent tells it each instruction as it begins (`begun`) and, when the next one raises
    the clock, asks for the raise (`plan`); the timer then calls `fire(mhz)`, which applies it
    unless the schedule, its lease or the instruction sequence moved on. The instruction's own
    event finds the clock in and sends nothing. Lowerings are left to their events.

    Attributes:
        enabled: Raise ahead at all (a benchmark of the reactive path turns it off).
        ahead: The forecast and the lead (pure core).
        issued: Raises issued ahead of their instruction.
        on_event: Raises planned ahead whose instruction began first (applied on its event).
    """

    CALIBRATE_EVERY = 32
    """Instructions between recalibrations of the lead."""

    def __init__(self, lane: ClockLane, ahead: RaiseAhead | None = None) -> None:
        """Create it for the clock changes of `lane` (whose latencies calibrate the lead)."""
        self.enabled = True
        self.ahead = ahead if ahead is not None else RaiseAhead()
        self._lane = lane
        self._timer: asyncio.TimerHandle | None = None
        self._seen = 0
        """Instructions begun so far (a timer is for the instruction after the one it saw)."""
        self._raised_for = -1
        self.issued = 0
        self.on_event = 0

    def clear(self) -> None:
        """Another schedule, or none: cancel a planned raise and forget the forecast."""
        self.cancel()
        self.ahead.clear()

    def begun(self, position: int, t_ns: int) -> bool:
        """An instruction at schedule `position` began at `t_ns`.

        Returns:
            Whether its raise was issued ahead (its clock is in or on its way).
        """
        if self._timer is not None:
            self.cancel()
            self.on_event += 1
        self._seen += 1
        self.ahead.on_instruction(position, t_ns)
        if self._seen % self.CALIBRATE_EVERY == 0:
            self.ahead.calibrate(list(self._lane.latencies))
        return self._raised_for == self._seen

    def plan(self, position: int, t_ns: int, mhz: int, fire: Callable[[int], bool]) -> None:
        """The instruction after the one at `position` (begun at `t_ns`) raises to `mhz`."""
        due = self.ahead.raise_at(position, t_ns)
        if due is None or due - t_ns < self.ahead.lead_ns:
            return  # No forecast, or an instruction too short to raise ahead of its end.
        delay_s = max(0.0, (due - time.monotonic_ns()) / 1e9)
        self._timer = asyncio.get_running_loop().call_later(
            delay_s, self._fire, mhz, self._seen, self._lane.epoch, fire)

    def _fire(self, mhz: int, seen: int, epoch: int, fire: Callable[[int], bool]) -> None:
        self._timer = None
        if seen == self._seen and epoch == self._lane.epoch and fire(mhz):
            self._raised_for = seen + 1
            self.issued += 1

    def cancel(self) -> None:
        """Cancel a raise planned ahead (the next instruction may run another schedule)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
