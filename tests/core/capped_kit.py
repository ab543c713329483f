"""A simulated GPU for the capped power-limit tests: a node cap clamps the limit it runs at."""

from __future__ import annotations

RATE = {300: (1.0, 300.0), 250: (1.05, 260.0), 200: (1.2, 240.0), 150: (1.7, 250.0)}
"""Seconds and joules per step at each limit: the energy-optimal limit is 200 W."""


class Gpu:
    """One simulated GPU: the limit asked for, clamped to a node cap, and its counters."""

    def __init__(self) -> None:
        self.asked = 300
        self.cap: int | None = None
        self.t, self.e = 0.0, 0.0
        self.opened: dict[str, tuple[float, float, int]] = {}

    @property
    def limit(self) -> int:
        return self.asked if self.cap is None else min(self.asked, self.cap)

    def run_step(self) -> None:
        dt, de = RATE[self.limit]
        self.t, self.e = self.t + dt, self.e + de
