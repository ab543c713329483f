"""The optimum selectors, which live with the trainers' side (`zeus_agent.selectors`).

Re-exported here for the coordinator's power-limit core: a trainer image never needs the
coordinator to import them, and both sides run the very same code.
"""

from zeus_agent.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
    zeus_cost,
)

__all__ = [
    "Energy",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "Time",
    "ZeusCost",
    "zeus_cost",
]
