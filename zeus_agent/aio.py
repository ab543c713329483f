"""Small asyncio helpers shared by the agent and the coordinator shells.

* `every(period_s, fn, what)`: run a coroutine function on a fixed grid forever; one failing
  tick is logged and the loop goes on (a loop never dies of one bad tick); an event may call
  it at once between ticks (`wake`).
* `run_event_loop(main)`: run a coroutine on uvloop when available.
* `ExitSignals`: the `should_exit`/`force_exit` events of a server that SIGINT/SIGTERM set
  (the first asks for a graceful exit, the second forces it); `finish` lets in-flight tasks
  end before a deadline unless the exit is forced.
* `wait_started(event, task, what, error)`: wait until a service in a task says it started,
  or fail with its own error if it died first.
* `Releases`: what a service acquires at start-up, released in the reverse order at shutdown
  (aiohttp's cleanup order), each release guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

LOG = logging.getLogger(__name__)


async def every(
    period_s: float, fn: Callable[[], Awaitable[Any]], what: str, *, first_now: bool = True,
    wake: asyncio.Event | None = None,
) -> None:
    """Run `fn` every `period_s` seconds on a fixed grid (skipping missed ticks).

    Args:
        period_s: The period (s).
        fn: The coroutine function to call.
        what: What the loop does, for the log.
        first_now: Call `fn` at once (else after one period).
        wake: An event that calls `fn` at once when set (then cleared), between ticks of the
            grid, which stays as it was: what the loop serves changed, and waiting for the
            next tick would cost (a power budget set: up to a period more over its cap).
    """
    next_t = time.monotonic() + (0 if first_now else period_s)
    task = asyncio.current_task()
    while True:
        delay = next_t - time.monotonic()
        woken = False
        if delay > 0:
            woken = await _sleep(delay, wake)
        if wake is not None:
            wake.clear()
        try:
            await fn()
        except Exception:  # noqa: BLE001 - a loop never dies of one bad tick
            LOG.exception("%s failed; continuing", what)
        if task is not None and task.cancelling():
            # A cancellation `fn` swallowed (Python 3.11's `wait_for` loses one that lands as
            # its inner call finishes): the loop must still stop, or a shutdown waits on it.
            raise asyncio.CancelledError
        if woken:
            continue
        next_t += period_s
        if next_t < time.monotonic():
            next_t = time.monotonic()


async def _sleep(delay_s: float, wake: asyncio.Event | None) -> bool:
    """Sleep `delay_s`, or less if `wake` is set meanwhile; whether it was."""
    if wake is None:
        await asyncio.sleep(delay_s)
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), delay_s)
        return True
    return False


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on uvloop when available, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(main)
        return
    uvloop.run(main)


class ExitSignals:
    """The exit events of a server: the first `handle_exit` (or signal) asks, the second forces.

    `install_signal_handlers` makes SIGINT and SIGTERM call `handle_exit`.
    """

    def __init__(self) -> None:
        self.should_exit = asyncio.Event()
        self.force_exit = asyncio.Event()

    def install_signal_handlers(self) -> None:
        """Make SIGINT and SIGTERM call `handle_exit` (on the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.handle_exit)

    def handle_exit(self) -> None:
        """Ask for a graceful exit; asked again, force it."""
        if self.should_exit.is_set():
            self.force_exit.set()
        self.should_exit.set()

    async def finish(self, tasks: set[asyncio.Task[Any]], timeout_s: float, why: str) -> int:
        """Let `tasks` (a live set) finish within `timeout_s` unless the exit is forced.

        Those left are then cancelled with the message `why`; returns how many were.
        """
        if not tasks:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        forced = asyncio.ensure_future(self.force_exit.wait())
        try:
            while tasks and not forced.done() and loop.time() < deadline:
                await asyncio.wait({*tasks, forced}, timeout=deadline - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        pending = set(tasks)
        for t in pending:
            t.cancel(msg=why)
        return len(pending)


async def wait_started(
    event: asyncio.Event,
    task: asyncio.Task[Any],
    what: str,
    error: type[Exception] = RuntimeError,
    timeout_s: float = 20.0,
    hint: str = "",
) -> None:
    """Wait until a service says it started (`event`), or fail if its task ended first.

    Raises:
        error: `what` did not start: its task ended (with its exception as the cause) or
            `timeout_s` passed (`hint` appended to the message).
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter, task}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if event.is_set():
        return
    if task in done:
        exc = task.exception()
        raise error(f"{what} did not start: {exc or 'it exited'}") from exc
    raise error(f"{what} did not start within {timeout_s:g} s{hint}")


class Releases:
    """What a service acquired, released in the reverse order (aiohttp's cleanup order).

    A service calls `push(what, release)` right where it acquires something (a server, a
    connection, a socket, its GPUs), so its shutdown, `aclose()`, mirrors its start-up,
    whichever step the start-up reached. `release` may return an awaitable (awaited).

    `aclose` runs each release once, the last pushed first: one that raises an `Exception` is
    logged and the others still run; a `BaseException` (a cancellation, an interrupt) is raised
    once all have run (`contextlib.AsyncExitStack`). A second `aclose` does nothing; what is
    pushed after one is released by the next.
    """

    def __init__(self, log: logging.Logger = LOG) -> None:
        self._log = log
        self._stack = contextlib.AsyncExitStack()
        self._pending: list[str] = []

    @property
    def pending(self) -> list[str]:
        """What is still to release, in the order it would be released."""
        return self._pending[::-1]

    def push(self, what: str, release: Callable[[], object]) -> None:
        """Release `what` by calling `release()` at `aclose`, before everything pushed earlier."""
        self._pending.append(what)

        async def guarded() -> None:
            self._pending.remove(what)
            try:
                result = release()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one release failing skips no other
                self._log.exception("releasing %s failed; releasing the rest", what)

        self._stack.push_async_callback(guarded)

    async def aclose(self) -> None:
        """Release everything pushed, the last pushed first (see the class docstring)."""
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        await stack.aclose()
