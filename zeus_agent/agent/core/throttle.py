"""`Throttle`: report a flood of like events as a few, with how many were held back (pure).

A trainer whose instructions no longer match its schedule makes one mismatch per instruction:
20,000 in an iteration became 20,000 warnings and error events in 1.5 s. A throttle counts
every occurrence (`seen` stays exact), lets the first `burst` through at once and then one per
`1 / per_s` seconds (a token bucket), and gives each one let through the number held back
since the previous one, so nothing is lost from the count. The caller passes the time in.
"""

from __future__ import annotations

import math

__all__ = ["Throttle"]


class Throttle:
    """A token bucket over occurrences: `hit(now)` says whether to report this one."""

    def __init__(self, per_s: float = 2.0, burst: int = 3) -> None:
        if not (math.isfinite(per_s) and per_s > 0) or burst < 1:
            raise ValueError(f"need per_s > 0 and burst >= 1, got {per_s!r}, {burst!r}")
        self.per_s = per_s
        self.burst = burst
        self.seen = 0
        """Every occurrence, reported or not."""
        self.held = 0
        """Occurrences held back since the last one let through (or `flush`ed)."""
        self._tokens = float(burst)
        self._at: float | None = None

    def _refill(self, now_s: float) -> None:
        if self._at is not None and now_s > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now_s - self._at) * self.per_s)
        if self._at is None or now_s > self._at:
            self._at = now_s

    def hit(self, now_s: float) -> int | None:
        """Count one occurrence: None to hold it back, else the number held back before it."""
        self.seen += 1
        self._refill(now_s)
        if self._tokens < 1.0:
            self.held += 1
            return None
        self._tokens -= 1.0
        held, self.held = self.held, 0
        return held

    def wait_s(self, now_s: float) -> float:
        """Seconds until an occurrence would be let through (0: now)."""
        self._refill(now_s)
        return max(0.0, (1.0 - self._tokens) / self.per_s)

    def flush(self, now_s: float) -> int:
        """The number held back, taken (as one report) if one may be made now, else 0.

        For a summary after a flood has ended: the held back ones would otherwise wait for
        the next occurrence, which may never come.
        """
        self._refill(now_s)
        if self.held == 0 or self._tokens < 1.0:
            return 0
        self._tokens -= 1.0
        held, self.held = self.held, 0
        return held
