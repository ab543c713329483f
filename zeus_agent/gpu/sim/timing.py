"""What NVML calls cost on a real GPU, as a pure model the simulated GPU charges.

A real GPU does not answer NVML calls in microseconds (recorded on an H200,
`data/real-gpu/h200/`): an energy-counter read costs ~3 ms (p99 24 ms under load), the driver
serialises it with power-limit reads and (presumably) setters, and the counter changes only
every ~100 ms. A simulator whose calls were free would hide an agent that queues clock changes
behind counter reads; charging the same costs here makes that visible.

Pieces (pure and deterministic: no clock, no sleeping, no files; `zeus_agent.gpu.sim.device`
does the sleeping and holds the real per-GPU lock):

* `CallKind`: the NVML calls an agent makes, by cost class; `SERIALISED`: those the driver
  runs one at a time per GPU (the counter read, the power-limit read, setters).
* `QuantileTable`: a latency distribution as quantiles; `at(u)` maps a uniform draw to a cost.
* `NvmlTiming`: per-kind costs plus the counter's update jitter; `timing_preset("h200")`,
  `timing_preset("none")` (no cost: the untimed simulator). Ask it what a call costs:
  ``timing.quantile_s(CallKind.ENERGY, 0.99)``, ``timing.p99_s(...)``, ``timing.median_s(...)``.
* `CounterJitter`: when the energy counter updates: a 100 ms grid with a per-device phase and
  a per-update offset drawn from the recorded distribution by a hash of (device key, update
  number), so every process that opens the device agrees without sharing state.
* `DriverQueue`: the driver lock as a discrete-event model: given calls in issue order, when
  each starts and ends (a setter issued during a counter read starts when the read ends).
"""

from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from zeus_agent.gpu.sim import timing_h200

__all__ = [
    "DEFAULT_SET_LATENCY_MS",
    "SERIALISED",
    "TIMING_PRESETS",
    "CallKind",
    "CallSpan",
    "CounterJitter",
    "DriverQueue",
    "NvmlTiming",
    "QuantileTable",
    "counter_jitter",
    "timing_preset",
]

DEFAULT_SET_LATENCY_MS = 1.0
"""Cost of a setter (lock clocks, set a power limit) when none is given: setters could not be
timed on the read-only recording, so this is a parameter (ms)."""

TIMING_PRESETS = ("h200", "none")
"""Names `timing_preset` accepts: the recorded H200, and no cost at all."""


class CallKind(enum.StrEnum):
    """An NVML call an agent makes, by what it costs."""

    ENERGY = "energy"
    """nvmlDeviceGetTotalEnergyConsumption (~3 ms)."""
    POWER = "power"
    """nvmlDeviceGetPowerUsage (~1.6 us)."""
    POWER_INSTANT = "power_instant"
    """The POWER_INSTANT field through nvmlDeviceGetFieldValues (~5 us)."""
    POWER_LIMIT = "power_limit"
    """nvmlDeviceGetPowerManagementLimit (~146 us)."""
    SM_CLOCK = "sm_clock"
    """nvmlDeviceGetClockInfo(SM) (~1.3 us)."""
    MEM_CLOCK = "mem_clock"
    """nvmlDeviceGetClockInfo(MEM) (~1.3 us)."""
    TEMPERATURE = "temperature"
    """nvmlDeviceGetTemperature (~1.2 us)."""
    UTILIZATION = "utilization"
    """nvmlDeviceGetUtilizationRates (~1 us)."""
    OTHER = "other"
    """Any other cheap getter (persistence mode): costed as a clock read."""
    SET = "set"
    """Any setter: lock or reset clocks, set or reset the power limit, persistence mode."""


SERIALISED = frozenset({CallKind.ENERGY, CallKind.POWER_LIMIT, CallKind.SET})
"""Calls the driver runs one at a time per GPU. Recorded: beside a counter reader, a
power-limit read went from 146 us to 3.4 ms while the cheap getters stayed at ~2 us. Setters
could not be timed; a real cluster should expect them to wait too, so the model makes them."""


