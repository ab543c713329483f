"""The simulated NVML driver of one process: charges each call its cost, one at a time per GPU.

`zeus_agent.gpu.sim.timing` says what a call costs; this shell makes the call take that long.
A call of a serialised kind (counter read, power-limit read, setter) holds the GPU's driver
lock while it sleeps its drawn cost, so a clock change issued during a counter read waits for
it, as on a real GPU. The lock is a `threading.Lock` per (state directory, index) in this
process: the agent is the process making NVML-like calls; the trainer's `run_work` is not one
and never pays.

* `SimDriver`: one per `SimGPU` handle; ``with driver.call(kind) as call: ...``.
* `driver_lock`: the process-wide lock of one simulated GPU.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from zeus_agent.gpu.sim.timing import SERIALISED, CallKind, NvmlTiming

__all__ = ["NO_CALL", "SimDriver", "driver_lock"]

SPIN_NS = 10_000
"""Waits shorter than this spin instead of sleeping (the cheap getters: 1-5 us)."""

_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def driver_lock(state_dir: str | Path, index: int) -> threading.Lock:
    """The driver lock of one simulated GPU, shared by every handle on it in this process."""
    key = (os.path.realpath(state_dir), index)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.Lock()
        return lock


class SimDriver:
    """Charges the calls of one `SimGPU` handle.

    Attributes:
        timing: The cost model.
        counts: Calls made through this handle, by kind (lets a test count counter reads).
    """

    def __init__(
        self,
        timing: NvmlTiming,
        lock: threading.Lock,
        rng: random.Random,
        clock: Callable[[], int],
        sleep: Callable[[float], None],
    ) -> None:
        """Create the driver.

        Args:
            timing: The cost model.
            lock: The GPU's driver lock (`driver_lock`).
            rng: Source of the cost draws (seeded by the caller: reproducible costs).
            clock: Monotonic clock in nanoseconds (the device's).
            sleep: Sleeps a number of seconds (injectable for tests).
        """
        self.timing = timing
        self.counts: collections.Counter[CallKind] = collections.Counter()
        self._lock = lock
        self._rng = rng
        self._clock = clock
        self._sleep = sleep
        self._spins = clock is time.monotonic_ns and sleep is time.sleep
        """Short waits spin only on the real clock (an injected one would never move)."""

    def call(self, kind: CallKind) -> _FreeCall | _TimedCall:
        """A context for one `kind` call: it waits for the lock and lasts the drawn cost."""
        self.counts[kind] += 1
        if not self.timing.charges:
            return NO_CALL
        return _TimedCall(self, kind)

    def sleep_until(self, deadline_ns: int) -> None:
        """Wait until the device clock reaches `deadline_ns` (no wait when it has).

        The simulator's own work counts towards the cost. A wait shorter than `SPIN_NS` spins
        on the clock instead of sleeping: a real getter's microseconds are CPU work in the
        calling thread (an ioctl), and a sleep that short would last the kernel's timer slack
        (~50 us) and cost more CPU than the spin (a wake-up costs ~5-40 us on a VM).
        """
        left = deadline_ns - self._clock()
        if left <= 0:
            return
        if left >= SPIN_NS or not self._spins:
            self._sleep(left / 1e9)
            return
        while self._clock() < deadline_ns:
            pass


class _FreeCall:
    """A call that costs nothing (timing "none")."""

    __slots__ = ()

    def __enter__(self) -> _FreeCall:
        return self

    def __exit__(
        self, *exc: type[BaseException] | BaseException | TracebackType | None
    ) -> None:
        return None

    def midpoint(self) -> None:
        """Nothing to wait for."""


NO_CALL = _FreeCall()
"""A call that costs nothing and counts nowhere."""


class _TimedCall:
    """One charged call: lock (if serialised), draw the cost, sleep it out, unlock."""

    __slots__ = ("_driver", "_locked", "cost_ns", "kind", "start_ns")

    def __init__(self, driver: SimDriver, kind: CallKind) -> None:
        self._driver = driver
        self.kind = kind
        self._locked = kind in SERIALISED
        self.start_ns = 0
        self.cost_ns = 0

    def __enter__(self) -> _TimedCall:
        d = self._driver
        if self._locked:
            d._lock.acquire()  # noqa: SLF001 - the driver's own helper
        try:
            self.start_ns = d._clock()  # noqa: SLF001
            self.cost_ns = round(d.timing.quantile_s(self.kind, d._rng.random()) * 1e9)  # noqa: SLF001
        except BaseException:
            if self._locked:
                d._lock.release()  # noqa: SLF001
            raise
        return self

    def midpoint(self) -> None:
        """Wait until the middle of the call: where a counter read takes its value."""
        self._driver.sleep_until(self.start_ns + self.cost_ns // 2)

    def __exit__(
        self, *exc: type[BaseException] | BaseException | TracebackType | None
    ) -> None:
        try:
            self._driver.sleep_until(self.start_ns + self.cost_ns)
        finally:
            if self._locked:
                self._driver._lock.release()  # noqa: SLF001
