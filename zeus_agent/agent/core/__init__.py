"""Pure, synchronous cores of the per-GPU agent (no asyncio, NATS, NVML or clock reads).

* `energy_ring`: `EnergyRing`, the ring of cumulative-energy samples answering "energy between
  t0 and t1" by interpolation; `WindowOutOfRange`.
* `counter_phase`: `ReadPolicy`, when to read the energy counter (once after each of its
  updates, clear of due setting changes) and the update instant each value belongs to (`Knot`).
* `leases`: `LeaseTable` and `Lease`, the failsafe leases under which every non-default GPU
  setting is held.
* `limit_history`: `LimitHistory`, a GPU's recent power-limit changes by time (which limit a
  step mark is stamped with).
* `schedule`: `ScheduleCursor` and `ScheduleStep`, the execution of a rank's frequency schedule.
* `boundaries`: `BoundaryForecast`, when a rank's next clock changes are due (reads avoid them).
* `raise_ahead`: `RaiseAhead`, when to issue a clock raise so that it is in before its
  instruction begins.
* `meter`: `RankMeter` (steps, epochs, instructions -> `Interval`s and `Gap`s) and
  `WindowStack` (nested profiling windows).
* `throttle`: `Throttle`, which reports a flood of like events (schedule mismatches) as a few,
  each with the number held back before it.
"""

from zeus_agent.agent.core.energy_ring import (
    DEFAULT_MAX_EXTRAPOLATION_NS,
    EnergyRing,
    WindowOutOfRange,
)
from zeus_agent.agent.core.leases import (
    LEASE_KINDS,
    MAX_TTL_S,
    Lease,
    LeaseKind,
    LeaseTable,
    check_ttl,
)
from zeus_agent.agent.core.limit_history import LimitHistory
from zeus_agent.agent.core.meter import (
    Gap,
    GapReason,
    Interval,
    IntervalKind,
    MeterRecord,
    RankMeter,
    WindowStack,
)
from zeus_agent.agent.core.schedule import ScheduleCursor, ScheduleStep
from zeus_agent.agent.core.throttle import Throttle

__all__ = [
    "DEFAULT_MAX_EXTRAPOLATION_NS",
    "LEASE_KINDS",
    "MAX_TTL_S",
    "EnergyRing",
    "Gap",
    "GapReason",
    "Interval",
    "IntervalKind",
    "Lease",
    "LeaseKind",
    "LeaseTable",
    "LimitHistory",
    "MeterRecord",
    "RankMeter",
    "ScheduleCursor",
    "ScheduleStep",
    "Throttle",
    "WindowOutOfRange",
    "WindowStack",
    "check_ttl",
]
