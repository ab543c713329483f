"""A monotonic nanosecond clock that moves only when told, for the simulated GPU's tests."""

from __future__ import annotations


class FakeClock:
    """`clock_ns` for `SimGPU` and kin: the time is `ns`; `advance` moves it forward."""

    def __init__(self, ns: int = 1_000_000_000) -> None:
        self.ns = ns

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)
