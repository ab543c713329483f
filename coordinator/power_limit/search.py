"""Search strategies: which power limit to profile next, and for how many steps.

Pure: a strategy sees only the windows already profiled (never unprofiled limits), reads no clock
and does no I/O. The state machine asks it for the next probe and executes it.

* `Probe`: one profiling window to run: power limit (W), warm-up steps, profile steps.
* `WindowResult`: one profiled window as recorded: limit, steps, time (s), energy (J).
* `aggregate`: merge window results into one `PowerLimitMeasurement` per limit, scaled to the
  configured window length, highest limit first.
* `SearchStrategy` / `Search`: a strategy makes a fresh `Search` per profiling run; the `Search`
  proposes probes one at a time.
* `Exhaustive`: the seed's search (the default): every limit from max down, one full window each.
* `Adaptive`: a faster, noise-aware descent (opt in with `search="adaptive"` or `Adaptive(...)`):
  1. descend from the maximum limit with short windows (`chunk` x profile_steps);
  2. while a limit's cost is statistically indistinguishable from the best other limit's, extend it
     with another short window at the same limit (no warm-up needed, the limit is already set), up
     to `max_steps` x profile_steps;
  3. stop descending once two consecutive limits are clearly worse than the best (each z-score above
     `k_stop` under the assumed per-window `noise`, the second higher than the first), or one is
     `big_rise` above the best;
  4. re-profile up to `max_refines` contenders still within `k_refine` sigmas of the best.
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


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One recorded profiling window.

    Attributes:
        power_limit: Power limit (W) of the window.
        steps: Number of training steps in the window.
        time: Duration of the window (s).
        energy: Energy of the window over all GPUs (J).
    """

    power_limit: int
    steps: int
    time: float
    energy: float


def aggregate(results: Sequence[WindowResult], profile_steps: int) -> list[PowerLimitMeasurement]:
    """Merge window results into one measurement per limit, highest limit first.

    Windows of one limit are pooled (sum of time and energy over sum of steps) and scaled to a
    `profile_steps` window, so limits profiled with different window lengths compare directly. A
    limit profiled by exactly one `profile_steps` window keeps its recorded values bit for bit.

    Args:
        results: Recorded windows, in any order.
        profile_steps: The reference window length (steps).

    Returns:
        The measurements, sorted from the highest power limit down.
    """
    pooled: dict[int, list[float]] = {}
    for r in results:
        acc = pooled.setdefault(r.power_limit, [0.0, 0.0, 0.0])
        acc[0] += r.time
        acc[1] += r.energy
        acc[2] += r.steps
    out = []
    for limit in sorted(pooled, reverse=True):
        time, energy, steps = pooled[limit]
        scale = profile_steps / steps
        out.append(
            PowerLimitMeasurement(power_limit=limit, energy=energy * scale, time=time * scale)
        )
    return out


class Search(ABC):
    """One profiling run's search: proposes probes one at a time."""

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
            probe is chosen as soon as a window closes, as the seed does.
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
    def __init__(self, power_limits: Sequence[int], warmup_steps: int, profile_steps: int):
        self._limits = list(power_limits)
        self._warmup = warmup_steps
        self._steps = profile_steps

    def next_probe(self, results: Sequence[WindowResult], started: int) -> Probe | None:
        if started >= len(self._limits):
            return None
        return Probe(self._limits[started], self._warmup, self._steps)


