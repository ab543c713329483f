"""When to read a GPU's energy counter, and at which instant each value it returns belongs.

NVML's energy counter changes only every ~100 ms (one H200: 100.000 ms, each update within
~1 ms of a steady grid), and a read costs ~3 ms (p90 6-7 ms) during which the driver makes
every other call to that GPU wait. Reading more often than the counter changes learns nothing,
and a value read at a random moment is up to a period old. `ReadPolicy` learns the counter's
update grid from the reads themselves, asks for one read shortly after each update, and places
each new value, as a `Knot`, at the update instant it belongs to (not at the read), so windows
are measured against the counter's own clock.

Evidence: a read samples the counter somewhere within its call `[t0, t1]` (it is stamped at the
midpoint). Counting updates from the first one seen, a read whose value changed since the
previous read says that the first update not yet seen came after the previous read's start and
before this read's end; one whose value did not change says that update comes after this read's
start. With update `n` at `grid(n) + e`, `grid(n) = b + n * period` and `|e| <= jitter_bound_ns`,
each such bound is a linear constraint on `(b, period)`; the policy keeps the set of grids that
satisfy them all (a convex polygon) and predicts each update as a range. Only hard bounds move
the grid, so it cannot lock onto a wrong period; when new bounds contradict old ones (the clock
drifted, the counter restarted) the newest are kept, and it learns again if even they conflict.

States (`PhaseState`):

* LEARNING: reads every `learn_interval_ns` until the next update is predicted within a third of
  a period, then per update a test read at the predicted instant (it halves the range, up to
  the jitter) and, if the update had not come yet, a read just after the range: at most two
  reads per period, until the range is within `lock_width_ns`.
* LOCKED: one read per update period, just after the predicted update. Every `probe_every`-th
  update is read at its predicted instant instead (a test: half the time it comes first, and
  that update is read with the next one), which keeps the range tight: never more reads than
  updates, each at least ~0.9 period after the one before. A read that finds no change is a
  miss; four in a row send the policy back to LEARNING, as does a range grown past three times
  `lock_width_ns` (a range wider than `lock_width_ns` is tested every second update).
* PLAIN: the counter changed at every read while learning (continuous, or faster than the
  sampling interval): plain periodic reads every `fallback_interval_ns`, each changed value a
  knot at its read's midpoint. LEARNING is tried again after `relearn_after_ns`.

Idle (`set_active(False)`): while nothing needs the fine series (no trainer bound, no window
or measurement waiting), a LOCKED policy reads only the updates whose number is a multiple of
`idle_every` (~1 s apart at 100 ms), each after the latest instant it can come (the grid's range
plus the jitter bound: a read a second after the one before cannot tell it came too early, as a
read one period after it can). Such a lone read says nothing about the grid (the value always
changed), so every `idle_probe_every`-th such update, and every one while the range is wider
than twice `lock_width_ns` (LOCKED relearns past three), is a pair: the update before it read
after it, then it read at its predicted instant, as LOCKED tests do. Idle starts 20 reads after
a lock (the period is tight by then). PLAIN reads every `idle_every` fallback intervals;
LEARNING is not slowed (it ends in ~2 s). The shell says `set_active(True)` the moment
something needs the series: the next plan reads the next update it can still catch.

Schedule awareness (`plan_read`, `next_read_at`): a clock or power-limit change that lands
while a counter read runs waits for it. Given the times at which such changes are due and the
read's p99 cost, the planned start moves (later by at most `max_postpone_ns`, earlier by at most
`max_advance_ns`) to the nearest start whose call cannot overlap a due change; when none exists
the read keeps its time and the plan says it collides.

No clock is read here: the shell passes every time, in monotonic ns.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Knot", "PhaseState", "ReadPlan", "ReadPolicy", "avoid_boundaries"]

_PLAIN_AFTER_CHANGES = 8
"""Consecutive changed learning reads (none unchanged) after which the counter is continuous.

