"""Profiling windows, as in Zeus 0.16: `push_window`, `pop_window` and the `window` block.

A window is two local stamps and one `measure` request when it closes; the stack of open
windows lives here so the event hot path (`publisher.py`) does not carry it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from zeus_agent.emit.records import ProfilingResult, WindowHandle
from zeus_agent.emit.requests import Requests

_monotonic_ns = time.monotonic_ns


class Windows(Requests):
    """Nested profiling windows over `measure` (state set by `Publisher.__init__`)."""

    _windows: list[tuple[str | None, int]]
    _sync_device: Callable[[int], None] | None

    def _sync_windows(self) -> None:
        if self._sync_device is not None:
            for index in self.gpu_indices:
                self._sync_device(index)

    def push_window(self, name: str | None = None) -> None:
        """Open a profiling window (windows nest, like a stack).

        Args:
            name: Optional name; `pop_window(name)` checks it.
        """
        self._sync_windows()
        self._windows.append((name, _monotonic_ns()))

    def pop_window(self, name: str | None = None, exact: bool = False) -> ProfilingResult:
        """Close the innermost window and measure it.

        Args:
            name: When given, it must be the innermost window's name.
            exact: Wait for the counter read that brackets the window's end (see `measure`).

        Returns:
            Its time (s) and the energy (J) of each of the publisher's GPUs (NaN without an
            agent).

        Raises:
            RuntimeError: No window is open.
            ValueError: `name` is not the innermost window's name (the stack is unchanged).
        """
        self._sync_windows()
        t1 = _monotonic_ns()
        if not self._windows:
            raise RuntimeError("No profiling window active. Consider calling `push_window` first.")
        top, t0 = self._windows[-1]
        if name is not None and name != top:
            raise ValueError(
                f"pop_window({name!r}) does not match the innermost window {top!r}; windows "
                "nest: pop the innermost first"
            )
        self._windows.pop()
        return ProfilingResult(time=(t1 - t0) / 1e9, energy=self.measure(t0, t1, exact=exact))

    @contextlib.contextmanager
    def window(self, name: str | None = None) -> Iterator[WindowHandle]:
        """Measure the block: `with pub.window("fwd") as w: ...`, then `w.result`."""
        handle = WindowHandle(name)
        self.push_window(name)
        try:
            yield handle
        finally:
            handle.result = self.pop_window(name)