class Exhaustive(SearchStrategy):
    """The seed's search: every limit from the highest down, one full window each."""

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
    """Noise-aware descent with short windows, early stop and a final refinement.

    Window lengths are fractions of the configured `profile_steps` (rounded, at least 1 step).

    Attributes:
        chunk: Length of one short window, as a fraction of profile_steps.
        max_steps: Most steps spent on one limit during the descent (fraction of profile_steps).
        refine_steps: Length of a refinement window (fraction of profile_steps).
        noise: Assumed relative noise (1 sigma) of a profile_steps-long window's cost; shorter
            windows are assumed noisier by sqrt(profile_steps / steps).
        k_ambiguous: A limit within this many sigmas of the best other limit is a contender.
        k_stop: A limit more than this many sigmas above the best is "clearly worse".
        big_rise: Stop at once when a limit costs this fraction more than the best.
        k_refine: After the descent, a limit within this many sigmas of the best is re-profiled.
        max_refines: Most refinement windows after the descent.
    """

    chunk: float = 0.25
    max_steps: float = 0.75
    refine_steps: float = 0.5
    noise: float = 0.01
    k_ambiguous: float = 2.0
    k_stop: float = 4.0
    big_rise: float = 0.3
    k_refine: float = 1.5
    max_refines: int = 1

    waits_for_results = True

    def __post_init__(self) -> None:
        for name in ("chunk", "max_steps", "refine_steps", "noise"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Adaptive.{name} must be positive; got {getattr(self, name)}.")
        if self.max_steps < self.chunk:
            raise ValueError(
                f"Adaptive.max_steps ({self.max_steps}) must be at least chunk ({self.chunk})."
            )
        if self.max_refines < 0:
            raise ValueError(f"Adaptive.max_refines must be >= 0; got {self.max_refines}.")

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
        return _AdaptiveSearch(self, power_limits, warmup_steps, profile_steps, cost)


class _AdaptiveSearch(Search):
    def __init__(
        self,
        params: Adaptive,
        power_limits: Sequence[int],
        warmup_steps: int,
        profile_steps: int,
        cost: CostFunction,
    ) -> None:
        def steps(fraction: float) -> int:
            return max(1, round(fraction * profile_steps))

        self._p = params
        self._limits = list(power_limits)
        self._warmup = warmup_steps
        self._profile_steps = profile_steps
        self._chunk = steps(params.chunk)
        self._max_steps = max(self._chunk, steps(params.max_steps))
        self._refine = steps(params.refine_steps)
        self._cost = cost
        self._index = 0  # Descent position in self._limits.
        self._descending = True
        self._worse_run = 0
        self._prev_cost: float | None = None
        self._refines = 0

    def next_probe(self, results: Sequence[WindowResult], started: int) -> Probe | None:
        if not results:
            return Probe(self._limits[0], self._warmup, self._chunk)
        steps: dict[int, int] = {}
        for r in results:
            steps[r.power_limit] = steps.get(r.power_limit, 0) + r.steps
        costs = self._cost(aggregate(results, self._profile_steps))
        last = results[-1].power_limit

        def sigma(limit: int) -> float:
            return self._p.noise * math.sqrt(self._profile_steps / steps[limit])

        def z(a: int, b: int) -> float:
            return (costs[a] - costs[b]) / (costs[b] * math.hypot(sigma(a), sigma(b)))

        def best(exclude: int | None = None) -> int | None:
            # Highest limit first on ties, like the selectors.
            others = [pl for pl in sorted(costs, reverse=True) if pl != exclude]
            return min(others, key=lambda pl: costs[pl]) if others else None

        if self._descending:
            current = self._limits[self._index]
            other = best(exclude=current)
            if (
                other is not None
                and abs(z(current, other)) <= self._p.k_ambiguous
                and steps[current] < self._max_steps
            ):
                size = min(self._chunk, self._max_steps - steps[current])
                return Probe(current, 0, size)
            worse = other is not None and z(current, other) > self._p.k_stop
            rising = self._prev_cost is None or costs[current] > self._prev_cost
            self._worse_run = (
                self._worse_run + 1 if worse and (rising or not self._worse_run) else 0
            )
            self._prev_cost = costs[current]
            big = other is not None and costs[current] > costs[other] * (1 + self._p.big_rise)
            if self._worse_run >= 2 or big or self._index == len(self._limits) - 1:
                self._descending = False
            else:
                self._index += 1
                return Probe(self._limits[self._index], self._warmup, self._chunk)

        if self._refines < self._p.max_refines:
            top = best()
            assert top is not None
            rivals = [pl for pl in costs if pl != top and z(pl, top) <= self._p.k_refine]
            contenders = [pl for pl in [*rivals, top] if steps[pl] < self._max_steps]
            if rivals and contenders:
                target = min(contenders, key=lambda pl: (steps[pl], -pl))
                self._refines += 1
                return Probe(target, 0 if target == last else self._warmup, self._refine)
        return None


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