A read aimed at a predicted update (a test, or a scan after one) counts only when it came
within 3 learning intervals of the one before: aimed at a 100 ms counter's updates, each lands
after its update whenever the grid is estimated a little late, for many updates in a row.
Counted, 2 learnings in 200 drawn, recorded-like read costs, went PLAIN (60 s of knots at the
reads, up to half a period off); a continuous counter's grid narrows against ~40 ms, whose
aimed reads still count."""
_MAX_LEARN_READS = 400
"""Reads spent learning before falling back to PLAIN."""
_LOSE_LOCK_MISSES = 4
"""Consecutive misses that lose the lock."""
_KEEP_BOUNDS = 64
"""Bounds the grid is rebuilt from (the newest) when old ones contradict new ones."""
_MAX_PERIOD_NS = 2_000_000_000
"""Slowest counter the policy locks onto."""
_IDLE_AFTER_LOCKED_READS = 20
"""Reads at every update after a lock before idle reads may stretch (~2 s at 100 ms)."""

Vertex = tuple[float, float]  # (b, period): grid(n) = b + n * period, ns from the origin


class PhaseState(enum.Enum):
    """What the policy knows about the counter's update grid."""

    LEARNING = "learning"
    LOCKED = "locked"
    PLAIN = "plain"


@dataclass(frozen=True, slots=True)
class Knot:
    """A counter value placed at the instant it belongs to (monotonic ns, J)."""

    t_ns: int
    energy_j: float


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """When to start the next read.

    Attributes:
        t_ns: Start time (monotonic ns), never before the `now_ns` asked with.
        target_ns: Where the policy wanted it before avoiding due boundaries.
        collides: No start within the allowed shift avoids every due boundary.
    """

    t_ns: int
    target_ns: int
    collides: bool


def avoid_boundaries(
    target_ns: int,
    boundaries: Iterable[int],
    cost_ns: int,
    earliest_ns: int,
    latest_ns: int,
) -> tuple[int, bool]:
    """The start nearest `target_ns` in `[earliest_ns, latest_ns]` whose read misses every boundary.

    A read started at `s` runs over `[s, s + cost_ns]`; a boundary `b` (a setting change due at
    `b`) in that span would wait for it. Ties go to the later start.

    Returns:
        `(start, collides)`: `collides` is True when no start in the range avoids every
        boundary; `start` is then `target_ns` (clamped to the range).
    """
    lo, hi = earliest_ns, max(earliest_ns, latest_ns)
    target = min(max(target_ns, lo), hi)
    blocked = [(b - cost_ns, b) for b in boundaries if b >= lo and b - cost_ns <= hi]

    def free(s: int) -> bool:
        return all(not a <= s <= b for a, b in blocked)

    if free(target):
        return target, False
    candidates = [s for a, b in blocked for s in (a - 1, b + 1) if lo <= s <= hi and free(s)]
    if not candidates:
        return target, True
    return min(candidates, key=lambda s: (abs(s - target), -s)), False


@dataclass(frozen=True, slots=True)
class _Read:
    t0: int
    t1: int
    energy_j: float

    @property
    def mid(self) -> int:
        return (self.t0 + self.t1) // 2


@dataclass(frozen=True, slots=True)
class _Bound:
    """`lo <= grid(n) <= hi` (ns from the origin; either side may be infinite)."""

    n: int
    lo: float
    hi: float


def _clip(poly: list[Vertex], n: int, bound: float, sign: float) -> list[Vertex]:
    """The part of a convex polygon where `sign * (b + n * period) <= sign * bound`."""
    out: list[Vertex] = []
    count = len(poly)
    for i in range(count):
        p, q = poly[i], poly[(i + 1) % count]
        fp = sign * (p[0] + n * p[1] - bound)
        fq = sign * (q[0] + n * q[1] - bound)
        if fp <= 0:
            out.append(p)
        if (fp < 0 < fq) or (fq < 0 < fp):
            t = fp / (fp - fq)
            out.append((p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1])))
    return out


