"""Search strategies: which power limit to profile next, and for how many steps.

Pure: a strategy sees only the windows already profiled (never unprofiled limits), reads no clock
and does no I/O. The state machine asks it for the next probe and executes it.

* `Probe`: one profiling window to run: power limit (W), warm-up steps, profile steps.
* `WindowResult`: one profiled window as recorded: limit, steps, time (s), energy (J).
* `aggregate`: merge window results into one `PowerLimitMeasurement` per limit, scaled to the
  configured window length, highest limit first.
* `SearchStrategy` / `Search`: a strategy makes a fresh `Search` per profiling run; the `Search`
  proposes probes one at a time.
* `Exhaustive`: Zeus 0.16's search (the default): every limit from max down, one full window each.
* `Adaptive`: a faster, noise-aware descent (opt in with `search="adaptive"` or `Adaptive(...)`):
  1. descend from the maximum limit with short windows (`chunk` x profile_steps), warming up at
     each new limit;
  2. extend the last profiled limit in place (no warm-up: the limit is already set) while it and
     the best other limit could still be misjudged by more than `tolerance` (`k_ambiguous`
     sigmas), up to `max_steps` x profile_steps on one limit and `ext_ratio` times the other's;
     also while it looks costlier than the best other but could truly be cheaper by more than
     `guard_regret` (`k_guard_extend` sigmas), up to `guard_extend` x profile_steps: a limit
     read once, in a short window that came out a few sigmas high, is the mechanism of the
     largest regrets, and a few more steps in place cost no warm-up, unlike a visit later;
  3. while the cost falls steeply (more than `steep` per limit), skip the next limit; if the cost
     did not keep falling across the skip, go back and profile the skipped limit at once, and
     skip no more (past a valley's floor, or on a rough profile, a skipped limit may hide a dip
     that neither neighbour hints at: the out-of-fold cases with an optimum never profiled);
  4. stop descending only after `patience` consecutive limits are clearly worse than the best
     (more than `k_stop` sigmas and `rel_stop` above it), each costlier than the one above it, or
     one is clearly worse by more than `big_rise`; before stopping, confirm the best with a longer
     measurement and judge again. A single bump (a noisy window, or the jitter of a real profile)
     followed by a drop does not end the descent; once a bump is seen (a limit clearly costlier
     than its profiled neighbours on both sides) the profile is rough: no more skips and no early
     stop;
  5. profile a skipped limit next to the best or to one of its rivals (below); make sure the best
     has `confirm` x profile_steps;
     re-profile (up to `max_refines` windows of `refine_steps`) the limits that could be misjudged
     against the best (`k_refine` sigmas), least profiled first (`focused_refinement`: the best
     and its most ambiguous rival only, confirmation not counted); finally, while a rival could
     still be misjudged against it, settle the best: profile it up to `settle` x profile_steps
     in one window (of close limits, the one measured shortest is the likeliest to look best by
     luck), again if another limit then looks best;
  6. optionally (`k_guard` > 0; on in the defaults, 2.5) guard against a large regret: before
     finishing, profile once more each limit that could still be cheaper than the best by more
     than `guard_regret` at `k_guard` sigmas (the optimum read once in a short, unluckily high
     window: the out-of-fold worst cases), then go on from step 5. It lowers the tail but costs
     ~0.015-0.025 of the exhaustive search's time; the tuning pays for it with `confirm` 0.5;
  7. never spend more than `budget` x the exhaustive search's steps (if set).
  A window the machine leaves out (`PowerLimitStateMachine.discard`: it measured nothing, or its
  limit was redone `MAX_REDOS` times) is seen by the next call as a window started but never
  recorded: its limit is not profiled again (what it measured before stands), the descent goes
  on past it (a skip across it is taken back: the fall was not shown), and nothing is extended
  in place (the GPU ran that limit since the last recorded window).
  Sigmas come from the assumed per-window `noise` of time and of energy (independent), through
  the cost: a ZeusCost mixing both is less noisy than either. Thresholds are relative (fractions
  of the cost, sigmas of a relative noise), so they hold for any workload's scale. The defaults
  were tuned by cross-validation across workloads (`bench/tune_adaptive_search.py`).
  Costs are the selector's own (`Energy`, `Time`, `ZeusCost`); for any other selector `Adaptive`
  falls back to `Exhaustive`, since it cannot tell "clearly worse" without a cost.
* `resolve_search`: turn the machine's `search` keyword (`"exhaustive"`, `"adaptive"` or a strategy)
  into a strategy.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.power_limit.readings import Readings, WindowResult, aggregate, cost_spread
from coordinator.power_limit.selectors import Energy, OptimumSelector, Time, ZeusCost
from zeus_agent.models import PowerLimitMeasurement

__all__ = [
    "Adaptive",
    "Exhaustive",
    "Probe",
    "Search",
    "SearchStrategy",
    "WindowResult",
    "aggregate",
    "resolve_search",
]

CostFunction = Callable[[Sequence[PowerLimitMeasurement]], dict[int, float]]


@dataclass(frozen=True, slots=True)
class Probe:
    """One profiling window the machine should run.

    Attributes:
        power_limit: Power limit (W) to profile.
        warmup_steps: Steps to run at the limit before the window opens (0: open at once).
        profile_steps: Steps the window lasts (at least 1).
    """

    power_limit: int
    warmup_steps: int
    profile_steps: int


class Search(ABC):
    """One profiling run's search: proposes probes one at a time."""

    sweeps: bool = False
    """Whether it proposes each limit once, in a fixed order, whatever the results (Zeus's)."""

    @abstractmethod
    def next_probe(self, results: Sequence[WindowResult], started: int) -> Probe | None:
        """Return the next window to profile, or None when the search is over.

        Args:
            results: The windows recorded so far, in the order they were profiled.
            started: How many windows have been started and completed (recorded or not).

        Returns:
            The next probe, or None when no more windows are needed.
        """


