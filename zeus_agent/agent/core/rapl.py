"""RAPL energy arithmetic: counters that wrap, per-package cumulative energy, window answers.

The node's agent reads RAPL's `energy_uj` counters (each CPU package's, and its DRAM domain's
where there is one) from sysfs (`zeus_agent.agent.rapl`); turning those readings into the
energy of a window is done here, without reading anything.

Pieces:

* `wrapped_delta(last_uj, raw_uj, max_range_uj)`: the energy counted between two readings.
* `WrapCounter`: one `energy_uj` counter made cumulative (µJ since its first reading).
* `RaplDomain`: a `WrapCounter` and an `EnergyRing` of its cumulative energy (J) at each
  reading; answers "energy between t0 and t1", optionally with a fresh reading that is not
  kept (it brackets a window's end that the last reading kept does not reach).
* `RaplPackage`: one package, which Zeus 0.16 calls a CPU index (`intel-rapl:<index>`): its
  package domain and its DRAM domain, or None where the package has none.
* `answer_window(packages, wanted, t0_ns, t1_ns, fresh)`: a window's `CpuWindow`, the CPU and
  DRAM energy of each package asked for, as Zeus's `Measurement.cpu_energy`/`dram_energy`.
* `max_safe_power_w(max_range_uj, period_s)`: the power above which a counter read every
  `period_s` could wrap twice between two readings (and lose one wrap's energy).

Invariants:

1. Wrap-around as Zeus 0.16 handles it: a reading below the previous one is one wrap (the
   counter reached `max_energy_range_uj` and started again from 0), so the energy between them
   is `raw + max_range - last`. The hardware counter's period is one energy unit (15-61 µJ)
   more than `max_energy_range_uj`; that error is ignored, as Zeus ignores it. Two wraps
   between two readings cannot be told from one: the agent reads far more often than that
   (`max_safe_power_w`).
2. A reading that is not an integer in [0, max_range] is none of the counter's values: it is
   ignored and counted (`WrapCounter.invalid`), never taken as a wrap.
3. A domain's cumulative energy never decreases, so no window's energy is negative.
4. A fresh reading (`RaplDomain.energy_between(..., fresh=...)`) is arithmetic only: it changes
   no counter and no ring, so answering a window never alters what later windows see.

Times are monotonic nanoseconds of the agent's host; no clock is read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zeus_agent.agent.core.energy_ring import EnergyRing, WindowOutOfRange

__all__ = [
    "CpuWindow",
    "PackageReading",
    "RaplDomain",
    "RaplPackage",
    "WrapCounter",
    "answer_window",
    "max_safe_power_w",
    "wrapped_delta",
]

UJ_PER_J = 1_000_000


def wrapped_delta(last_uj: int, raw_uj: int, max_range_uj: int) -> int:
    """Energy counted between two readings of one counter (µJ), across at most one wrap.

    Args:
        last_uj: The earlier reading.
        raw_uj: The later reading.
        max_range_uj: The counter's `max_energy_range_uj`.
    """
    if raw_uj >= last_uj:
        return raw_uj - last_uj
    return raw_uj + max_range_uj - last_uj


def max_safe_power_w(max_range_uj: int, period_s: float) -> float:
    """The power (W) above which a counter read every `period_s` may wrap twice unseen."""
    return max_range_uj / UJ_PER_J / period_s


class WrapCounter:
    """One RAPL `energy_uj` counter made cumulative: µJ counted since its first reading.

    Attributes:
        max_range_uj: The counter's `max_energy_range_uj` (it wraps after this value).
        total_uj: Energy counted since the first reading (µJ); 0 before the second.
        wraps: Readings found below the previous one (each one wrap).
        invalid: Readings ignored because they are not in [0, max_range_uj].
        last_raw_uj: The newest reading taken, or None before the first.
    """

    __slots__ = ("invalid", "last_raw_uj", "max_range_uj", "total_uj", "wraps")

    def __init__(self, max_range_uj: int) -> None:
        """Create a counter that wraps after `max_range_uj` (> 0).

        Raises:
            ValueError: `max_range_uj` is not a positive integer.
        """
        if isinstance(max_range_uj, bool) or not isinstance(max_range_uj, int) or (
                max_range_uj <= 0):
            raise ValueError(f"max_range_uj must be a positive integer, got {max_range_uj!r}")
        self.max_range_uj = max_range_uj
        self.total_uj = 0
        self.wraps = 0
        self.invalid = 0
        self.last_raw_uj: int | None = None

    def valid(self, raw_uj: int) -> bool:
        """Whether `raw_uj` is one of the counter's values."""
        return (not isinstance(raw_uj, bool) and isinstance(raw_uj, int)
                and 0 <= raw_uj <= self.max_range_uj)

    def add(self, raw_uj: int) -> int | None:
        """Take one reading; return the cumulative energy (µJ), or None if it was ignored."""
        if not self.valid(raw_uj):
            self.invalid += 1
            return None
        last = self.last_raw_uj
        if last is not None:
            if raw_uj < last:
                self.wraps += 1
            self.total_uj += wrapped_delta(last, raw_uj, self.max_range_uj)
        self.last_raw_uj = raw_uj
        return self.total_uj

    def peek(self, raw_uj: int) -> int | None:
        """The cumulative energy (µJ) `add(raw_uj)` would give, changing nothing.

        None when the reading is invalid or there is no earlier one to count from.
        """
        last = self.last_raw_uj
        if last is None or not self.valid(raw_uj):
            return None
        return self.total_uj + wrapped_delta(last, raw_uj, self.max_range_uj)