class ReadPolicy:
    """Learns one counter's update grid from its reads and says when to read it next.

    Feed every read with `on_read` (it returns the `Knot` to keep, if any); ask `next_read_at`
    (or `plan_read`) when to start the next one.

    Attributes:
        state: The current `PhaseState`.
        reads: Reads fed so far.
        misses: LOCKED regular reads that found the value unchanged (the update came later).
        locks: Times the policy locked onto a grid.
        collisions: Plans that could not avoid a due boundary (`plan_read(..., count=True)`).
    """

    def __init__(
        self,
        fallback_interval_ns: int = 100_000_000,
        learn_interval_ns: int = 20_000_000,
        jitter_bound_ns: int = 2_500_000,
        lock_width_ns: int = 10_000_000,
        late_ns: int = 3_000_000,
        probe_every: int = 8,
        max_postpone_ns: int | None = None,
        max_advance_ns: int = 1_000_000,
        relearn_after_ns: int = 60_000_000_000,
        idle_every: int = 10,
        idle_probe_every: int = 8,
    ) -> None:
        """Create a policy that starts LEARNING.

        Args:
            fallback_interval_ns: Read interval when no grid is locked (the sampling interval).
            learn_interval_ns: Read interval while looking for a first grid (at most the
                fallback interval).
            jitter_bound_ns: Farthest an update lands from its grid point (the recorded H200:
                +-1.3 ms 5-95%).
            lock_width_ns: The grid locks once it predicts the next grid point within this.
            late_ns: How long after the predicted update a regular read samples.
            probe_every: LOCKED: one update in this many is read at its predicted instant.
            max_postpone_ns: Latest a read may move to avoid a boundary (default 40% of the
                period, or of the interval when not locked).
            max_advance_ns: Earliest a read may move to avoid a boundary (a regular read moved
                much earlier would come before its update).
            relearn_after_ns: How long PLAIN lasts before learning is tried again.
            idle_every: Idle: one update in this many is read (1: as when active).
            idle_probe_every: Idle: one read update in this many is tested (a pair of reads).

        Raises:
            ValueError: A non-positive interval, `probe_every` below 2, `idle_every` or
                `idle_probe_every` below 1.
        """
        if fallback_interval_ns <= 0 or learn_interval_ns <= 0:
            raise ValueError("read intervals must be positive")
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        if idle_every < 1 or idle_probe_every < 1:
            raise ValueError("idle_every and idle_probe_every must be >= 1")
        self.fallback_interval_ns = int(fallback_interval_ns)
        self.learn_interval_ns = int(min(learn_interval_ns, fallback_interval_ns))
        self.jitter_bound_ns = int(jitter_bound_ns)
        self.lock_width_ns = int(lock_width_ns)
        self.late_ns = int(late_ns)
        self.probe_every = int(probe_every)
        self.max_postpone_ns = max_postpone_ns
        self.max_advance_ns = int(max_advance_ns)
        self.relearn_after_ns = int(relearn_after_ns)
        self.idle_every = int(idle_every)
        self.idle_probe_every = int(idle_probe_every)
        self.active = True
        """Whether something needs every update read (`set_active`)."""
        self.state = PhaseState.LEARNING
        self.reads = 0
        self.misses = 0
        self.locks = 0
        self.collisions = 0
        self._costs: deque[int] = deque(maxlen=128)
        self._sorted_costs: list[int] | None = None
        self._prev: _Read | None = None
        self._origin = 0  # ns: grid times are kept relative to it (small floats)
        self._bounds: deque[_Bound] = deque(maxlen=_KEEP_BOUNDS)
        self._poly: list[Vertex] = []
        self._seen = -1  # updates seen: the next unseen one is `_seen + 1`
        self._tested = -1  # the newest update a test read was planned for
        self._plan: tuple[str, int] | None = None  # (role, update) of the read planned last
        self._learn_reads = 0
        self._changed_run = 0
        self._held = False  # a learning read found the value unchanged (see `_check_state`)
        self._plain_since = 0
        self._missed_run = 0
        self._locked_reads = 0  # reads since the policy last locked

    # ----------------------------------------------------------------------------- queries

    @property
    def locked(self) -> bool:
        """Whether reads are phase-locked to the counter's updates."""
        return self.state is PhaseState.LOCKED

    @property
    def period_ns(self) -> float | None:
        """The middle of the grid's possible periods (ns), or None without a grid."""
        if not self._poly:
            return None
        periods = [v[1] for v in self._poly]
        return (min(periods) + max(periods)) / 2

    @property
    def period_bounds_ns(self) -> tuple[float, float] | None:
        """The shortest and longest periods the grid still allows (ns), or None without a grid."""
        if not self._poly:
            return None
        periods = [v[1] for v in self._poly]
        return min(periods), max(periods)

    def grid_range(self, n: int | None = None) -> tuple[int, int] | None:
        """Earliest and latest grid point of update `n` (default: the next unseen) (ns)."""
        if not self._poly:
            return None
        lo, hi = self._range(self._seen + 1 if n is None else n)
        return self._origin + math.floor(lo), self._origin + math.ceil(hi)

    def _range(self, n: int) -> tuple[float, float]:
        values = [b + n * period for b, period in self._poly]
        return min(values), max(values)

    def _centre(self, n: int) -> float:
        lo, hi = self._range(n)
        return (lo + hi) / 2

    def _cost_q(self, q: float) -> int:
        if not self._costs:
            return 0
        if self._sorted_costs is None:
            self._sorted_costs = sorted(self._costs)
        costs = self._sorted_costs
        return costs[min(len(costs) - 1, max(0, math.ceil(q * len(costs)) - 1))]

    @property
    def read_cost_p99_ns(self) -> int:
        """99th percentile cost of the recent reads (ns; their maximum while fewer than 100)."""
        return self._cost_q(0.99)

    def update_after(self, t_ns: int) -> int | None:
        """The predicted instant of the first update after `t_ns` (None when not locked)."""
        if not self.locked:
            return None
        n = self._seen + 1
        while self._origin + self._centre(n) <= t_ns:
            n += 1
        return self._origin + round(self._centre(n))

    def set_active(self, active: bool) -> None:
        """Read every update (True) or only every `idle_every`-th (False: nothing needs more)."""
        self.active = bool(active)

    @property
    def idle(self) -> bool:
        """Whether reads are stretched now (told idle, and LOCKED for a while, or PLAIN)."""
        if self.active or self.idle_every == 1:
            return False
        return self.state is PhaseState.PLAIN or (self.locked and self._settled())

    @property
    def read_interval_ns(self) -> int:
        """The usual time between reads now (ns): what a status read with the counter ages to."""
        period = self.period_ns
        if self.locked and period is not None:
            return round(period) * (self.idle_every if self.idle else 1)
        return self._interval()

    # ----------------------------------------------------------------------------- planning

    def plan_read(
        self,
        now_ns: int,
        due_boundaries: Iterable[int] = (),
        read_cost_p99_ns: int | None = None,
        count: bool = False,
    ) -> ReadPlan:
        """When to start the next read.

        Args:
            now_ns: Now (monotonic ns).
            due_boundaries: Times at which a clock or power-limit change is expected.
            read_cost_p99_ns: A read's p99 cost (ns); default the recent reads'.
            count: Count a plan that collides in `collisions` (ask once per read).
        """
        target = self._target(now_ns)
        cost = self.read_cost_p99_ns if read_cost_p99_ns is None else read_cost_p99_ns
        span = self.period_ns if self.locked else None
        span = float(self._interval()) if span is None else span
        postpone = int(0.4 * span) if self.max_postpone_ns is None else self.max_postpone_ns
        start, collides = avoid_boundaries(
            target, due_boundaries, cost,
            max(now_ns, target - self.max_advance_ns), max(now_ns, target + postpone),
        )  # fmt: skip
        if collides and count:
            self.collisions += 1
        return ReadPlan(max(start, now_ns), target, collides)

    def next_read_at(
        self,
        now_ns: int,
        due_boundaries: Iterable[int] = (),
        read_cost_p99_ns: int | None = None,
    ) -> int:
        """When to start the next read (monotonic ns, >= `now_ns`); see `plan_read`."""
        return self.plan_read(now_ns, due_boundaries, read_cost_p99_ns).t_ns

    def _interval(self) -> int:
        if self.state is PhaseState.PLAIN:
            return self.fallback_interval_ns * (1 if self.active else self.idle_every)
        return self.learn_interval_ns

    def _bisecting(self) -> bool:
        """LEARNING with a grid good enough to aim reads at single updates."""
        if self.state is not PhaseState.LEARNING or not self._poly:
            return False
        period = self.period_ns
        lo, hi = self._range(self._seen + 1)
        return period is not None and hi - lo < period / 2

    def _target(self, now_ns: int) -> int:
        self._plan = None
        prev = self._prev
        if prev is None:
            return now_ns
        if self.state is PhaseState.PLAIN or not (self.locked or self._bisecting()):
            return max(now_ns, prev.t0 + self._interval())
        n = self._seen + 1
        lo, hi = self._range(n)
        # A caller far behind reads the next update it can still catch (never two at once).
        period = self.period_ns or 0.0
        while self._origin + hi + self.jitter_bound_ns < now_ns - period / 4:
            n += 1
            lo, hi = self._range(n)
        if self.locked and self._tested >= n:
            n = self._tested + 1  # its test came first: read it with the next (one per period)
            lo, hi = self._range(n)
        if self.locked and self.idle:
            return self._idle_target(now_ns, n)
        every = self.probe_every if hi - lo <= self.lock_width_ns else 2  # tests it more
        # (Never with the update before it unseen: a change would then be that update's, or
        # both, and filing it as this one's put a knot a period late, 1 run in ~8 at a lock.)
        test = (self._tested < n and self._seen == n - 1
                and (self.state is PhaseState.LEARNING or n % every == 0))
        if test:
            self._plan = ("test", n)
            at = (lo + hi) / 2 - self._cost_q(0.5) / 2
        elif self.state is PhaseState.LEARNING:
            # The test came before the update: read on, back to back, until it has come (a
            # narrow bracket); at most until the update's range is surely past.
            self._plan = ("scan", n)
            return now_ns
        else:
            self._plan = ("regular", n)
            after = (lo + hi) / 2 + self.late_ns
            if self._seen < n - 1:
                # It reads the update before too (its test came first): after the latest this
                # one can come. A read that straddled it (sampled before it, returned after its
                # predicted instant) was filed as its, the value a period old (1 run in ~70
                # had such a knot, 99 ms off). With the update before seen, a change can only
                # be this one's, and a read that came first is a miss, as it should be.
                after = max(after, hi + self.jitter_bound_ns)
            at = after - self._cost_q(0.1) / 2
        return max(now_ns, self._origin + round(at))

    def _settled(self) -> bool:
        """Locked long enough to stretch reads a second apart (the period is tight by then)."""
        return self._locked_reads >= _IDLE_AFTER_LOCKED_READS

    def _idle_target(self, now_ns: int, n: int) -> int:
        """LOCKED, idle: the next update numbered a multiple of `idle_every`, maybe as a pair."""
        k = self.idle_every
        m = -(-n // k) * k  # the first multiple of k at or after n
        lo, hi = self._range(m)
        probe = (m // k) % self.idle_probe_every == 0 or hi - lo > 2 * self.lock_width_ns
        if probe and self._tested < m:
            if self._seen == m - 1:  # the update before it was just read: test this one
                self._plan = ("test", m)
                at = (lo + hi) / 2 - self._cost_q(0.5) / 2
                return max(now_ns, self._origin + round(at))
            if n <= m - 1:  # read the update before it first, just after it
                m -= 1
                lo, hi = self._range(m)
        # After the latest the update can be: a lone read cannot tell an early read (before its
        # update) from one after it, as a read one period after the one before can.
        self._plan = ("regular", m)
        return max(now_ns, self._origin + round(hi) + self.jitter_bound_ns)

    # ----------------------------------------------------------------------------- intake

    def on_read(self, t0_ns: int, t1_ns: int, energy_j: float) -> Knot | None:
        """Feed one read (its call began at `t0_ns` and returned at `t1_ns`).

        Returns:
            The knot to add to the energy series, or None (the value did not change, or the
            read is not usable: non-finite energy, or times out of order).
        """
        if t1_ns < t0_ns or not math.isfinite(energy_j):
            return None
        read = _Read(t0_ns, t1_ns, energy_j)
        prev = self._prev
        if prev is not None and read.mid <= prev.mid:
            return None
        self.reads += 1
        self._costs.append(t1_ns - t0_ns)
        self._sorted_costs = None
        self._prev = read
        plan, self._plan = self._plan, None
        if prev is None:
            self._origin = read.t0
            return Knot(read.mid, energy_j)
        changed = energy_j != prev.energy_j
        if self.state is PhaseState.PLAIN:
            if read.mid - self._plain_since >= self.relearn_after_ns:
                self._relearn(read)
            return Knot(read.mid, energy_j) if changed else None
        if plan is not None and plan[0] == "test":
            self._tested = max(self._tested, plan[1])
        if self.state is PhaseState.LEARNING:
            self._learn_reads += 1
            if not changed:
                self._changed_run = 0
            elif plan is None or read.mid - prev.mid < 3 * self.learn_interval_ns:
                self._changed_run += 1  # (See `_PLAIN_AFTER_CHANGES`: not a read far apart.)
            self._held = self._held or not changed
            if self._changed_run >= _PLAIN_AFTER_CHANGES or self._learn_reads >= _MAX_LEARN_READS:
                self._plain(read.mid)
                return Knot(read.mid, energy_j) if changed else None
        knot = self._observe(prev, read, changed, plan)
        self._check_state()
        self._locked_reads = self._locked_reads + 1 if self.locked else 0
        return knot

    def _observe(
        self, prev: _Read, read: _Read, changed: bool, plan: tuple[str, int] | None
    ) -> Knot | None:
        """Turn one read into bounds on the grid; place its knot."""
        slack = self.jitter_bound_ns
        first = self._seen + 1  # the first update not seen yet
        t0, t1 = read.t0 - self._origin, read.t1 - self._origin
        if not changed:
            self._bound(_Bound(first, t0 - slack, math.inf))
            if self.locked and plan is not None and plan[0] == "regular":
                self.misses += 1
                self._missed_run += 1
                if self._missed_run >= _LOSE_LOCK_MISSES:
                    self._relearn(read)
            return None
        self._missed_run = 0
        self._bound(_Bound(first, prev.t0 - self._origin - slack, t1 + slack))
        newest = first
        if self._poly:  # later updates that came before this read too (a late or slow read)
            while True:
                lo, hi = self._range(newest + 1)
                if hi + slack < t0 or (lo - slack <= t1 and (lo + hi) / 2 <= t1):
                    newest += 1
                else:
                    break
        self._seen = newest
        if not self._poly:
            return Knot((prev.mid + read.mid) // 2, read.energy_j)
        at = self._origin + round(self._centre(newest))
        return Knot(min(max(at, prev.mid + 1), read.mid), read.energy_j)

    def _bound(self, bound: _Bound) -> None:
        """Add a bound to the grid polygon; rebuild from the newest on a contradiction."""
        self._bounds.append(bound)
        if not self._poly:
            self._rebuild()
            return
        lo, hi = self._range(bound.n)
        if lo >= bound.lo and hi <= bound.hi:
            self._bounds.pop()  # it says nothing new
            return
        poly = self._cut(self._poly, bound)
        if len(poly) < 3:
            self._rebuild(keep=len(self._bounds) // 2)
            return
        self._poly = poly

    @staticmethod
    def _cut(poly: list[Vertex], bound: _Bound) -> list[Vertex]:
        if bound.hi < math.inf:
            poly = _clip(poly, bound.n, bound.hi, 1.0)
        if bound.lo > -math.inf and poly:
            poly = _clip(poly, bound.n, bound.lo, -1.0)
        return poly

    def _rebuild(self, keep: int | None = None) -> None:
        """The polygon from the newest `keep` bounds (all by default); relearn if they conflict."""
        bounds = list(self._bounds)[-keep:] if keep else list(self._bounds)
        anchor = next((b for b in bounds if b.lo > -math.inf and b.hi < math.inf), None)
        if anchor is None:
            self._poly = []
            if self.state is PhaseState.LOCKED:
                # The bounds that contradicted the grid left none to lock on (a counter that
                # held its value for several periods): learn it from scratch, as after misses.
                # (Staying LOCKED without a grid raised at the next plan, and the reader never
                # read that GPU again; keeping the one-sided bounds learnt a wrong period.)
                self._relearn(None)
            return
        # Start from every grid whose point `anchor.n` lies in its bound, any period allowed.
        pmin, pmax = 2.0 * self.learn_interval_ns, float(_MAX_PERIOD_NS)
        n = anchor.n
        poly: list[Vertex] = [
            (anchor.lo - n * pmin, pmin),
            (anchor.hi - n * pmin, pmin),
            (anchor.hi - n * pmax, pmax),
            (anchor.lo - n * pmax, pmax),
        ]
        for bound in bounds:
            poly = self._cut(poly, bound)
            if len(poly) < 3:
                if len(bounds) > 2:
                    self._rebuild(keep=len(bounds) // 2)
                else:
                    self._relearn(None)
                return
        self._bounds = deque(bounds, maxlen=_KEEP_BOUNDS)
        self._poly = poly

    def _check_state(self) -> None:
        if not self._poly or self.state is PhaseState.PLAIN:
            return
        lo, hi = self._range(self._seen + 1)
        if max(v[1] for v in self._poly) < max(
            2 * self.learn_interval_ns, self.fallback_interval_ns / 2
        ):
            # Updates too fast to read each at this sampling rate: read plainly.
            self._plain(self._prev.mid if self._prev else 0)
        elif (self.state is PhaseState.LEARNING and hi - lo <= self.lock_width_ns
              and self._held):
            # Only a counter seen holding its value has updates to lock onto: reads that all
            # changed narrow the grid against the shortest period they can see (a continuous
            # counter read slowly locked onto 40 ms), and end in PLAIN instead.
            self.state = PhaseState.LOCKED
            self.locks += 1
        elif self.locked and hi - lo > 3 * self.lock_width_ns:
            self.state = PhaseState.LEARNING

    def _relearn(self, read: _Read | None) -> None:
        self.state = PhaseState.LEARNING
        self._bounds.clear()
        self._poly = []
        self._learn_reads = 0
        self._changed_run = 0
        self._held = False
        self._missed_run = 0
        self._seen = -1
        self._tested = -1
        if read is not None:
            self._origin = read.t0

    def _plain(self, mid: int) -> None:
        self.state = PhaseState.PLAIN
        self._bounds.clear()
        self._poly = []
        self._plain_since = mid
