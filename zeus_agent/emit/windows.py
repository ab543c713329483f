"""Profiling windows, as in Zeus 0.16: the stack behind `push_window` and `pop_window`.

A window is two local stamps and one `measure` request when it closes; the stack of open
windows lives here so the event hot path (`publisher.py`) does not carry it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from zeus_agent.emit.records import ProfilingResult

_monotonic_ns = time.monotonic_ns


class Measure(Protocol):
    """Each GPU's energy (J) between two stamps: `Publisher.measure`."""

    def __call__(
        self, t0_ns: int, t1_ns: int, gpu_indices: Sequence[int] | None = None,
        exact: bool = False,
    ) -> list[float]:
        """Energy (J) of each GPU between `t0_ns` and `t1_ns`."""
        ...


class Windows:
    """Nested profiling windows, each measured when it closes."""

    def __init__(
        self,
        measure: Measure,
        gpu_indices: Sequence[int],
        sync_device: Callable[[int], None] | None,
    ) -> None:
        """Windows measured by `measure`.

        Args:
            measure: Energy of the publisher's GPUs between two stamps (`Publisher.measure`).
            gpu_indices: The CUDA devices `sync_device` synchronises before each stamp.
            sync_device: `torch.cuda.synchronize`, or None not to synchronise.
        """
        self._measure = measure
        self._gpu_indices = gpu_indices
        self._sync_device = sync_device
        self._stack: list[tuple[str | None, int]] = []
        """The open windows, innermost last: (name, start stamp)."""

    def _sync(self) -> None:
        if self._sync_device is not None:
            for index in self._gpu_indices:
                self._sync_device(index)

    def push_window(self, name: str | None = None) -> None:
        """Open a window named `name` (see `Publisher.push_window`)."""
        self._sync()
        self._stack.append((name, _monotonic_ns()))

    def pop_window(self, name: str | None = None, exact: bool = False) -> ProfilingResult:
        """Close the innermost window and measure it (see `Publisher.pop_window`)."""
        self._sync()
        t1 = _monotonic_ns()
        if not self._stack:
            raise RuntimeError("No profiling window active. Consider calling `push_window` first.")
        top, t0 = self._stack[-1]
        if name is not None and name != top:
            raise ValueError(
                f"pop_window({name!r}) does not match the innermost window {top!r}; windows "
                "nest: pop the innermost first"
            )
        self._stack.pop()
        return ProfilingResult(time=(t1 - t0) / 1e9, energy=self._measure(t0, t1, exact=exact))
