"""Optimum selectors: pick the optimal power limit from profiling measurements.

Pure functions of their input, with the names, signatures, validation messages and tie rules of
Zeus's `zeus.optimizer.power_limit`:

* `zeus_cost`: the Zeus time-energy cost `eta * energy + (1 - eta) * max_power * time`.
* `OptimumSelector`: base class, one method `select(measurements) -> watts`.
* `Energy`: the limit with the least energy.
* `Time`: the limit with the least time.
* `ZeusCost`: the limit with the least Zeus cost; `max_power` is the largest measured limit times
  the world size.
* `MaxSlowdownConstraint`: the lowest limit whose time is at most `factor` times the time at the
  largest measured limit (inclusive).

Ties: every selector keeps the first of equal candidates in list order; measurements are stored
highest limit first, so ties go to the higher limit. An empty list raises `ValueError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from zeus_agent.models import PowerLimitMeasurement

__all__ = [
    "Energy",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "Time",
    "ZeusCost",
    "zeus_cost",
]


def zeus_cost(energy: float, time: float, eta_knob: float, max_power: float) -> float:
    """Return the Zeus time-energy cost.

    Args:
        energy: Energy (J).
        time: Time (s).
        eta_knob: Weight of energy, between 0 and 1.
        max_power: Power (W) that converts time into energy: the largest limit times the GPUs.

    Returns:
        `eta_knob * energy + (1 - eta_knob) * max_power * time`, in joules.
    """
    return eta_knob * energy + (1 - eta_knob) * max_power * time


def _require(measurements: Sequence[PowerLimitMeasurement]) -> None:
    if not measurements:
        raise ValueError("measurements must not be empty: profile at least one power limit.")


class OptimumSelector(ABC):
    """Base class for optimum power limit selectors."""

    @abstractmethod
    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """Select the optimal power limit (W) from measurements."""


class Energy(OptimumSelector):
    """Selects the power limit that minimizes energy consumption."""

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """Select the optimal power limit (W) from measurements.

        Raises:
            ValueError: `measurements` is empty.
        """
        _require(measurements)
        return min(measurements, key=lambda x: x.energy).power_limit


class Time(OptimumSelector):
    """Selects the power limit that minimizes training time.

    This may not necessarily choose the maximum power limit, as time profiling results can be
    slightly noisy; time is then very similar among the higher limits, and the lower one draws
    less power.
    """

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """Select the optimal power limit (W) from measurements.

        Raises:
            ValueError: `measurements` is empty.
        """
        _require(measurements)
        return min(measurements, key=lambda x: x.time).power_limit


class ZeusCost(OptimumSelector):
    r"""Selects the power limit that minimizes a linear Zeus time-energy cost function.

    Cost function is $\eta \cdot E + (1 - \eta) \cdot \text{MaxPower} \cdot T$ (E energy,
    T time),
    with MaxPower the largest measured power limit times `world_size`.
    """

    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        r"""Initialize the selector.

        Args:
            eta_knob: The $0 \le \eta \le 1$ knob for the Zeus time-energy cost function.
            world_size: The number of GPUs in the training job. Defaults to 1.

        Raises:
            ValueError: `eta_knob` is outside [0, 1] or `world_size` is below 1.
        """
        if eta_knob < 0 or eta_knob > 1:
            raise ValueError("eta_knob must be between 0 and 1, inclusive both sides.")
        if world_size < 1:
            raise ValueError("world_size must be greater than or equal to 1.")

        self.eta_knob = eta_knob
        self.world_size = world_size

    def costs(self, measurements: Sequence[PowerLimitMeasurement]) -> dict[int, float]:
        """Return the Zeus cost of every measured power limit, in list order.

        Raises:
            ValueError: `measurements` is empty.
        """
        _require(measurements)
        max_power = max(m.power_limit for m in measurements) * self.world_size
        return {
            m.power_limit: zeus_cost(
                energy=m.energy, time=m.time, eta_knob=self.eta_knob, max_power=max_power
            )
            for m in measurements
        }

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """Select the optimal power limit (W) from measurements.

        Raises:
            ValueError: `measurements` is empty.
        """
        cost_map = self.costs(measurements)
        return min(cost_map, key=lambda x: cost_map[x])

    def __repr__(self) -> str:
        return f"ZeusCost(eta_knob={self.eta_knob}, world_size={self.world_size})"


class MaxSlowdownConstraint(OptimumSelector):
    """Selects the minimum power limit that does not slow down training by more than `factor`."""

    def __init__(self, factor: float) -> None:
        """Initialize the selector.

        Args:
            factor: The maximum allowed slowdown factor. Greater than or equal to 1.0.

        Raises:
            ValueError: `factor` is below 1.0.
        """
        if factor < 1.0:
            raise ValueError(
                f"max_slowdown_factor must be greater than or equal to 1.0. Got {factor}.",
            )

        self.factor = factor

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """Select the optimal power limit (W) from measurements.

        Raises:
            ValueError: `measurements` is empty.
        """
        _require(measurements)
        max_power = max(m.power_limit for m in measurements)
        shortest_time = next(m.time for m in measurements if m.power_limit == max_power)
        feasible = [m.power_limit for m in measurements if m.time <= self.factor * shortest_time]
        return min(feasible)

    def __repr__(self) -> str:
        return f"MaxSlowdownConstraint(factor={self.factor})"