class SearchStrategy(ABC):
    """A way of searching the power limits; makes a fresh `Search` per profiling run.

    Attributes:
        waits_for_results: If True, the machine asks for the next probe only once every closed
            window has been recorded (the choice depends on the results). If False, the next
            probe is chosen as soon as a window closes, as Zeus 0.16 does.
    """

    waits_for_results: bool = True

    @abstractmethod
    def plan(
        self,
        power_limits: Sequence[int],
        warmup_steps: int,
        profile_steps: int,
        selector: OptimumSelector,
    ) -> Search:
        """Start a search over `power_limits` (W, highest first).

        Args:
            power_limits: Candidate limits, highest first.
            warmup_steps: Configured warm-up steps for each new limit.
            profile_steps: Configured profiling window length (steps).
            selector: The selector that will pick the optimum from the measurements.

        Returns:
            The search for one profiling run.
        """


class _ExhaustiveSearch(Search):
    sweeps = True

    def __init__(self, power_limits: Sequence[int], warmup_steps: int, profile_steps: int):
        self._limits = list(power_limits)
        self._warmup = warmup_steps
        self._steps = profile_steps

    def next_probe(self, results: Sequence[WindowResult], started: int) -> Probe | None:
        if started >= len(self._limits):
            return None
        return Probe(self._limits[started], self._warmup, self._steps)


class Exhaustive(SearchStrategy):
    """Zeus 0.16's search: every limit from the highest down, one full window each."""

    waits_for_results = False

    def plan(
        self,
        power_limits: Sequence[int],
        warmup_steps: int,
        profile_steps: int,
        selector: OptimumSelector,
    ) -> Search:
        """Start an exhaustive search (see `SearchStrategy.plan`)."""
        return _ExhaustiveSearch(power_limits, warmup_steps, profile_steps)

    def __repr__(self) -> str:
        return "Exhaustive()"


def cost_function(selector: OptimumSelector) -> CostFunction | None:
    """Return the per-limit cost a selector minimises, or None if it is not a known one.

    Args:
        selector: An optimum selector.

    Returns:
        A function from measurements to {limit: cost}, or None for selectors without a cost
        (`MaxSlowdownConstraint`, user-defined ones).
    """
    if isinstance(selector, ZeusCost):
        return selector.costs
    if isinstance(selector, Energy):
        return lambda ms: {m.power_limit: m.energy for m in ms}
    if isinstance(selector, Time):
        return lambda ms: {m.power_limit: m.time for m in ms}
    return None


