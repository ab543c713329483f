"""`CounterReader`: reads one GPU's energy counter when its read policy says, into the ring.

A counter read costs milliseconds on a real GPU (an H200: p50 3 ms, p99 24 ms under load) and
holds the driver meanwhile, so the agent never reads it per trainer event or per request. One
task per GPU (`run`) asks `ReadPolicy` (`zeus_agent.agent.core.counter_phase`) when to read,
reads through the GPU's `GPUCaller` (stamping the call itself, in its thread), feeds the policy,
and appends each `Knot` it returns to the `EnergyRing`. Then:

* `energy_between(t0, t1)`: the default window answer, at once (past the newest knot the ring
  extrapolates with the last full update period's power);
* `energy_between_exact(t0, t1)`: waits until a knot at or after `t1` is in (the first read after
  the update that follows `t1`: ~70 ms typically, ~225 ms at most on an H200), then interpolates;
* `covers(t)` / `on_knot`: what the agent uses to publish a step's or instruction's energy only
  once reads bracket both of its edges.

GPUs without an energy counter are read plainly: their power is integrated (`PowerIntegrator`)
and each read is a fresh value (the policy reads such a series plainly at the sampling interval).

Idle: while nothing needs the fine series (`is_active`, the agent's: a trainer bound, marks
or measurements waiting; or an exact window waiting, or a window asked within
`WINDOW_HOLD_S`), the policy reads only one update in ten (`ReadPolicy.set_active`): ~1 read/s
instead of 10 (each is milliseconds of the driver on a real GPU, and a few thread wake-ups of
the agent's CPU). `wake()` ends the reader's sleep at once when that changes. A power integrator
is never idle (its energy is only as good as its polls).

Status: each counter read is followed, in the same call, by the cheap getters (power, clocks),
whose values the agent's samples take. The power limit's getter is not cheap (~146 us on an
H200, and it waits behind a counter read), so it is read at most every `LIMIT_MAX_AGE_NS` and
right after the agent sets or restores the limit (`refresh_limit`); in between the status
carries the limit read last. The agent is the only process that should change it: a change by
another tool shows in samples within ~1 s (marks carry the limit the agent set, `LimitHistory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from zeus_agent.agent.core.counter_phase import Knot, PhaseState, ReadPolicy
from zeus_agent.agent.core.energy_ring import EnergyRing
from zeus_agent.errors import GPUError, GPUNotSupportedError
from zeus_agent.gpu.base import Telemetry
from zeus_agent.gpu.power_integrator import PowerIntegrator
from zeus_agent.gpu.threaded import GPUCaller

LOG = logging.getLogger(__name__)

INBOX_KNOTS = 1024
"""Knots the reader thread keeps for the loop (the oldest go beyond: none at these rates)."""
INBOX_TAKE_AT = 256
"""The loop is woken to take the knots once this many wait, whoever asks: with a slow sampling
rate and a quiet trainer nothing else might take them before the inbox drops the oldest."""
JOIN_TIMEOUT_S = 0.5
"""How long the agent waits at shutdown for a reader thread to end (s)."""
DEFAULT_EXACT_TIMEOUT_S = 1.0
"""Longest an exact window waits for its bracketing read before it is answered the default way."""
LIMIT_MAX_AGE_NS = 1_000_000_000
"""Oldest power limit a status read reuses instead of reading it (ns)."""
WINDOW_HOLD_S = 60.0
"""How long a window request keeps a GPU's reads at every update: a monitor that measured one
window (a bare `ZeusMonitor`, no trainer bound) likely measures another soon."""


def _name_native_thread(name: str) -> None:
    """Give the OS thread its Python name (`top -H`, /proc/<pid>/task/*/comm; Linux only)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class CounterReader:
    """The energy counter of one GPU, read on the policy's schedule.

    Attributes:
        policy: The `ReadPolicy` deciding when to read.
        ring: The `EnergyRing` the knots go to (shared with the agent).
        reads: Counter reads made.
        read_errors: Reads that failed (the GPU's error is logged at debug level).
    """

    def __init__(
        self,
        caller: GPUCaller,
        ring: EnergyRing,
        fallback_interval_ns: int,
        policy: ReadPolicy | None = None,
        *,
        due_boundaries: Callable[[int], Iterable[int]] | None = None,
        on_knot: Callable[[], None] | None = None,
        wants_knots: Callable[[], bool] | None = None,
        is_active: Callable[[], bool] | None = None,
    ) -> None:
        """Create a reader of `caller.gpu`'s counter into `ring`.

        The callbacks are the agent's (each optional): the reader runs alone in tests.

        Args:
            caller: How to call the GPU (its thread when calls block).
            ring: Where the knots go.
            fallback_interval_ns: Read interval while the counter's updates are not locked
                (the agent's sampling interval).
            policy: The read policy (default: `ReadPolicy(fallback_interval_ns)`).
            due_boundaries: `now_ns -> times (ns) at which a clock or power-limit change is
                due`, which reads then avoid (`ReadPolicy.plan_read`).
            on_knot: Called on the loop after each new knot.
            wants_knots: Whether the agent waits for a knot now (None: always).
            is_active: Whether the agent needs every update read (None: always).
        """
        self.caller = caller
        self.gpu = caller.gpu
        self.ring = ring
        self.policy = policy or ReadPolicy(fallback_interval_ns=fallback_interval_ns)
        self.fallback_interval_ns = fallback_interval_ns
        self.horizon_ns = max(
            ring.max_extrapolation_ns, 2 * self.policy.idle_every * fallback_interval_ns
        )
        """How far past the newest knot windows and samples are extrapolated (ns): idle, the
        newest knot may be a second old when a window is asked."""
        self.reads = 0
        self.read_errors = 0
        self.phase_changes = 0
        """Times the read policy's state changed (learning, locked, plain)."""
        self._due_boundaries = due_boundaries
        self._on_knot = on_knot
        self._wants_knots = wants_knots
        self._is_active = is_active
        self._integrator: PowerIntegrator | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._inbox: deque[Knot] = deque(maxlen=INBOX_KNOTS)
        """Knots from the reader thread not yet in the ring (`_take`)."""
        self._policy_lock = threading.Lock()
        """The policy is fed by the reader thread, and by `read_once` on the loop."""
        self.status: tuple[int, Telemetry] | None = None
        """(t_ns, status) read right after the newest counter read, in the same GPU-thread call:
        the agent's sample takes it instead of a call of its own (each call costs the event
        loop a thread hand-off; the getters cost microseconds beside the counter's milliseconds)."""
        self.limit_reads = 0
        """Status reads that read the power limit (the others reuse the last one read)."""
        self._limit: tuple[int, int] | None = None
        """(t_ns, W): the power limit last read with a status."""
        self._limit_generation = 0
        """Bumped by `refresh_limit`: a status read that reused an older limit is dropped."""
        self._active_until_ns = 0
        self._wakeup = threading.Event()
        """Set by `wake`: the reader thread's sleep ends to plan again."""
        self._wakeup_async: asyncio.Event | None = None
        self._sampled_j = -math.inf
        """The energy `energy_for_sample` answered last (its answers never go back)."""

    @property
    def update_period_ms(self) -> float | None:
        """How often the counter's value changes, as its reads showed (ms; the description's).

        The update period the policy locked onto; 0 when the value changed at every read (a
        continuous counter, or integrated power); None while learning (~2 s after the start: a
        continuous counter's grid narrows against the shortest period the reads can see, which
        is no period of the counter's).
        """
        with self._policy_lock:  # (The reader thread feeds it.)
            state, bounds = self.policy.state, self.policy.period_bounds_ns
        if self._integrator is not None or state is PhaseState.PLAIN:
            return 0.0
        if state is not PhaseState.LOCKED or bounds is None:
            return None
        return round((bounds[0] + bounds[1]) / 2e6, 3)

    def use_integrator(self) -> None:
        """Integrate power polls instead of reading a counter (a GPU without one)."""
        if self._integrator is None:
            self._integrator = PowerIntegrator()

    # ------------------------------------------------------------------ idle or active
    @property
    def active(self) -> bool:
        """Whether every counter update is read now (see the module's docstring)."""
        if self._integrator is not None or self._waiters:
            return True
        if time.monotonic_ns() < self._active_until_ns:
            return True
        return self._is_active is None or self._is_active()

    def hold_active(self, seconds: float = WINDOW_HOLD_S) -> None:
        """Read every update for the next `seconds` at least (a window was asked); wake it."""
        self._active_until_ns = max(self._active_until_ns, time.monotonic_ns() + int(seconds * 1e9))
        self.wake()

    def wake(self) -> None:
        """Something may now need every update: the reader plans again at once (loop thread)."""
        self._wakeup.set()  # (at worst one plan more, when it was active already)
        if self._wakeup_async is not None:
            self._wakeup_async.set()

    def _plan(self, now: int) -> int:
        """Tell the policy active or idle, and when to start the next read (ns)."""
        due = self._due_boundaries(now) if self._due_boundaries is not None else ()
        active = self.active
        with self._policy_lock:
            self.policy.set_active(active)
            return self.policy.plan_read(now, due, count=True).t_ns

    @property
    def status_max_age_ns(self) -> int:
        """Oldest status with the counter a sample takes: 1.5 of the usual time between reads."""
        return self.policy.read_interval_ns * 3 // 2

    def refresh_limit(self) -> None:
        """The agent set or restored the power limit: the next status reads it, none reuses it."""
        self._limit_generation += 1
        self._limit = None
        self.status = None  # The next sample reads its own status (with the new limit).

    def _read_status(self) -> None:
        """After a counter read, in the GPU's thread: the cheap getters, the limit when due."""
        generation, limit = self._limit_generation, self._limit
        now = time.monotonic_ns()
        known = None if limit is None or now - limit[0] >= LIMIT_MAX_AGE_NS else limit[1]
        try:
            status = self.gpu.read_status() if known is None else self.gpu.read_status(known)
        except GPUError:
            self.status = None  # The sample reads it on its own (and says what failed).
            return
        if known is None:
            self.limit_reads += 1
        if generation != self._limit_generation:
            self.status = None  # The agent changed the limit meanwhile: this one may be stale.
            return
        if known is None:
            self._limit = (now, status.power_limit_w)
        self.status = (time.monotonic_ns(), status)
        if generation != self._limit_generation:  # `refresh_limit` ran between check and store
            self.status, self._limit = None, None

    # ------------------------------------------------------------------ reading
    def _read(self) -> tuple[int, int, float]:
        """(t0, t1, energy J): one counter read and the stamps around the call (GPU thread)."""
        if self._integrator is not None:
            t0 = time.monotonic_ns()
            power = self.gpu.get_power_w()
            t1 = time.monotonic_ns()
            return t0, t1, self._integrator.add((t0 + t1) // 2, power)
        t0 = time.monotonic_ns()
        try:
            energy = self.gpu.get_total_energy_j()
        except GPUNotSupportedError:
            self.use_integrator()
            return self._read()
        t1 = time.monotonic_ns()
        self._read_status()
        return t0, t1, energy

    async def read_once(self) -> bool:
        """Read the counter now and feed the policy; whether the read succeeded."""
        try:
            t0, t1, energy = await self.caller.call(self._read)
        except GPUError as e:
            self.read_errors += 1
            LOG.debug("GPU %d: energy counter read failed: %s", self.gpu.index, e)
            return False
        self.reads += 1
        knot = self.feed(t0, t1, energy)
        if knot is not None:
            self._add_knot(knot)
        return True

    def feed(self, t0: int, t1: int, energy: float) -> Knot | None:
        """Feed one read to the policy (either thread); log when its phase state changes.

        A lock lost means the knots are placed at their reads again (up to a period off) until
        it locks anew: an operator reading a window's energy wants to know when that happened.
        """
        with self._policy_lock:
            before = self.policy.state
            knot = self.policy.on_read(t0, t1, energy)
            after = self.policy.state
        if after is not before:
            self.phase_changes += 1
            if after is PhaseState.LOCKED:
                LOG.info("GPU %d: energy counter locked on its %s ms update grid",
                         self.gpu.index, self.update_period_ms)
            elif before is PhaseState.LOCKED:
                LOG.info("GPU %d: energy counter lost its update grid (now %s): windows "
                         "measured until it locks again may be off by up to one update "
                         "period at each edge", self.gpu.index, after.value)
            else:
                LOG.info("GPU %d: energy counter read %s (was %s)", self.gpu.index,
                         after.value, before.value)
        return knot

    async def run(self) -> None:
        """Forever: wait until the policy's next read (clear of due boundaries), read.

        A GPU whose calls block (NVML, the timed simulator) is read by a thread of its own
        (`_read_forever`): it sleeps until each planned read, reads and feeds the policy, and
        hands the loop only the knots: a read through the GPU's executor would wake the loop
        twice (the planned start, the call's return), ~0.4 ms of a 2-core VM's CPU, 80 times a
        second with 8 GPUs. Clock changes do not wait for this thread (they have their own
        lane); only the driver serialises them with a read in flight.
        """
        if not self.caller.blocking:
            self._wakeup_async = asyncio.Event()
            await self._run_inline()
            return
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        thread = threading.Thread(
            target=self._read_forever, args=(loop, stop),
            name=f"gpu{self.gpu.index}-counter", daemon=True,
        )  # fmt: skip
        thread.start()
        try:
            await loop.create_future()  # until cancelled
        finally:
            stop.set()  # it ends after its current read, or at once from its sleep
            self._wakeup.set()
            # Joined (bounded: a read may hang in the driver), so no read of this GPU runs
            # after the agent has restored it and closed its caller.
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(thread.join, JOIN_TIMEOUT_S))

    async def _run_inline(self) -> None:
        """`run` for a GPU whose calls return at once: plan, sleep and read on the loop."""
        wakeup = self._wakeup_async
        assert wakeup is not None
        while True:
            try:
                now = time.monotonic_ns()
                start = self._plan(now)
                if start > now:
                    wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wakeup.wait(), (start - now) / 1e9)
                        continue  # woken: something needs every update now, plan again
                if not await self.read_once():
                    await asyncio.sleep(self.fallback_interval_ns / 1e9)  # never a hot loop
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the reads go on whatever one of them did
                LOG.exception("GPU %d: reading the energy counter failed", self.gpu.index)
                await asyncio.sleep(self.fallback_interval_ns / 1e9)

    def _read_forever(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """The reader thread: plan, sleep, read, feed the policy; knots go to the loop."""
        _name_native_thread(threading.current_thread().name)
        fallback_s = self.fallback_interval_ns / 1e9
        while not stop.is_set():
            try:
                now = time.monotonic_ns()
                # (The forecast is the loop's; a stale one at worst lets a read collide.)
                start = self._plan(now)
                if start > now:
                    if self.policy.idle:  # up to a second: ended early by `wake`
                        woken = self._wakeup.wait((start - now) / 1e9)
                    else:  # until the next update: a plain sleep costs the CPU less
                        time.sleep((start - now) / 1e9)
                        woken = False
                    if stop.is_set():
                        return
                    if woken:
                        self._wakeup.clear()
                        continue  # something needs every update now: plan again
                try:
                    t0, t1, energy = self._read()
                except GPUError as e:
                    self.read_errors += 1
                    LOG.debug("GPU %d: energy counter read failed: %s", self.gpu.index, e)
                    time.sleep(fallback_s)  # never a hot loop
                    continue
                self.reads += 1
                knot = self.feed(t0, t1, energy)
                if knot is not None:
                    self._inbox.append(knot)  # taken on the loop by the next query
                    if (self._waiters or self._wants_knots is None or self._wants_knots()
                            or len(self._inbox) >= INBOX_TAKE_AT):  # never let it overflow
                        loop.call_soon_threadsafe(self._take)  # someone waits: now
            except RuntimeError:
                if loop.is_closed():
                    return  # the agent has stopped
                LOG.exception("GPU %d: reading the energy counter failed", self.gpu.index)
                time.sleep(fallback_s)
            except Exception:  # noqa: BLE001 - the reads go on whatever one of them did
                LOG.exception("GPU %d: reading the energy counter failed", self.gpu.index)
                time.sleep(fallback_s)

    def _add_knot(self, knot: Knot) -> None:
        """On the loop: keep a knot, wake the exact windows and the agent's waiting marks."""
        if self.ring.append(knot.t_ns, knot.energy_j):
            self._wake()
            if self._on_knot is not None:
                self._on_knot()

    def _take(self) -> None:
        """On the loop: move the reader thread's knots into the ring (every query does first).

        The loop is woken for a knot only when something waits for one (`wants_knots`, an
        exact window); otherwise the knots wait here until the next sample or query. Neither
        side can miss the other: the thread adds the knot before it looks for waiters, and a
        waiter registers before it looks at the knots (`covers`, `wait_covered`).
        """
        while self._inbox:
            self._add_knot(self._inbox.popleft())

    # ------------------------------------------------------------------ answers
    def newest_ns(self) -> int | None:
        """Time of the newest knot (ns), or None before any."""
        self._take()
        latest = self.ring.latest()
        return None if latest is None else latest[0]

    def latest_energy_j(self) -> float | None:
        """The counter's newest value as kept (J; offset-corrected), or None before any read."""
        self._take()
        latest = self.ring.latest()
        return None if latest is None else latest[1]

    def energy_for_sample(self, t_ns: int) -> float | None:
        """The counter's energy at `t_ns` for a sample (J), or None before any read.

        From the ring: interpolated, or past the newest knot extrapolated with the power of the
        last period between two knots (~1 s of them when idle), up to `horizon_ns` ahead; else
        the newest value. Never below an earlier answer: samples are a counter, and a
        Prometheus counter that goes back reads as a reset.
        """
        self._take()
        latest = self.ring.latest()
        if latest is None:
            return None
        try:
            energy = self.ring.energy_at(t_ns, self.horizon_ns)
        except ValueError:
            energy = latest[1]
        energy = max(energy, self._sampled_j)
        self._sampled_j = energy
        return energy

    def covers(self, t_ns: int) -> bool:
        """Whether a knot at or after `t_ns` is in (energies up to `t_ns` are interpolated)."""
        newest = self.newest_ns()
        return newest is not None and newest >= t_ns

    def energy_between(self, t0_ns: int, t1_ns: int) -> float:
        """The default window answer (J), at once (may raise `WindowOutOfRange`)."""
        self._take()
        return self.ring.energy_between(t0_ns, t1_ns, self.horizon_ns)

    async def energy_between_exact(
        self, t0_ns: int, t1_ns: int, timeout_s: float = DEFAULT_EXACT_TIMEOUT_S
    ) -> tuple[float, bool]:
        """The window's energy once a read brackets its end: `(energy J, exact)`.

        `exact` is False when no bracketing read came within `timeout_s` (the GPU's reads
        fail); the answer is then the default one. May raise `WindowOutOfRange`.
        """
        exact = await self.wait_covered(t1_ns, timeout_s)
        self._take()
        return self.ring.energy_between(t0_ns, t1_ns, self.horizon_ns), exact

    async def wait_covered(self, t_ns: int, timeout_s: float) -> bool:
        """Wait until `covers(t_ns)`; False if it did not within `timeout_s`."""
        if self.covers(t_ns):
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((t_ns, future))
        self.wake()  # An idle reader reads the next update, not one a second later.
        if self.covers(t_ns):  # a knot the thread added before it saw this waiter
            self._waiters = [(t, f) for t, f in self._waiters if f is not future]
            return True
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return self.covers(t_ns)
        finally:
            self._waiters = [(t, f) for t, f in self._waiters if f is not future]
        return True

    def _wake(self) -> None:
        newest = self.newest_ns()
        if newest is None or not self._waiters:
            return
        for t, future in self._waiters:
            if t <= newest and not future.done():
                future.set_result(None)