class RaplDomain:
    """One RAPL domain (a package, or its DRAM): counter and ring of cumulative energy (J).

    Attributes:
        counter: The domain's `WrapCounter`.
        ring: `(t_ns, cumulative J)` at each reading kept.
    """

    __slots__ = ("counter", "ring")

    def __init__(self, max_range_uj: int, capacity: int, max_extrapolation_ns: int) -> None:
        """Create an empty domain.

        Args:
            max_range_uj: The counter's `max_energy_range_uj`.
            capacity: Readings kept (the ring's capacity, >= 2).
            max_extrapolation_ns: How far past the newest reading a window's end may be
                extrapolated with the last observed power (ns).
        """
        self.counter = WrapCounter(max_range_uj)
        self.ring = EnergyRing(capacity, max_extrapolation_ns)

    @property
    def energy_j(self) -> float:
        """Energy counted since the first reading (J)."""
        return self.counter.total_uj / UJ_PER_J

    def record(self, t_ns: int, raw_uj: int) -> bool:
        """Take the reading `raw_uj` made at `t_ns`; False when it was ignored."""
        total = self.counter.add(raw_uj)
        if total is None:
            return False
        return self.ring.append(t_ns, total / UJ_PER_J)

    def energy_at(self, t_ns: int, fresh: tuple[int, int] | None = None) -> float:
        """Cumulative energy (J) at `t_ns`.

        Args:
            t_ns: The time (monotonic ns).
            fresh: `(t_ns, raw_uj)`, a reading newer than every reading kept, used (not kept)
                to interpolate a time past the newest kept one.

        Raises:
            WindowOutOfRange: `t_ns` cannot be answered (see `EnergyRing.energy_at`).
        """
        latest = self.ring.latest()
        if fresh is not None and latest is not None and latest[0] < t_ns <= fresh[0]:
            total = self.counter.peek(fresh[1])
            if total is not None:
                t_lo, e_lo = latest
                e_hi = max(e_lo, total / UJ_PER_J)
                return e_lo + (e_hi - e_lo) * (t_ns - t_lo) / (fresh[0] - t_lo)
        return self.ring.energy_at(t_ns)

    def energy_between(
        self, t0_ns: int, t1_ns: int, fresh: tuple[int, int] | None = None
    ) -> float:
        """Energy (J, never negative) between two stamps; `fresh` as in `energy_at`.

        Raises:
            ValueError: `t1_ns < t0_ns`.
            WindowOutOfRange: Either end cannot be answered.
        """
        if t1_ns < t0_ns:
            raise ValueError(f"Window end t1={t1_ns} ns is before its start t0={t0_ns} ns.")
        return max(0.0, self.energy_at(t1_ns, fresh) - self.energy_at(t0_ns, fresh))


@dataclass(frozen=True, slots=True)
class PackageReading:
    """One reading of a package's counters at `t_ns` (None: that counter was not read)."""

    t_ns: int
    cpu_uj: int | None
    dram_uj: int | None = None


