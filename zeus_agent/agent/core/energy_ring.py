"""A fixed-size ring of one GPU's cumulative energy counter, answering "energy between t0 and t1".

Pieces:

* `EnergyRing`: the ring buffer. The agent appends `(t_ns, energy_j)` knots: one per counter
  update, placed at the update's instant by the read policy (`counter_phase`; a read that finds
  the value unchanged adds none); `energy_at`, `energy_between` and `power_between` answer by
  linear interpolation between the bracketing samples.
* `WindowOutOfRange`: a window reaches before the oldest sample kept, or further past the newest
  than the extrapolation horizon allows. A `ValueError` (and a `ZeusAgentError`).

Invariants (everything that affects the answers lives in this file):

1. Sample times are strictly increasing. A sample whose `t_ns` is not after the newest kept one
   (out of order or duplicate) is ignored and counted in `dropped_out_of_order`; a non-finite
   energy reading is ignored and counted in `dropped_invalid`. `append` never raises for either.
2. The stored series is monotone non-decreasing. A raw counter that goes backwards (driver reset,
   counter wrap) is handled by carrying an offset: from that sample on, stored = raw + offset,
   where the offset is chosen so the first sample after the reset stores the same value as the
   last one before it. The energy spent between those two samples is unknown and counted as zero
   (never over-counted); `counter_resets` counts these events. A stored value is also clamped to
   the previous one, so float rounding of `raw + offset` never makes the series dip.
3. At most `capacity` samples are kept; appending to a full ring overwrites the oldest. Storage is
   two preallocated arrays used circularly; lookups binary-search the logical index in
   O(log capacity) without copying.
4. `energy_at(t)` for `oldest <= t <= newest` interpolates linearly between the bracketing
   samples. For `newest < t <= newest + horizon` it extrapolates with the last observed power
   (the slope of the two newest samples: with the agent's knots, the average power of the last
   full update period, never a slope through an unchanged read); such answers are provisional,
   a later sample may revise them. Before the oldest sample, past the horizon, with an empty
   ring, or when an extrapolation needs a slope that one sample cannot give, it raises
   `WindowOutOfRange`.
5. Consequently `energy_between(a, b) + energy_between(b, c) == energy_between(a, c)` (up to
   float rounding) and `energy_between` is never negative.

No clock is read here: every time is an argument in monotonic nanoseconds of the agent's host.
"""

from __future__ import annotations

import math
from array import array

from zeus_agent.errors import ZeusAgentError

__all__ = ["DEFAULT_MAX_EXTRAPOLATION_NS", "EnergyRing", "WindowOutOfRange"]

DEFAULT_MAX_EXTRAPOLATION_NS = 1_000_000_000
"""How far past the newest sample `energy_at` extrapolates by default (1 s)."""


class WindowOutOfRange(ZeusAgentError, ValueError):
    """A requested time is outside what the ring can answer (code `out_of_range`).

    Attributes:
        t_ns: The requested time (monotonic ns).
        span_ns: `(oldest, newest)` sample times of the ring, or None when it is empty.
    """

    code = "out_of_range"

    def __init__(self, message: str, t_ns: int, span_ns: tuple[int, int] | None) -> None:
        super().__init__(message)
        self.t_ns = t_ns
        self.span_ns = span_ns


