"""The physical model of the simulated GPU: pure functions of hardware, workload and settings.

Pieces:

* `HardwareParams`: one GPU model (power-limit range, clock tables, idle power and the
  voltage/frequency/power curve).
* `WorkloadParams`: one training step (clock-sensitive compute, clock-insensitive memory work,
  a clock-independent floor the GPU work overlaps, activity factors).
* `OperatingPoint`: where a workload settles under a power limit and clock locks (clock, step
  time, average power, energy per step).
* `dynamic_shape`, `busy_power_w`, `waiting_power_w`, `gpu_time_s`, `step_time_s`: the model's
  equations, one function each.
* `throttle_clock_mhz`: the clock the power limit allows; `point_at_clock` and
  `operating_point`: the whole step at a clock or under a power limit.
* `NoiseModel`: per-step jitter, rare host stalls and GPU-to-GPU energy spread, driven by a
  caller-supplied `random.Random` so runs are reproducible; `NoiseModel.off()` disables it.

The module is pure: no clock reads, no I/O, deterministic given its arguments (docs/simulator.md
states the equations).

Model summary, with ``x = f / f_max`` the SM clock as a fraction of the highest clock:

* Dynamic power shape ``d(x) = x * max(x, x_v)**(alpha - 1)``: linear below the voltage floor
  ``x_v`` (voltage pinned at its minimum), ``~x**alpha`` above it; ``d(1) = 1``.
* Busy power ``P_busy(f) = P_static + a * P_dyn * d(x)``.
* GPU time per step ``t_gpu(f) = t_compute / x + t_memory``.
* Step time ``T = (t_gpu**p + t_floor**p)**(1/p)``: ``p = 1`` serialises GPU work and the floor,
  ``p -> inf`` overlaps them perfectly (``T = max``).
* While the step waits for the floor the GPU draws
  ``P_wait(f) = P_idle + w * (P_busy(f) - P_idle)``.
* Energy per step ``E = P_busy * t_gpu + P_wait * (T - t_gpu)``.
* A power limit ``L`` selects the highest supported clock with ``P_busy(f) <= L``, but never below
  the throttle floor clock: there a low limit is not held.
* Clock locks bound the clock from above; the power limit still throttles below a locked clock
  (as the software power cap does on real GPUs: the A40 pipeline profiles in `data/perseus/`
  run no faster at a locked 1740 MHz than at ~1450 MHz under the 300 W limit).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

__all__ = [
    "HardwareParams",
    "NoiseModel",
    "OperatingPoint",
    "WorkloadParams",
    "busy_power_w",
    "dynamic_shape",
    "gpu_time_s",
    "operating_point",
    "point_at_clock",
    "step_time_s",
    "throttle_clock_mhz",
    "waiting_power_w",
]


@dataclass(frozen=True, slots=True)
class HardwareParams:
    """One GPU model.

    Attributes:
        name: Marketing name, e.g. "NVIDIA A40".
        architecture: Lower-case architecture name, e.g. "ampere".
        min_power_limit_w: Lowest settable power limit (W).
        max_power_limit_w: Highest settable power limit (W).
        default_power_limit_w: Power limit after reset (W).
        idle_power_w: Power drawn with no work at all (W).
        supported_sm_clocks_mhz: Supported SM clocks, highest first (MHz).
        supported_memory_clocks_mhz: Supported memory clocks, highest first (MHz).
        static_power_w: Clock-independent part of the power while running kernels: leakage,
            memory and uncore (W).
        dynamic_power_w: Clock-dependent power at the highest SM clock for activity 1 (W).
        voltage_floor_clock_mhz: Clock below which the voltage is at its minimum, so dynamic
            power falls only linearly with clock (MHz).
        voltage_exponent: Exponent of dynamic power versus clock above the voltage floor
            (dimensionless, ~2-2.5).
        throttle_floor_clock_mhz: Lowest clock the power-limit controller throttles to; a limit
            that needs a lower clock is not held (MHz).
        energy_update_ms: Period at which the energy counter advances: it shows the energy
            accrued up to the last update instant (ms; ~100 on recent GPUs, 0 for a continuous
            counter). The simulated device's default (`SimGPU.create`).
    """

    name: str
    architecture: str
    min_power_limit_w: int
    max_power_limit_w: int
    default_power_limit_w: int
    idle_power_w: float
    supported_sm_clocks_mhz: tuple[int, ...]
    supported_memory_clocks_mhz: tuple[int, ...]
    static_power_w: float
    dynamic_power_w: float
    voltage_floor_clock_mhz: float
    voltage_exponent: float
    throttle_floor_clock_mhz: float
    energy_update_ms: float = 100.0

    def __post_init__(self) -> None:
        """Check that the parameters describe a possible GPU.

        Raises:
            ValueError: When a range is empty, a table is unsorted or a curve parameter is
                non-positive.
        """
        if not self.min_power_limit_w <= self.default_power_limit_w <= self.max_power_limit_w:
            raise ValueError(
                f"{self.name}: power limits must satisfy min <= default <= max, got "
                f"{self.min_power_limit_w}, {self.default_power_limit_w}, {self.max_power_limit_w}"
            )
        for label, table in (
            ("supported_sm_clocks_mhz", self.supported_sm_clocks_mhz),
            ("supported_memory_clocks_mhz", self.supported_memory_clocks_mhz),
        ):
            if not table or list(table) != sorted(set(table), reverse=True):
                raise ValueError(f"{self.name}: {label} must be non-empty, unique, highest first")
        if min(self.dynamic_power_w, self.voltage_floor_clock_mhz, self.voltage_exponent) <= 0:
            raise ValueError(f"{self.name}: curve parameters must be positive")
        if not self.energy_update_ms >= 0:
            raise ValueError(f"{self.name}: energy_update_ms must be >= 0")

    @property
    def max_sm_clock_mhz(self) -> int:
        """Highest supported SM clock (MHz)."""
        return self.supported_sm_clocks_mhz[0]

    @property
    def min_sm_clock_mhz(self) -> int:
        """Lowest supported SM clock (MHz)."""
        return self.supported_sm_clocks_mhz[-1]


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """One training step (or any repeated unit of GPU work).

    Attributes:
        compute_s: Clock-sensitive GPU time per step at the highest SM clock; scales as
            ``f_max / f`` (s).
        memory_s: Clock-insensitive GPU time per step (memory-bound kernels) (s).
        floor_s: Clock-independent time per step outside the GPU's control (input pipeline,
            communication) that GPU work may overlap (s). 0 for none.
        overlap_exponent: How GPU work and the floor combine, ``T = (t_gpu**p + floor**p)**(1/p)``:
            1 runs them one after the other, large values overlap them fully (dimensionless,
            >= 1).
        activity: Fraction of the GPU's dynamic power the kernels draw (dimensionless, ~0.2-1.2).
        wait_activity: While waiting for the floor, the fraction of the busy power above idle
            the GPU keeps drawing (dimensionless, 0-1).
        description: Free text: where the parameters come from.
    """

    compute_s: float
    memory_s: float = 0.0
    floor_s: float = 0.0
    overlap_exponent: float = 8.0
    activity: float = 1.0
    wait_activity: float = 0.3
    description: str = ""

    def __post_init__(self) -> None:
        """Check the ranges of the parameters.

        Raises:
            ValueError: When a time is negative, the GPU does no work, or a factor is out of
                range.
        """
        if min(self.compute_s, self.memory_s, self.floor_s) < 0:
            raise ValueError("workload times must be >= 0 s")
        if self.compute_s + self.memory_s <= 0:
            raise ValueError("a workload must have compute_s + memory_s > 0 s")
        if self.overlap_exponent < 1:
            raise ValueError(f"overlap_exponent must be >= 1, got {self.overlap_exponent}")
        if self.activity <= 0 or not 0 <= self.wait_activity <= 1:
            raise ValueError("activity must be > 0 and wait_activity within [0, 1]")


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """Where one step settles.

    Attributes:
        sm_clock_mhz: SM clock the GPU runs at (MHz; a supported clock unless computed with
            ``quantize=False``).
        step_time_s: Wall time of one step (s).
        avg_power_w: Average power over the step, ``energy_j / step_time_s`` (W).
        energy_j: Energy of one step (J).
        gpu_time_s: Time the GPU runs kernels during the step (s).
        busy_power_w: Power while running kernels (W).
        wait_power_w: Power while waiting for the floor (W).
        limit_held: False when the busy power exceeds the power limit because the clock is at
            its floor.
    """

    sm_clock_mhz: float
    step_time_s: float
    avg_power_w: float
    energy_j: float
    gpu_time_s: float
    busy_power_w: float
    wait_power_w: float
    limit_held: bool = True


def dynamic_shape(hw: HardwareParams, clock_mhz: float) -> float:
    """Return the dynamic power at a clock relative to the highest clock.

    ``d(x) = x * max(x, x_v)**(alpha - 1)``, with ``x = f / f_max``.

    Args:
        hw: The GPU model.
        clock_mhz: SM clock (MHz).

    Returns:
        The relative dynamic power (1 at the highest clock).
    """
    x = clock_mhz / hw.max_sm_clock_mhz
    x_v = hw.voltage_floor_clock_mhz / hw.max_sm_clock_mhz
    return x * max(x, x_v) ** (hw.voltage_exponent - 1.0)


def busy_power_w(hw: HardwareParams, wl: WorkloadParams, clock_mhz: float) -> float:
    """Return the power while the workload's kernels run at a clock.

    Args:
        hw: The GPU model.
        wl: The workload.
        clock_mhz: SM clock (MHz).

    Returns:
        ``P_static + activity * P_dyn * d(x)`` (W).
    """
    return hw.static_power_w + wl.activity * hw.dynamic_power_w * dynamic_shape(hw, clock_mhz)


def waiting_power_w(hw: HardwareParams, wl: WorkloadParams, clock_mhz: float) -> float:
    """Return the power while the step waits for its clock-independent floor.

    Args:
        hw: The GPU model.
        wl: The workload.
        clock_mhz: SM clock (MHz).

    Returns:
        ``P_idle + wait_activity * (P_busy - P_idle)`` (W).
    """
    busy = busy_power_w(hw, wl, clock_mhz)
    return hw.idle_power_w + wl.wait_activity * max(busy - hw.idle_power_w, 0.0)


def gpu_time_s(hw: HardwareParams, wl: WorkloadParams, clock_mhz: float) -> float:
    """Return the GPU's kernel time per step at a clock.

    Args:
        hw: The GPU model.
        wl: The workload.
        clock_mhz: SM clock (MHz), > 0.

    Returns:
        ``compute_s * f_max / f + memory_s`` (s).
    """
    return wl.compute_s * hw.max_sm_clock_mhz / clock_mhz + wl.memory_s


def step_time_s(wl: WorkloadParams, gpu_s: float) -> float:
    """Combine GPU time with the workload's floor into the step time.

    Args:
        wl: The workload.
        gpu_s: GPU kernel time per step (s).

    Returns:
        ``(gpu_s**p + floor_s**p)**(1/p)`` (s), never below ``gpu_s``.
    """
    if wl.floor_s <= 0:
        return gpu_s
    big = max(gpu_s, wl.floor_s)
    p = wl.overlap_exponent
    # Scaled to avoid overflow for large exponents.
    return big * ((gpu_s / big) ** p + (wl.floor_s / big) ** p) ** (1.0 / p)


def _clock_range(hw: HardwareParams, max_sm_clock_mhz: float | None) -> tuple[float, float]:
    """Return the (floor, ceiling) the clock may take under throttling and locks (MHz).

    The floor is the power-limit controller's (a locked minimum does not raise it: the power
    cap wins over clock locks); the ceiling is the highest clock or the locked maximum.
    """
    ceiling = float(hw.max_sm_clock_mhz)
    if max_sm_clock_mhz is not None:
        ceiling = min(ceiling, float(max_sm_clock_mhz))
    floor = max(hw.throttle_floor_clock_mhz, float(hw.min_sm_clock_mhz))
    return min(floor, ceiling), ceiling


def _solve_clock_mhz(hw: HardwareParams, wl: WorkloadParams, power_limit_w: float) -> float:
    """Return the (continuous) clock at which the busy power equals the limit (MHz, may be 0)."""
    budget = (power_limit_w - hw.static_power_w) / (wl.activity * hw.dynamic_power_w)
    if budget <= 0:
        return 0.0
    f_max = hw.max_sm_clock_mhz
    x_v = hw.voltage_floor_clock_mhz / f_max
    k = hw.voltage_exponent - 1.0
    # Below the voltage floor d(x) = x * x_v**k; above it d(x) = x**(1+k).
    x = budget / x_v**k if budget <= x_v ** (1.0 + k) else budget ** (1.0 / (1.0 + k))
    return x * f_max


def throttle_clock_mhz(
    hw: HardwareParams,
    wl: WorkloadParams,
    power_limit_w: float,
    max_sm_clock_mhz: float | None = None,
    min_sm_clock_mhz: float | None = None,
    *,
    quantize: bool = True,
) -> float:
    """Return the SM clock a power limit and clock locks allow.

    The highest clock whose busy power fits under the limit, clamped into the clock range: at
    most the highest (or locked maximum) clock, at least the throttle floor clock (or the
    ceiling, when that is lower). Clock locks do not override the power limit, as on real GPUs
    (the software power cap throttles below locked clocks): a lock of both ends at one clock
    runs at that clock only while its busy power fits under the limit, and a locked minimum
    never raises the clock above what the limit allows (the model always runs the highest
    allowed clock, so the locked minimum has no effect).

    Args:
        hw: The GPU model.
        wl: The workload.
        power_limit_w: Power limit (W).
        max_sm_clock_mhz: Locked maximum SM clock, or None (MHz).
        min_sm_clock_mhz: Locked minimum SM clock, or None (MHz); accepted for symmetry with
            the device's locks, without effect (see above).
        quantize: Round down to a supported clock (True) or return the continuous solution
            (False, used by the calibration fit to keep the objective smooth).

    Returns:
        The SM clock (MHz).
    """
    del min_sm_clock_mhz  # the power cap wins over a locked minimum
    floor, ceiling = _clock_range(hw, max_sm_clock_mhz)
    clock = min(max(_solve_clock_mhz(hw, wl, power_limit_w), floor), ceiling)
    if not quantize:
        return clock
    fitting = [c for c in hw.supported_sm_clocks_mhz if c <= clock + 1e-9]
    if fitting:
        return float(fitting[0])
    return float(hw.min_sm_clock_mhz)


def point_at_clock(
    hw: HardwareParams, wl: WorkloadParams, clock_mhz: float, power_limit_w: float | None = None
) -> OperatingPoint:
    """Return the step at a given SM clock.

    Args:
        hw: The GPU model.
        wl: The workload.
        clock_mhz: SM clock (MHz), > 0.
        power_limit_w: The power limit in force, only to report `limit_held`, or None (W).

    Returns:
        The operating point.
    """
    gpu_s = gpu_time_s(hw, wl, clock_mhz)
    step_s = step_time_s(wl, gpu_s)
    p_busy = busy_power_w(hw, wl, clock_mhz)
    p_wait = waiting_power_w(hw, wl, clock_mhz)
    energy = p_busy * gpu_s + p_wait * (step_s - gpu_s)
    held = power_limit_w is None or p_busy <= power_limit_w + 1e-9
    return OperatingPoint(
        sm_clock_mhz=clock_mhz,
        step_time_s=step_s,
        avg_power_w=energy / step_s,
        energy_j=energy,
        gpu_time_s=gpu_s,
        busy_power_w=p_busy,
        wait_power_w=p_wait,
        limit_held=held,
    )


def operating_point(
    hw: HardwareParams,
    wl: WorkloadParams,
    power_limit_w: float,
    max_sm_clock_mhz: float | None = None,
    min_sm_clock_mhz: float | None = None,
    *,
    quantize: bool = True,
) -> OperatingPoint:
    """Return where a workload settles under a power limit and optional clock locks.

    Args:
        hw: The GPU model.
        wl: The workload.
        power_limit_w: Power limit (W).
        max_sm_clock_mhz: Locked maximum SM clock, or None (MHz).
        min_sm_clock_mhz: Locked minimum SM clock, or None (MHz).
        quantize: Use supported clocks only (see `throttle_clock_mhz`).

    Returns:
        The operating point: clock, step time, average power and energy per step.
    """
    clock = throttle_clock_mhz(
        hw, wl, power_limit_w, max_sm_clock_mhz, min_sm_clock_mhz, quantize=quantize
    )
    return point_at_clock(hw, wl, clock, power_limit_w)


@dataclass(frozen=True, slots=True)
class NoiseModel:
    """Measurement noise as seen in the reference profiles.

    Attributes:
        jitter_rel: Standard deviation of the per-step (per-window) time factor; energy scales
            with it (dimensionless, ~0.015).
        stall_probability: Probability that a step suffers a host-side stall (0-1).
        stall_min_rel: Smallest stall, as a fraction of the step time (dimensionless).
        stall_max_rel: Largest stall, as a fraction of the step time (dimensionless).
        gpu_spread_rel: Standard deviation of the per-GPU energy factor, drawn once per device
            (dimensionless, ~0.03).
    """

    jitter_rel: float = 0.015
    stall_probability: float = 0.03
    stall_min_rel: float = 0.05
    stall_max_rel: float = 0.10
    gpu_spread_rel: float = 0.03

    @classmethod
    def off(cls) -> NoiseModel:
        """Return a noise model that changes nothing."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0)

    @property
    def enabled(self) -> bool:
        """Whether this model perturbs anything."""
        return any(v > 0 for v in (self.jitter_rel, self.stall_probability, self.gpu_spread_rel))

    def device_energy_factor(self, rng: random.Random) -> float:
        """Draw one GPU's energy factor (GPU-to-GPU spread), clamped to +-3 sigma.

        Args:
            rng: Source of randomness.

        Returns:
            A factor near 1 (dimensionless).
        """
        if self.gpu_spread_rel <= 0:
            return 1.0
        z = max(-3.0, min(3.0, rng.gauss(0.0, 1.0)))
        return 1.0 + self.gpu_spread_rel * z

    def perturb(
        self, point: OperatingPoint, rng: random.Random, energy_factor: float = 1.0
    ) -> OperatingPoint:
        """Return one noisy realisation of a step.

        The step time is multiplied by ``1 + jitter`` (energy too: same average power); a stall,
        when drawn, adds time during which the GPU draws its waiting power.

        Args:
            point: The noiseless step.
            rng: Source of randomness (a seeded `random.Random` for reproducible runs).
            energy_factor: This GPU's energy factor (`device_energy_factor`).

        Returns:
            The perturbed operating point (same clock and powers).
        """
        factor = 1.0
        if self.jitter_rel > 0:
            factor += self.jitter_rel * max(-3.0, min(3.0, rng.gauss(0.0, 1.0)))
        stall_s = 0.0
        if self.stall_probability > 0 and rng.random() < self.stall_probability:
            stall_s = point.step_time_s * rng.uniform(self.stall_min_rel, self.stall_max_rel)
        step_s = point.step_time_s * factor + stall_s
        energy = (point.energy_j * factor + point.wait_power_w * stall_s) * energy_factor
        if math.isclose(step_s, point.step_time_s) and math.isclose(
            energy, point.energy_j, rel_tol=1e-12
        ):
            return point
        return replace(point, step_time_s=step_s, energy_j=energy, avg_power_w=energy / step_s)