class RaplPackage:
    """One CPU package (Zeus's CPU index): its package domain and DRAM domain (or None).

    Attributes:
        index: The package's index (`intel-rapl:<index>`).
        cpu: The package domain.
        dram: The DRAM domain, or None where the package has none.
    """

    __slots__ = ("cpu", "dram", "index")

    def __init__(
        self,
        index: int,
        cpu_range_uj: int,
        dram_range_uj: int | None,
        capacity: int,
        max_extrapolation_ns: int,
    ) -> None:
        self.index = index
        self.cpu = RaplDomain(cpu_range_uj, capacity, max_extrapolation_ns)
        self.dram = (None if dram_range_uj is None
                     else RaplDomain(dram_range_uj, capacity, max_extrapolation_ns))

    def record(self, reading: PackageReading) -> None:
        """Take one reading of the package's counters (a counter not read is skipped)."""
        if reading.cpu_uj is not None:
            self.cpu.record(reading.t_ns, reading.cpu_uj)
        if self.dram is not None and reading.dram_uj is not None:
            self.dram.record(reading.t_ns, reading.dram_uj)


@dataclass(frozen=True)
class CpuWindow:
    """The CPU and DRAM energy of one window, per package (Zeus's CPU index).

    Attributes:
        cpus: The packages answered, in the order asked (every package: ascending).
        cpu_j: Each package's energy (J).
        dram_j: Each package's DRAM energy (J); None where it has no DRAM domain or the
            window could not be answered for it.
        problem: Why a package asked for is missing, or a DRAM energy None although the
            package has a DRAM domain ("" when nothing is).
    """

    cpus: tuple[int, ...] = ()
    cpu_j: tuple[float, ...] = ()
    dram_j: tuple[float | None, ...] = ()
    problem: str = ""

    def as_dicts(self) -> tuple[dict[int, float] | None, dict[int, float] | None]:
        """`(cpu_energy, dram_energy)` as Zeus 0.16's `Measurement` holds them.

        Each maps a CPU index to J; None when empty (no package, or no DRAM domain).
        """
        cpu = dict(zip(self.cpus, self.cpu_j, strict=True))
        dram = {i: e for i, e in zip(self.cpus, self.dram_j, strict=True) if e is not None}
        return cpu or None, dram or None


def answer_window(
    packages: Mapping[int, RaplPackage],
    wanted: Sequence[int] | None,
    t0_ns: int,
    t1_ns: int,
    fresh: Mapping[int, PackageReading] | None = None,
) -> CpuWindow:
    """The CPU and DRAM energy between two stamps of the packages asked for.

    Args:
        packages: The node's packages by index.
        wanted: Package indices (Zeus's `cpu_indices`); None: every package.
        t0_ns: Start of the window (monotonic ns).
        t1_ns: End of the window, `>= t0_ns`.
        fresh: Readings newer than every kept one, by package (see `RaplDomain.energy_at`).

    Returns:
        What could be answered; a package that is not on the node, or whose ring cannot
        answer the window, is left out and `problem` says why.

    Raises:
        ValueError: `t1_ns < t0_ns`.
    """
    if t1_ns < t0_ns:
        raise ValueError(f"Window end t1={t1_ns} ns is before its start t0={t0_ns} ns.")
    order = sorted(packages) if wanted is None else list(wanted)
    fresh = fresh or {}
    cpus: list[int] = []
    cpu_j: list[float] = []
    dram_j: list[float | None] = []
    problems: list[str] = []
    missing = [i for i in order if i not in packages]
    if missing:
        problems.append(f"CPU indices {missing} are not on this node (its RAPL packages: "
                        f"{sorted(packages)})")
    for index in order:
        package = packages.get(index)
        if package is None:
            continue
        reading = fresh.get(index)
        cpu_fresh = dram_fresh = None
        if reading is not None:
            if reading.cpu_uj is not None:
                cpu_fresh = (reading.t_ns, reading.cpu_uj)
            if reading.dram_uj is not None:
                dram_fresh = (reading.t_ns, reading.dram_uj)
        try:
            cpu = package.cpu.energy_between(t0_ns, t1_ns, cpu_fresh)
        except WindowOutOfRange as e:
            problems.append(f"CPU {index}: {e}")
            continue
        dram: float | None = None
        if package.dram is not None:
            try:
                dram = package.dram.energy_between(t0_ns, t1_ns, dram_fresh)
            except WindowOutOfRange as e:
                problems.append(f"DRAM of CPU {index}: {e}")
        cpus.append(index)
        cpu_j.append(cpu)
        dram_j.append(dram)
    return CpuWindow(tuple(cpus), tuple(cpu_j), tuple(dram_j), "; ".join(problems))