class EnergyRing:
    """Ring buffer of `(t_ns, energy_j)` samples of one GPU's cumulative energy counter.

    Attributes:
        capacity: Maximum number of samples kept.
        max_extrapolation_ns: Default horizon past the newest sample within which `energy_at`
            extrapolates with the last observed power (ns).
        dropped_out_of_order: Samples ignored because their time was not after the newest.
        dropped_invalid: Samples ignored because the energy was NaN or infinite.
        counter_resets: Times the raw counter went backwards and an offset was carried.
    """

    def __init__(
        self, capacity: int, max_extrapolation_ns: int = DEFAULT_MAX_EXTRAPOLATION_NS
    ) -> None:
        """Create an empty ring.

        Args:
            capacity: Maximum number of samples kept; at least 2 (interpolation needs two).
            max_extrapolation_ns: Default extrapolation horizon past the newest sample (ns, >= 0).

        Raises:
            ValueError: `capacity` is below 2 or the horizon is negative.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity must be an integer >= 2, got {capacity!r}.")
        if max_extrapolation_ns < 0:
            raise ValueError(f"max_extrapolation_ns must be >= 0, got {max_extrapolation_ns!r}.")
        self.capacity = capacity
        self.max_extrapolation_ns = int(max_extrapolation_ns)
        self._t = array("q", bytes(8 * capacity))  # int64 times, preallocated
        self._e = array("d", bytes(8 * capacity))  # float64 corrected energies, preallocated
        self._head = 0  # physical index of the oldest sample
        self._len = 0
        self._offset_j = 0.0
        self._last_raw_j = 0.0
        self.dropped_out_of_order = 0
        self.dropped_invalid = 0
        self.counter_resets = 0

    # ----------------------------------------------------------------------------- intake

    def append(self, t_ns: int, energy_j: float) -> bool:
        """Add one reading of the cumulative energy counter.

        Args:
            t_ns: Time of the reading (monotonic ns).
            energy_j: Raw counter value (J), as the GPU reports it.

        Returns:
            True if the sample was stored, False if it was ignored (out of order, duplicate
            time, or non-finite energy; see the counters).
        """
        if not math.isfinite(energy_j):
            self.dropped_invalid += 1
            return False
        if self._len:
            newest = self._phys(self._len - 1)
            if t_ns <= self._t[newest]:
                self.dropped_out_of_order += 1
                return False
            if energy_j < self._last_raw_j:
                # Counter went backwards: hold the stored series flat across the reset.
                self._offset_j = self._e[newest] - energy_j
                self.counter_resets += 1
        self._last_raw_j = energy_j
        stored = energy_j + self._offset_j
        if self._len:
            # raw + offset can round below the previous value; never let the series dip.
            stored = max(stored, self._e[self._phys(self._len - 1)])
        if self._len == self.capacity:
            slot = self._head
            self._head = (self._head + 1) % self.capacity
        else:
            slot = self._phys(self._len)
            self._len += 1
        self._t[slot] = t_ns
        self._e[slot] = stored
        return True

    def clear(self) -> None:
        """Forget every sample (counters and the reset offset are kept)."""
        self._head = 0
        self._len = 0

    # ----------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return self._len

    def span(self) -> tuple[int, int] | None:
        """Return `(oldest, newest)` sample times (monotonic ns), or None when empty."""
        if not self._len:
            return None
        return self._t[self._head], self._t[self._phys(self._len - 1)]

    def latest(self) -> tuple[int, float] | None:
        """Return the newest `(t_ns, energy_j)` sample (offset-corrected), or None when empty."""
        if not self._len:
            return None
        p = self._phys(self._len - 1)
        return self._t[p], self._e[p]

    def last_power_w(self) -> float | None:
        """Return the average power between the two newest samples (W), or None if fewer."""
        if self._len < 2:
            return None
        p1 = self._phys(self._len - 1)
        p0 = self._phys(self._len - 2)
        return (self._e[p1] - self._e[p0]) * 1e9 / (self._t[p1] - self._t[p0])

    def energy_at(self, t_ns: int, max_extrapolation_ns: int | None = None) -> float:
        """Return the (offset-corrected) cumulative energy at `t_ns` by interpolation (J).

        Args:
            t_ns: Requested time (monotonic ns).
            max_extrapolation_ns: Horizon past the newest sample within which the answer is
                extrapolated with the last observed power; defaults to the ring's.

        Returns:
            The cumulative energy at `t_ns` (J). Only differences between two answers mean
            anything physically.

        Raises:
            WindowOutOfRange: The ring is empty, `t_ns` is before the oldest sample, past the
                horizon, or after the only sample (no power observed yet to extrapolate with).
        """
        horizon = self.max_extrapolation_ns
        if max_extrapolation_ns is not None:
            horizon = max_extrapolation_ns
        span = self.span()
        if span is None:
            raise WindowOutOfRange(
                f"No energy sample yet; cannot answer for t={t_ns} ns. "
                "Wait for the sampler's first readings.",
                t_ns,
                None,
            )
        oldest, newest = span
        if t_ns < oldest:
            raise WindowOutOfRange(
                f"Requested t={t_ns} ns is {oldest - t_ns} ns before the oldest energy sample "
                f"kept; the ring spans [{oldest}, {newest}] ns. Ask sooner after the window "
                "ends or give the ring a larger capacity.",
                t_ns,
                span,
            )
        if t_ns > newest:
            ahead = t_ns - newest
            if ahead > horizon:
                raise WindowOutOfRange(
                    f"Requested t={t_ns} ns is {ahead} ns after the newest energy sample, beyond "
                    f"the extrapolation horizon of {horizon} ns; the ring spans "
                    f"[{oldest}, {newest}] ns. Wait for the next sample.",
                    t_ns,
                    span,
                )
            power_w = self.last_power_w()
            if power_w is None:
                raise WindowOutOfRange(
                    f"Requested t={t_ns} ns is after the only energy sample ({newest} ns); no "
                    "power observed yet to extrapolate with. Wait for the next sample.",
                    t_ns,
                    span,
                )
            return self._e[self._phys(self._len - 1)] + power_w * ahead / 1e9
        # oldest <= t_ns <= newest: find the first logical index i with t[i] >= t_ns.
        i = self._bisect_left(t_ns)
        pi = self._phys(i)
        t_hi = self._t[pi]
        if t_hi == t_ns or i == 0:
            return self._e[pi]
        plo = self._phys(i - 1)
        t_lo, e_lo, e_hi = self._t[plo], self._e[plo], self._e[pi]
        frac = (t_ns - t_lo) / (t_hi - t_lo)
        return e_lo + (e_hi - e_lo) * frac

    def energy_between(
        self, t0_ns: int, t1_ns: int, max_extrapolation_ns: int | None = None
    ) -> float:
        """Return the energy spent between `t0_ns` and `t1_ns` (J, never negative).

        Args:
            t0_ns: Start of the window (monotonic ns).
            t1_ns: End of the window (monotonic ns), `>= t0_ns`.
            max_extrapolation_ns: Extrapolation horizon override (see `energy_at`).

        Raises:
            ValueError: `t1_ns < t0_ns`.
            WindowOutOfRange: Either end cannot be answered (see `energy_at`).
        """
        if t1_ns < t0_ns:
            raise ValueError(
                f"Window end t1={t1_ns} ns is before its start t0={t0_ns} ns; pass t0 <= t1."
            )
        e1 = self.energy_at(t1_ns, max_extrapolation_ns)
        e0 = self.energy_at(t0_ns, max_extrapolation_ns)
        return max(0.0, e1 - e0)

    def power_between(
        self, t0_ns: int, t1_ns: int, max_extrapolation_ns: int | None = None
    ) -> float:
        """Return the average power between `t0_ns` and `t1_ns` (W).

        Args:
            t0_ns: Start of the window (monotonic ns).
            t1_ns: End of the window (monotonic ns), `> t0_ns`.
            max_extrapolation_ns: Extrapolation horizon override (see `energy_at`).

        Raises:
            ValueError: `t1_ns <= t0_ns` (an empty window has no average power).
            WindowOutOfRange: Either end cannot be answered (see `energy_at`).
        """
        if t1_ns <= t0_ns:
            raise ValueError(
                f"Window end t1={t1_ns} ns must be after its start t0={t0_ns} ns to average "
                "power over it."
            )
        return self.energy_between(t0_ns, t1_ns, max_extrapolation_ns) * 1e9 / (t1_ns - t0_ns)

    # ----------------------------------------------------------------------------- helpers

    def _phys(self, logical: int) -> int:
        """Map a logical index (0 = oldest) to the physical slot."""
        return (self._head + logical) % self.capacity

    def _bisect_left(self, t_ns: int) -> int:
        """Return the first logical index whose time is >= `t_ns` (binary search, no copy)."""
        lo, hi = 0, self._len
        t = self._t
        while lo < hi:
            mid = (lo + hi) // 2
            if t[self._phys(mid)] < t_ns:
                lo = mid + 1
            else:
                hi = mid
        return lo
