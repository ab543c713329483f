"""Child processes that die with the process that started them, SIGKILL included.

Every process the project starts (the embedded broker's nats-server, the agents, servers and
coordinators of the demo and the benchmarks) is started through this module, so that none
outlives its parent: a parent stopped by SIGTERM or SIGINT stops its children on the way out;
a parent that cannot (SIGKILL, a crash) leaves each child a SIGTERM from the kernel.

* `die_with_parent()`: a `preexec_fn` asking Linux for SIGTERM when the parent dies
  (`prctl(PR_SET_PDEATHSIG)`; elsewhere it does nothing).
* `preexec(then)`: `die_with_parent` followed by another `preexec_fn` (a nice value...).
* `popen(args, **kwargs)`: `subprocess.Popen` with `die_with_parent`, forked from a thread that
  lives as long as the process, whatever thread calls it (see below).
* `create_subprocess_exec(program, *args, **kwargs)`: asyncio's, with `die_with_parent`.
* `sigterm_as_sigint()`: a block in which SIGTERM (what systemd, Kubernetes and `docker stop`
  send) does what Ctrl-C does, so that a script's own clean-up runs (its `finally` blocks,
  `asyncio.run`'s cancellation): its children are stopped and its temporary directories go.

The kernel ties the signal to the *thread* that forked the child, not to the process: a child
forked from an `asyncio.to_thread` worker gets SIGTERM when that worker ends, which may be long
before the process does. `popen` therefore forks from the main thread when called there, and
from one long-lived launcher thread of its own when called from any other. asyncio forks in the
event loop's thread: `create_subprocess_exec` is for a loop that runs as long as its children
should (`asyncio.run` in the main thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """The C library's `prctl`, resolved once in the parent (never inside a forked child)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return fn


_PRCTL = _load_prctl()
_forking_pid = os.getpid()


def _before_fork() -> None:
    """Remember, in the parent, which process is forking (`die_with_parent` compares)."""
    global _forking_pid
    _forking_pid = os.getpid()


os.register_at_fork(before=_before_fork)


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the thread that forked it ends.

    That is when the parent process ends, SIGKILL included, for a child forked from a thread
    that lives as long as the process (`popen` makes sure of it). Linux only; elsewhere it
    does nothing. If the parent died before the request was in place, the child ends at once.
    """
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != _forking_pid:  # the parent died between fork and prctl
        os._exit(143)


def preexec(then: Callable[[], Any] | None = None) -> Callable[[], None]:
    """A `preexec_fn`: `die_with_parent`, then `then` (a nice value, a scheduling policy...)."""
    if then is None:
        return die_with_parent

    def both() -> None:
        die_with_parent()
        then()

    return both


class _Launcher:
    """One daemon thread that forks children for the other threads, and lives until exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="zeus-child-launcher", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future


_launcher: _Launcher | None = None
_launcher_lock = threading.Lock()


def _forget_launcher() -> None:
    """In a forked child: the launcher thread stayed behind in the parent."""
    global _launcher, _launcher_lock
    _launcher = None
    _launcher_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_launcher)


def _get_launcher() -> _Launcher:
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            _launcher = _Launcher()
        return _launcher


def popen(args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **kwargs)` for a child that dies with this process.

    `preexec_fn`, if given, runs after `die_with_parent`. The child is forked from the main
    thread when called there, else from the launcher thread (the caller waits for it).
    """
    fn = preexec(kwargs.pop("preexec_fn", None))

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(args, preexec_fn=fn, **kwargs)  # noqa: PLW1509

    if threading.current_thread() is threading.main_thread():
        return start()
    launcher = _get_launcher()
    if threading.current_thread() is launcher.thread:
        return start()
    future = launcher.submit(start)
    try:
        return future.result()
    except BaseException:
        # Interrupted while the launcher forked (or it failed): leave no child behind.
        if not future.cancel():
            with contextlib.suppress(BaseException):
                proc = future.result(timeout=30)
                proc.kill()
                proc.wait()
        raise


async def create_subprocess_exec(
    program: str, *args: str, **kwargs: Any
) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec` for a child that dies with this process.

    `preexec_fn`, if given, runs after `die_with_parent`. The loop forks in its own thread:
    use it from a loop that lives as long as the child should (`asyncio.run` in the main
    thread).
    """
    fn = preexec(kwargs.pop("preexec_fn", None))
    return await asyncio.create_subprocess_exec(program, *args, preexec_fn=fn, **kwargs)


def _as_sigint(signum: int, frame: Any) -> None:
    if callable(signal.getsignal(signal.SIGINT)):
        signal.raise_signal(signal.SIGINT)  # its handler: KeyboardInterrupt, asyncio.run's...
    else:  # SIGINT ignored (a background job of a shell script) or default
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """While in the block, SIGTERM does what SIGINT (Ctrl-C) does.

    That is KeyboardInterrupt in a plain script, the cancellation of the main task under
    `asyncio.run`: the script's clean-up runs instead of the process ending on the spot. Outside
    the main thread (where no signal handler can be set) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