@dataclass(frozen=True, slots=True)
class Adaptive(SearchStrategy):
    """Noise-aware descent with short windows, skips, early stop and refinement.

    Window lengths are fractions of the configured `profile_steps` (rounded, at least 1 step).

    Attributes:
        chunk: Length of one short window, as a fraction of profile_steps.
        ext_ratio: Extend a limit in place only while it has fewer than this many times the
            steps of the limit it is compared with (its noise would no longer dominate).
        max_steps: Most steps spent on one limit (fraction of profile_steps).
        refine_steps: Length of a refinement window (fraction of profile_steps).
        noise: Assumed relative noise (1 sigma) of a profile_steps-long window's time and, apart,
            of its energy; shorter windows are assumed noisier by sqrt(profile_steps / steps).
        tolerance: Costs this fraction apart count as equally good.
        k_ambiguous: Extend the current limit while it and the best other limit could be
            misjudged by more than `tolerance` at this many sigmas.
        steep: Skip the next limit while the cost falls by more than this fraction per visited
            limit (inf: never skip); a skip is taken back at once if the fall did not go on (and
            then no more skips are taken), and a skipped limit next to the best is profiled at
            the end.
        k_stop: A limit more than this many sigmas above the best is "clearly worse"...
        rel_stop: ...and more than this fraction above the best.
        patience: Stop descending after this many consecutive clearly worse limits, each
            costlier than the one above it (the best is confirmed first).
        big_rise: Stop at once when a limit is clearly worse and costs this fraction more than
            the best (the best is confirmed first).
        k_refine: After the descent, re-profile limits that could be misjudged against the best
            by more than `tolerance` at this many sigmas.
        max_refines: Most refinement windows after the descent.
        confirm: Before finishing, the best limit must have been profiled for at least this
            fraction of profile_steps (a short window that looks best may just be lucky).
        budget: Most steps (warm-up + profiling) of one search, as a fraction of the exhaustive
            search's steps; 0 or less: no budget.
        focused_refinement: If True (a tuned setting, on in the shipped defaults), confirmation
            windows of the best do not count against `max_refines` (a new best is confirmed
            too), and each refinement re-profiles the rival most likely to be misjudged against
            the best (fewest sigmas) or the best, whichever has fewer steps. If False, the least
            profiled of the best and all its rivals within `k_refine`, and confirmation counts.
        settle: Before finishing, a best with a rival within `k_refine` sigmas is profiled up to
            this fraction of profile_steps (capped by `max_steps`), in one window, not counted
            against `max_refines`; 0: off.
        k_guard: Guard against a large regret: before finishing, every limit that could still
            be truly cheaper than the best by more than `guard_regret` at this many sigmas is
            profiled once more (one `chunk` window per limit, a second independent draw; not
            counted against `max_refines`); then the search goes on (a limit that then looks
            best is confirmed and settled). It catches the optimum measured by one short,
            unluckily high window, which `k_refine` (sized for 1% misjudgements) lets go. 0: off.
        guard_regret: The regret (a fraction of the cost) `k_guard` and `k_guard_extend` guard
            against.
        guard_extend: Extend the last limit in place (one `chunk` window at a time, no warm-up)
            while it has fewer steps than this fraction of profile_steps, looks costlier than
            the best other limit, and could still be truly cheaper than it by more than
            `guard_regret` at `k_guard_extend` sigmas; 0: off. The guard below re-visits such a
            limit after the descent, at the price of a warm-up; in place, while the limit is
            set, the same evidence costs a fraction of it, so the threshold can be stricter.
        k_guard_extend: The sigmas of the `guard_extend` test.
    """

    chunk: float = 0.1
    ext_ratio: float = 2.0
    max_steps: float = 2.0
    refine_steps: float = 0.25
    noise: float = 0.01
    tolerance: float = 0.01
    k_ambiguous: float = 1.5
    steep: float = 0.03
    k_stop: float = 4.0
    rel_stop: float = 0.02
    patience: int = 3
    big_rise: float = 0.3
    k_refine: float = 1.25
    max_refines: int = 6
    confirm: float = 0.5
    budget: float = 0.0
    focused_refinement: bool = True
    settle: float = 0.75
    k_guard: float = 2.5
    guard_regret: float = 0.03
    guard_extend: float = 0.3
    k_guard_extend: float = 3.0

    waits_for_results = True

    def __post_init__(self) -> None:
        for name in ("chunk", "max_steps", "refine_steps", "noise"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Adaptive.{name} must be positive; got {getattr(self, name)}.")
        if self.max_steps < self.chunk:
            raise ValueError(
                f"Adaptive.max_steps ({self.max_steps}) must be at least chunk ({self.chunk})."
            )
        for name in ("settle", "k_guard", "guard_regret", "guard_extend", "k_guard_extend"):
            if getattr(self, name) < 0:
                raise ValueError(f"Adaptive.{name} must be >= 0; got {getattr(self, name)}.")
        if self.max_refines < 0:
            raise ValueError(f"Adaptive.max_refines must be >= 0; got {self.max_refines}.")
        if self.patience < 1:
            raise ValueError(f"Adaptive.patience must be >= 1; got {self.patience}.")

    def plan(
        self,
        power_limits: Sequence[int],
        warmup_steps: int,
        profile_steps: int,
        selector: OptimumSelector,
    ) -> Search:
        """Start an adaptive search (see `SearchStrategy.plan`); exhaustive without a cost."""
        cost = cost_function(selector)
        if cost is None:
            return _ExhaustiveSearch(power_limits, warmup_steps, profile_steps)
        return _AdaptiveSearch(self, power_limits, warmup_steps, profile_steps, selector, cost)


class _AdaptiveSearch(Search):
    def __init__(
        self,
        params: Adaptive,
        power_limits: Sequence[int],
        warmup_steps: int,
        profile_steps: int,
        selector: OptimumSelector,
        cost: CostFunction,
    ) -> None:
        def steps(fraction: float) -> int:
            return max(1, round(fraction * profile_steps))

        self._p = params
        self._selector = selector
        self._limits = list(power_limits)
        self._warmup = warmup_steps
        self._profile_steps = profile_steps
        self._chunk = steps(params.chunk)
        self._max_steps = max(self._chunk, steps(params.max_steps))
        self._refine = steps(params.refine_steps)
        self._confirm = round(params.confirm * profile_steps)
        self._settle = round(params.settle * profile_steps)
        self._guard_extend = round(params.guard_extend * profile_steps)
        self._budget = (
            params.budget * len(self._limits) * (warmup_steps + profile_steps)
            if params.budget > 0
            else math.inf
        )
        self._cost = cost
        self._index = 0  # Descent position in self._limits.
        self._descending = True
        self._pending_skip: tuple[int, int] | None = None  # (limit above, skipped limit)
        self._skipped: set[int] = set()
        self._rough = False  # A bump was seen: the profile is not one smooth valley.
        self._skips_over = False  # A skip was taken back: no more skips.
        self._refines = 0
        self._guarded: set[int] = set()  # Limits the guard re-profiled (once each).
        self._left_out: set[int] = set()  # Limits whose window the machine left out.
        self._asked: tuple[int, int, int] | None = None  # Last probe: limit, results, started.

    def _spent(self, results: Sequence[WindowResult]) -> int:
        """Steps spent so far: every window, plus a warm-up whenever the limit changed."""
        spent = 0
        previous: int | None = None
        for r in results:
            spent += r.steps + (self._warmup if r.power_limit != previous else 0)
            previous = r.power_limit
        return spent

    def next_probe(self, results: Sequence[WindowResult], started: int) -> Probe | None:
        in_place: int | None = results[-1].power_limit if results else None
        if self._asked is not None:
            limit, recorded, begun = self._asked
            if started - begun > len(results) - recorded:
                # The last probe's window was closed but never recorded: left out.
                self._left_out.add(limit)
                in_place = None
        probe = self._choose(results, in_place)
        if probe is not None:
            self._asked = (probe.power_limit, len(results), started)
        return probe

    def _choose(self, results: Sequence[WindowResult], in_place: int | None) -> Probe | None:
        """The next probe; `in_place`: the limit still set since its window was recorded."""
        if not results:
            return self._first_probe()
        r = self._read(results)
        probe = self._extend_in_place(r, in_place)
        if probe is None and self._descending:
            probe = self._descend(r, in_place)
        if probe is not None:
            return probe
        top = r.best()
        assert top is not None
        for phase in (self._revisit_skipped, self._refine_rivals, self._settle_best, self._guard):
            if (probe := phase(r, top, in_place)) is not None:
                return probe
        return None

    def _first_probe(self) -> Probe | None:
        """Nothing recorded: the descent starts at the first limit not left out."""
        while self._index < len(self._limits) and self._limits[self._index] in self._left_out:
            self._index += 1
        if self._index == len(self._limits):
            return None
        return Probe(self._limits[self._index], self._warmup, self._chunk)

    def _read(self, results: Sequence[WindowResult]) -> Readings:
        """What the recorded windows say, for this one decision."""
        steps: dict[int, int] = {}
        for w in results:
            steps[w.power_limit] = steps.get(w.power_limit, 0) + w.steps
        measured = aggregate(results, self._profile_steps)
        spread = cost_spread(self._selector, measured)
        p, last = self._p, results[-1].power_limit
        return Readings(
            steps,
            self._cost(measured),
            spread,
            p.noise,
            p.tolerance,
            self._profile_steps,
            last,
            self._spent(results),
        )

    def _open_to(self, r: Readings, limit: int) -> bool:
        """Whether `limit` may still be profiled more."""
        return limit not in self._left_out and r.steps[limit] < self._max_steps

    def _visit(self, r: Readings, target: int, in_place: int | None, size: int) -> Probe | None:
        """A `size`-step window at `target` (warmed up unless still set), if the budget allows."""
        warmup = 0 if target == in_place else self._warmup
        return Probe(target, warmup, size) if r.spent + warmup + size <= self._budget else None

    def _extend_in_place(self, r: Readings, in_place: int | None) -> Probe | None:
        """Extend the last limit in place, at no warm-up, while that still pays.

        While it is ambiguous against the best other, or while it looks costlier but could be the
        optimum read high (the guard).
        """
        p, last, steps = self._p, r.last, r.steps
        other = r.best(exclude=last)
        size = min(self._chunk, self._max_steps - steps[last])
        if (
            other is not None
            and in_place == last
            and size > 0
            and (
                (
                    r.danger(last, other) <= p.k_ambiguous
                    and steps[last] < p.ext_ratio * steps[other]
                )
                or (
                    steps[last] < self._guard_extend
                    and r.costs[last] >= r.costs[other]
                    and r.danger(last, other, p.guard_regret) <= p.k_guard_extend
                )
            )
            and r.spent + size + self._remaining() <= self._budget
        ):
            return Probe(last, 0, size)
        return None

    def _remaining(self) -> int:
        """Steps the rest of the descent needs at least."""
        left = len(self._limits) - 1 - self._index if self._descending else 0
        return left * (self._warmup + self._chunk)

    def _descend(self, r: Readings, in_place: int | None) -> Probe | None:
        """The descent's next probe; None once the descent is over (it is then marked so)."""
        current = self._limits[self._index]
        if (probe := self._take_back_skip(r, current)) is not None:
            return probe
        top = r.best()
        assert top is not None
        stop = self._should_stop(r, current, top)
        if stop and self._open_to(r, top) and r.steps[top] < self._confirm:
            # The evidence for stopping is only as good as the best's measurement: confirm it
            # first (a lucky short window must not end the descent), then judge again.
            size = min(self._refine, self._max_steps - r.steps[top])
            if (probe := self._visit(r, top, in_place, size)) is not None:
                return probe
        if (
            stop
            or self._index == len(self._limits) - 1
            or r.spent + self._warmup + self._chunk > self._budget
        ):
            self._descending = False
            return None
        return self._step_down(r, current)

    def _take_back_skip(self, r: Readings, current: int) -> Probe | None:
        """The skipped limit, if the cost did not keep falling across the pending skip."""
        if self._pending_skip is None:
            return None
        above, skipped = self._pending_skip
        self._pending_skip = None
        if current not in r.costs or r.costs[current] * (1 + self._p.steep) >= r.costs[above]:
            # The fall stopped (a valley's floor, a rough stretch, `current` left out): skipping
            # further could step over a dip no neighbour's cost hints at.
            self._skips_over = True
            return Probe(skipped, self._warmup, self._chunk)
        self._skipped.add(skipped)
        return None

    def _should_stop(self, r: Readings, current: int, top: int) -> bool:
        """Whether the descent has gone far enough past the best (never on a rough profile)."""
        p = self._p

        def worse(pl: int) -> bool:
            return (
                pl != top
                and r.z(pl, top) > p.k_stop
                and r.costs[pl] > r.costs[top] * (1 + p.rel_stop)
            )

        # Trailing run: the last descent limits, each clearly worse than the best and each
        # costlier than the one above it. A bump followed by a drop breaks the run.
        descent = [pl for pl in self._limits[: self._index + 1] if pl in r.costs]
        run = 0
        for k in range(len(descent) - 1, -1, -1):
            if not worse(descent[k]):
                break
            run += 1
            if k == 0 or r.costs[descent[k]] <= r.costs[descent[k - 1]]:
                break
        # A bump (a limit clearly costlier than its profiled neighbours on both sides): a rough
        # profile says little about unprofiled limits, so no more skips, no stop at one rise.
        self._rough = self._rough or any(
            r.z(descent[k], descent[k - 1]) > p.k_stop
            and r.z(descent[k], descent[k + 1]) > p.k_stop
            for k in range(1, len(descent) - 1)
        )
        big = (
            not self._rough
            and current in r.costs  # A left-out limit says nothing: the descent goes on.
            and worse(current)
            and r.costs[current] > r.costs[top] * (1 + p.big_rise)
        )
        return (run >= p.patience or big) and not self._rough

    def _step_down(self, r: Readings, current: int) -> Probe:
        """The next limit down; one is skipped while the cost falls steeply on a smooth profile."""
        higher = [pl for pl in r.costs if pl > current]
        prev_cost = r.costs[min(higher)] if higher else None
        falling = (
            not self._rough
            and not self._skips_over
            and prev_cost is not None
            and current in r.costs
            and r.costs[current] * (1 + self._p.steep) < prev_cost
        )
        if falling and self._index + 2 < len(self._limits):
            self._pending_skip = (current, self._limits[self._index + 1])
            self._index += 2
        else:
            self._index += 1
        return Probe(self._limits[self._index], self._warmup, self._chunk)

    def _revisit_skipped(self, r: Readings, top: int, in_place: int | None) -> Probe | None:
        """A skipped limit next to the best or to a rival that could be misjudged against it.

        A lucky reading elsewhere must not hide a skipped optimum.
        """
        rivals = sorted(r.rivals(top, self._p.k_refine), key=lambda pl: r.danger(pl, top))
        for near in [top, *rivals]:
            i = self._limits.index(near)
            for j in (i - 1, i + 1):
                if 0 <= j < len(self._limits) and self._limits[j] in self._skipped:
                    target = self._limits[j]
                    self._skipped.discard(target)
                    if r.spent + self._warmup + self._chunk <= self._budget:
                        return Probe(target, self._warmup, self._chunk)
        return None

    def _refine_rivals(self, r: Readings, top: int, in_place: int | None) -> Probe | None:
        """Confirm the best, then re-profile the limits that could be misjudged against it."""
        p = self._p
        confirming = self._open_to(r, top) and r.steps[top] < self._confirm
        if p.focused_refinement and (confirming or self._refines < p.max_refines):
            return self._refine_focused(r, top, in_place, confirming)
        if not p.focused_refinement and self._refines < p.max_refines:
            return self._refine_least_profiled(r, top, in_place, confirming)
        return None

    def _refine_focused(
        self, r: Readings, top: int, in_place: int | None, confirming: bool
    ) -> Probe | None:
        """Confirm the best (not counted as a refinement), else refine its likeliest rival.

        Of the best and the rival most likely to be misjudged against it, the less profiled.
        """
        pair = [top]
        if not confirming:
            rivals = r.rivals(top, self._p.k_refine)
            pair = []
            if rivals:
                rival = min(rivals, key=lambda pl: (r.danger(pl, top), -pl))
                pair = [pl for pl in (rival, top) if self._open_to(r, pl)]
                if not pair:  # Both at max_steps: the next most ambiguous rivals.
                    pair = [pl for pl in rivals if self._open_to(r, pl)]
        if not pair:
            return None
        target = min(pair, key=lambda pl: (r.steps[pl], -pl))
        size = min(self._refine, self._max_steps - r.steps[target])
        probe = self._visit(r, target, in_place, size)
        if probe is not None and not confirming:
            self._refines += 1
        return probe

    def _refine_least_profiled(
        self, r: Readings, top: int, in_place: int | None, confirming: bool
    ) -> Probe | None:
        """Refine the least profiled of the best and all its rivals; confirmation counts."""
        rivals = r.rivals(top, self._p.k_refine)
        contenders = [pl for pl in [*rivals, top] if self._open_to(r, pl)]
        if confirming:
            rivals, contenders = [top], [top]
        if not (rivals and contenders):
            return None
        target = min(contenders, key=lambda pl: (r.steps[pl], -pl))
        size = min(self._refine, self._max_steps - r.steps[target])
        probe = self._visit(r, target, in_place, size)
        if probe is not None:
            self._refines += 1
        return probe

    def _settle_best(self, r: Readings, top: int, in_place: int | None) -> Probe | None:
        """Bring the best to `settle` x profile_steps while a rival could be misjudged against it.

        Of several close limits, the one measured shortest is the likeliest to look best by luck.
        One window brings it there (not counted against max_refines); if another limit then
        looks best, it settles too.
        """
        settle = min(self._settle, self._max_steps)
        if top in self._left_out or r.steps[top] >= settle or not r.rivals(top, self._p.k_refine):
            return None
        return self._visit(r, top, in_place, settle - r.steps[top])

    def _guard(self, r: Readings, top: int, in_place: int | None) -> Probe | None:
        """Profile once more a limit that could still be truly cheaper than the best by a lot.

        More than `guard_regret`, at `k_guard` sigmas. The refinement looks for 1% misjudgements
        within `k_refine` sigmas; the optimum read once, in a short window that came out a few
        sigmas high, is beyond it and would cost a large regret. Closest call first; each limit
        once; afterwards the usual rules (confirm, refine, settle) apply.
        """
        p = self._p
        if not p.k_guard > 0:  # Off.
            return None
        suspects = [
            pl
            for pl in r.costs
            if pl != top
            and pl not in self._guarded
            and pl not in self._left_out
            and r.costs[pl] >= r.costs[top]
            and r.danger(pl, top, p.guard_regret) <= p.k_guard
        ]
        if not suspects:
            return None
        target = min(suspects, key=lambda pl: (r.danger(pl, top, p.guard_regret), -pl))
        self._guarded.add(target)
        size = min(self._chunk, self._max_steps - r.steps[target])
        return self._visit(r, target, in_place, size) if size > 0 else None


def resolve_search(search: str | SearchStrategy) -> SearchStrategy:
    """Return the strategy named by the machine's `search` keyword.

    Args:
        search: `"exhaustive"`, `"adaptive"` or a `SearchStrategy` instance.

    Returns:
        The strategy.

    Raises:
        ValueError: An unknown name.
    """
    if isinstance(search, SearchStrategy):
        return search
    if search == "exhaustive":
        return Exhaustive()
    if search == "adaptive":
        return Adaptive()
    raise ValueError(
        f"Unknown search {search!r}: use 'exhaustive', 'adaptive' or a SearchStrategy instance."
    )