@dataclass(frozen=True, slots=True)
class QuantileTable:
    """A distribution as evenly spaced quantiles (0%, ..., 100%), linearly interpolated.

    Attributes:
        values_s: The quantiles, ascending (s).
    """

    values_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.values_s) < 2:
            raise ValueError("a quantile table needs at least the 0% and 100% quantiles")
        if any(b < a for a, b in zip(self.values_s, self.values_s[1:], strict=False)):
            raise ValueError("quantiles must be ascending")

    @classmethod
    def constant(cls, value_s: float) -> QuantileTable:
        """Every draw costs `value_s`."""
        return cls((value_s, value_s))

    @classmethod
    def from_us(cls, values_us: tuple[float, ...]) -> QuantileTable:
        """From quantiles in microseconds (the generated tables' unit)."""
        return cls(tuple(v / 1e6 for v in values_us))

    def at(self, q: float) -> float:
        """Return the `q`-quantile (s); `q` is clamped to [0, 1], so a uniform draw is a cost."""
        q = min(1.0, max(0.0, q))
        h = q * (len(self.values_s) - 1)
        lo = min(int(h), len(self.values_s) - 2)
        a, b = self.values_s[lo], self.values_s[lo + 1]
        return a + (b - a) * (h - lo)


def _unit(key: str, n: int, salt: str) -> float:
    """A uniform number in [0, 1) from (key, n): the same in every process, unlike `hash`."""
    digest = hashlib.blake2b(f"{salt}:{key}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True, slots=True)
class CounterJitter:
    """When a jittered energy counter updates.

    Update ``k`` of a device happens at ``phase + k * period + offset(k)``: a grid with a
    per-device phase (real GPUs are not in step) and a per-update offset drawn from `offsets`
    (scaled to the device's period, so a demo's 10 ms counter jitters a tenth as much).

    Attributes:
        name: Its name in device files (a `TIMING_PRESETS` name).
        period_ns: The period the offsets were recorded at (ns).
        offsets: Offset of an update from its grid instant (s; |offset| < period / 2).
    """

    name: str
    period_ns: int
    offsets: QuantileTable

    def __post_init__(self) -> None:
        worst = max(abs(self.offsets.values_s[0]), abs(self.offsets.values_s[-1]))
        if not worst * 1e9 < self.period_ns / 2:
            raise ValueError("counter offsets must stay within half a period")

    def phase_ns(self, key: str, period_ns: int) -> int:
        """The device's grid phase in [0, period) (ns)."""
        return int(_phase_unit(key) * period_ns)

    def offset_ns(self, key: str, update: int, period_ns: int) -> int:
        """Offset of update number `update` from its grid instant (ns)."""
        scale = period_ns / self.period_ns
        return round(self.offsets.at(_unit(key, update, "update")) * 1e9 * scale)

    def instant_ns(self, key: str, update: int, period_ns: int) -> int:
        """When update number `update` happens (ns on the device's clock)."""
        phase = self.phase_ns(key, period_ns)
        return phase + update * period_ns + self.offset_ns(key, update, period_ns)

    def last_update_ns(self, key: str, now_ns: int, period_ns: int) -> int:
        """The last update instant at or before `now_ns` (ns)."""
        phase = self.phase_ns(key, period_ns)
        k = (now_ns - phase) // period_ns
        for update in (k + 1, k):  # offsets are within half a period: k - 1 is always past
            instant = phase + update * period_ns + self.offset_ns(key, update, period_ns)
            if instant <= now_ns:
                return instant
        return phase + (k - 1) * period_ns + self.offset_ns(key, k - 1, period_ns)


@functools.lru_cache(maxsize=256)
def _phase_unit(key: str) -> float:
    """A device's phase as a fraction of its period (cached: it is asked at every read)."""
    return _unit(key, 0, "phase")


@dataclass(frozen=True, slots=True)
class NvmlTiming:
    """What each NVML call costs, and how the energy counter updates.

    Attributes:
        name: The preset's name ("h200", "none").
        latency: Cost distribution by kind; kinds absent cost nothing. `CallKind.SET` is
            taken from `set_latency_s` instead.
        set_latency_s: Cost of every setter (s): a constant, as none could be measured.
        counter: The counter's update jitter, or None for the exact grid
            ``floor(now / period) * period``.
    """

    name: str
    latency: Mapping[CallKind, QuantileTable] = field(default_factory=dict)
    set_latency_s: float = 0.0
    counter: CounterJitter | None = None

    def __post_init__(self) -> None:
        if not self.set_latency_s >= 0:
            raise ValueError(f"set latency must be >= 0 s, got {self.set_latency_s!r}")
        if any(t.values_s[0] < 0 for t in self.latency.values()):
            raise ValueError("a call cannot cost a negative time")

    @property
    def charges(self) -> bool:
        """Whether any call costs time (then the device is called like NVML, in a thread)."""
        return self.set_latency_s > 0 or any(t.values_s[-1] > 0 for t in self.latency.values())

    def quantile_s(self, kind: CallKind, q: float) -> float:
        """The `q`-quantile of a `kind` call's cost (s); with a uniform `q`, one draw."""
        if kind is CallKind.SET:
            return self.set_latency_s
        table = self.latency.get(kind)
        return 0.0 if table is None else table.at(q)

    def median_s(self, kind: CallKind) -> float:
        """The median cost of a `kind` call (s)."""
        return self.quantile_s(kind, 0.5)

    def p99_s(self, kind: CallKind) -> float:
        """The 99th-percentile cost of a `kind` call (s).

        E.g. how long before a clock change an agent should not start a counter read (24 ms
        for the energy counter on `h200`).
        """
        return self.quantile_s(kind, 0.99)

    @staticmethod
    def serialised(kind: CallKind) -> bool:
        """Whether `kind` holds the per-GPU driver lock (waits for, and delays, others)."""
        return kind in SERIALISED


def counter_jitter(name: str) -> CounterJitter | None:
    """The counter jitter a device file names ("" or "none": the exact grid).

    Raises:
        ValueError: For an unknown name.
    """
    if name in ("", "none"):
        return None
    if name == "h200":
        return _H200_COUNTER
    raise ValueError(f"unknown counter jitter {name!r}; choose one of {list(TIMING_PRESETS)}")


def timing_preset(name: str, set_latency_ms: float = DEFAULT_SET_LATENCY_MS) -> NvmlTiming:
    """A named timing model.

    Args:
        name: "h200" (the recorded H200) or "none" (no cost, the exact counter grid: today's
            simulator, for fast unit tests).
        set_latency_ms: Cost of a setter under "h200" (ms); "none" charges nothing.

    Raises:
        ValueError: For an unknown name or a negative setter cost.
    """
    if not set_latency_ms >= 0:
        raise ValueError(f"the setter latency must be >= 0 ms, got {set_latency_ms!r}")
    if name == "none":
        return _NONE
    if name == "h200":
        return NvmlTiming(
            "h200", _H200_LATENCY, set_latency_s=set_latency_ms / 1e3, counter=_H200_COUNTER
        )
    raise ValueError(
        f"unknown NVML timing model {name!r}; choose one of {list(TIMING_PRESETS)}"
    )


_H200_LATENCY: dict[CallKind, QuantileTable] = {
    CallKind(kind): QuantileTable.from_us(values)
    for kind, values in timing_h200.LATENCY_US.items()
}
_H200_LATENCY[CallKind.OTHER] = _H200_LATENCY[CallKind.SM_CLOCK]
_H200_COUNTER = CounterJitter(
    "h200",
    round(timing_h200.COUNTER_PERIOD_US * 1000),
    QuantileTable(tuple(v / 1e6 for v in timing_h200.COUNTER_OFFSET_US)),
)
_NONE = NvmlTiming("none")


@dataclass(frozen=True, slots=True)
class CallSpan:
    """One call through the driver: issued, started (after waiting for the lock), ended (ns)."""

    kind: CallKind
    issued_ns: int
    start_ns: int
    end_ns: int

    @property
    def wait_ns(self) -> int:
        """How long it waited for the call in flight (ns)."""
        return self.start_ns - self.issued_ns


class DriverQueue:
    """The per-GPU driver lock as a discrete-event model (for tests and replays).

    Serialised calls run one at a time in the order they are issued; the others run at once.
    """

    def __init__(self) -> None:
        self.free_ns = 0
        """When the call holding the lock ends (ns)."""
        self.spans: list[CallSpan] = []

    def call(self, kind: CallKind, issued_ns: int, cost_ns: int) -> CallSpan:
        """Issue a call at `issued_ns` costing `cost_ns`; return when it starts and ends.

        Raises:
            ValueError: When calls are issued out of time order or the cost is negative.
        """
        if cost_ns < 0:
            raise ValueError("a cost cannot be negative")
        if self.spans and issued_ns < self.spans[-1].issued_ns:
            raise ValueError("issue calls in time order")
        start = max(issued_ns, self.free_ns) if kind in SERIALISED else issued_ns
        span = CallSpan(kind, issued_ns, start, start + cost_ns)
        if kind in SERIALISED:
            self.free_ns = span.end_ns
        self.spans.append(span)
        return span

    def in_flight(self, at_ns: int) -> list[CallSpan]:
        """The calls running at `at_ns`, in issue order."""
        return [s for s in self.spans if s.start_ns <= at_ns < s.end_ns]
