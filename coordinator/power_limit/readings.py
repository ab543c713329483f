"""Recorded profiling windows and what they say: each limit's cost and how far to trust it.

Pure arithmetic; the searches that decide from it live in `search.py` (which re-exports
`WindowResult` and `aggregate`).

* `WindowResult` / `aggregate`: the recorded windows, pooled into one measurement per limit.
* `cost_spread` / `Readings`: for the adaptive search, each limit's cost and its noise. Noise is
  relative: a limit's sigma is the assumed per-window noise, scaled by how its cost mixes time
  and energy (`cost_spread`) and by how many steps it was measured for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.power_limit.selectors import Energy, OptimumSelector, ZeusCost
from zeus_agent.models import PowerLimitMeasurement

__all__ = ["Readings", "WindowResult", "aggregate", "cost_spread"]


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


def cost_spread(
    selector: OptimumSelector, measured: Sequence[PowerLimitMeasurement]
) -> dict[int, float]:
    """Relative noise of each limit's cost per unit of relative time and energy noise.

    Time and energy are measured with independent errors. The three costs are linear,
    `a * energy + b * time` (Energy: a=1, b=0; Time: a=0, b=1; ZeusCost: a=eta,
    b=(1-eta) * max_power), so a cost mixing both is less noisy than either:
    sqrt((a E)^2 + (b T)^2) / (a E + b T), between 1/sqrt(2) and 1.
    """
    if isinstance(selector, ZeusCost):
        a = selector.eta_knob
        b = (1 - selector.eta_knob) * max(m.power_limit for m in measured) * selector.world_size
    else:
        a, b = (1.0, 0.0) if isinstance(selector, Energy) else (0.0, 1.0)
    return {
        m.power_limit: math.hypot(a * m.energy, b * m.time) / (a * m.energy + b * m.time)
        for m in measured
    }


@dataclass(frozen=True, slots=True)
class Readings:
    """One decision's view of the recorded windows.

    Attributes:
        steps: Steps recorded per limit.
        costs: The selector's cost per limit (lower is better).
        spread: Each cost's relative noise per unit of window noise (`cost_spread`).
        noise: Assumed relative noise (1 sigma) of one `profile_steps`-long window.
        tolerance: Costs this fraction apart count as equally good.
        profile_steps: The reference window length (steps).
        last: The limit of the last recorded window.
        spent: Steps spent so far, warm-ups included.
    """

    steps: dict[int, int]
    costs: dict[int, float]
    spread: dict[int, float]
    noise: float
    tolerance: float
    profile_steps: int
    last: int
    spent: int

    def sigma(self, limit: int) -> float:
        """Relative noise of `limit`'s cost: fewer steps measured, noisier."""
        return self.noise * self.spread[limit] * math.sqrt(self.profile_steps / self.steps[limit])

    def z(self, a: int, b: int) -> float:
        """Sigmas by which `a` looks costlier than `b`."""
        costs = self.costs
        return (costs[a] - costs[b]) / (costs[b] * math.hypot(self.sigma(a), self.sigma(b)))

    def danger(self, a: int, b: int, margin: float | None = None) -> float:
        """Sigmas by which `a` and `b` must be misjudged for the pick to be `margin` off.

        `margin` defaults to `tolerance`.
        """
        margin = self.tolerance if margin is None else margin
        return (abs(self.costs[a] / self.costs[b] - 1) + margin) / math.hypot(
            self.sigma(a), self.sigma(b)
        )

    def best(self, exclude: int | None = None) -> int | None:
        """The cheapest limit but `exclude`, highest first on ties (as the selectors pick)."""
        others = [pl for pl in sorted(self.costs, reverse=True) if pl != exclude]
        return min(others, key=lambda pl: self.costs[pl]) if others else None

    def rivals(self, top: int, k: float) -> list[int]:
        """Limits that could be misjudged against `top` by more than `tolerance` at `k` sigmas."""
        return [pl for pl in self.costs if pl != top and self.danger(pl, top) <= k]
