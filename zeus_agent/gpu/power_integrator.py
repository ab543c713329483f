"""Energy from polled power samples, for GPUs without a hardware energy counter.

* `PowerIntegrator`: accumulates energy (J) from (time, power) samples with the trapezoid rule.

Pure: no clock reads, no I/O. The caller passes each sample's timestamp (monotonic nanoseconds);
the NVML backend passes `time.monotonic_ns()` for GPUs older than Volta. The result is only as
good as the sampling: the trapezoid rule assumes power changes linearly between two samples, so a
spike shorter than the poll interval is smeared or missed. The agent polls at its sampling rate.
"""

from __future__ import annotations

_NS_PER_S = 1_000_000_000


class PowerIntegrator:
    """Trapezoid-rule integrator of power (W) over time (ns) into energy (J).

    The first sample only anchors the trace (energy stays 0 J); every later sample adds
    `(t - t_prev) * (p + p_prev) / 2`.

    Attributes:
        energy_j: Energy accumulated since the first sample. Units: J.
        samples: Number of samples added.
    """

    def __init__(self) -> None:
        self.energy_j: float = 0.0
        self.samples: int = 0
        self._last_t_ns: int | None = None
        self._last_power_w: float = 0.0

    def add(self, t_ns: int, power_w: float) -> float:
        """Add one power sample and return the accumulated energy.

        Args:
            t_ns: Timestamp of the sample, from a monotonic clock. Units: ns.
            power_w: Power at `t_ns`. Units: W.

        Returns:
            Energy accumulated from the first sample to `t_ns`. Units: J.

        Raises:
            ValueError: If `t_ns` is earlier than the previous sample or `power_w` is negative.
        """
        if power_w < 0:
            raise ValueError(f"power_w must be non-negative, got {power_w}.")
        if self._last_t_ns is not None:
            if t_ns < self._last_t_ns:
                raise ValueError(
                    f"Samples must be in time order: t_ns={t_ns} is before the previous "
                    f"sample at {self._last_t_ns}. Pass a monotonic clock."
                )
            dt_s = (t_ns - self._last_t_ns) / _NS_PER_S
            self.energy_j += dt_s * (power_w + self._last_power_w) / 2.0
        self._last_t_ns = t_ns
        self._last_power_w = power_w
        self.samples += 1
        return self.energy_j

    def reset(self) -> None:
        """Forget all samples and set the energy back to 0 J."""
        self.energy_j = 0.0
        self.samples = 0
        self._last_t_ns = None
        self._last_power_w = 0.0
