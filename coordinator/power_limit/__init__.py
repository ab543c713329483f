"""The power-limit core: Zeus's optimum selectors and JIT profiler as a pure state machine.

* `selectors`: `OptimumSelector`, `Energy`, `Time`, `ZeusCost`, `MaxSlowdownConstraint`.
* `machine`: `PowerLimitStateMachine`, its states (`Ready`, `Warmup`, `Profiling`, `Done`),
  effects (`SetPowerLimit`, `BeginWindow`, `EndWindow`) and errors.
* `search`: search strategies (`Exhaustive`, the default; `Adaptive`, faster).
* `profile`: `save_profile` / `load_profile` in Zeus's JSON format (the only file I/O here).

`PowerLimitMeasurement` is `zeus_agent.models.PowerLimitMeasurement`, re-exported.
"""

from coordinator.power_limit.machine import (
    MAX_POWER_LIMITS,
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    InvalidTransitionError,
    PowerLimitError,
    PowerLimitRangeError,
    PowerLimitStateMachine,
    ProfileRangeError,
    Profiling,
    Ready,
    SetPowerLimit,
    State,
    Warmup,
    window_name,
)
from coordinator.power_limit.profile import load_profile, save_profile
from coordinator.power_limit.search import (
    Adaptive,
    Exhaustive,
    Probe,
    Search,
    SearchStrategy,
    WindowResult,
    aggregate,
)
from coordinator.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
    zeus_cost,
)
from zeus_agent.models import PowerLimitMeasurement

__all__ = [
    "MAX_POWER_LIMITS",
    "Adaptive",
    "BeginWindow",
    "Done",
    "Effect",
    "EndWindow",
    "Energy",
    "Exhaustive",
    "InvalidTransitionError",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitError",
    "PowerLimitMeasurement",
    "PowerLimitRangeError",
    "PowerLimitStateMachine",
    "Probe",
    "ProfileRangeError",
    "Profiling",
    "Ready",
    "Search",
    "SearchStrategy",
    "SetPowerLimit",
    "State",
    "Time",
    "Warmup",
    "WindowResult",
    "ZeusCost",
    "aggregate",
    "load_profile",
    "save_profile",
    "window_name",
    "zeus_cost",
]
