"""The power-limit core: Zeus's optimum selectors and JIT profiler as a pure state machine.

* `selectors`: `OptimumSelector`, `Energy`, `Time`, `ZeusCost`, `MaxSlowdownConstraint`.
* `machine`: `PowerLimitStateMachine` and its transition table (`TRANSITIONS`), re-exporting
  its states (`Ready`, `Warmup`, `Profiling`, `Done`) and effects (`SetPowerLimit`,
  `BeginWindow`, `EndWindow`) from `states`, and its errors from `errors`.
* `search`: search strategies (`Exhaustive`, the default; `Adaptive`, faster).

`PowerLimitMeasurement` is `zeus_agent.models.PowerLimitMeasurement`, re-exported; profile files
in Zeus's JSON format are read and written by `zeus_agent.models` (`load_power_limit_profile`,
`save_power_limit_profile`), where the trainer's drop-in uses them too.
"""

from coordinator.power_limit.machine import (
    MAX_POWER_LIMITS,
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    InvalidTransitionError,
    NothingMeasuredError,
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
    "NothingMeasuredError",
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
    "window_name",
    "zeus_cost",
]
