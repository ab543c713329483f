"""The process registry: every process the harness starts, and their clean-up.

`Processes` starts each child (`spawn`) as the leader of a new session (so a signal to its
process group reaches what it started in turn), logging to a file of its own, with a marker in
its environment (`MARK_ENV`) that its own children inherit. `close()` kills every group, then
whatever still carries the marker wherever it was reparented, and reaps them all.

A child dies with the harness too: it is forked through `zeus_agent.children.popen`, so the
kernel sends it SIGTERM if the harness process ends without closing (SIGKILL, a crash). A
harness script stopped by SIGTERM closes its registries on the way out when it runs under
`sigterm_as_sigint()` (its `finally` blocks run, as on Ctrl-C); registries still open at
interpreter exit are closed then (`atexit`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from zeus_agent import children
from zeus_agent.children import sigterm_as_sigint

__all__ = ["CODE_ROOT", "MARK_ENV", "Processes", "console_script", "kill_group",
           "processes_with_mark", "sigterm_as_sigint"]

MARK_ENV = "ZEUS_HARNESS_MARK"
"""Environment variable carrying a registry's marker into every process it starts."""
CODE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the packages this harness is part of: its children run the same code
(it leads their PYTHONPATH)."""


def console_script(name: str, module: str) -> list[str]:
    """The installed console script `name`, else `python -m module`."""
    script = Path(sysconfig.get_path("scripts")) / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def processes_with_mark(mark: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment carries `mark`."""
    found = []
    needle = f"{MARK_ENV}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        stat = _proc_stat(int(pid))
        if needle in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            found.append(int(pid))
    return found


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _group_members(pgid: int) -> list[int]:
    """Live pids of process group `pgid`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _proc_stat(int(name))
            if stat is not None and stat[0] != "Z" and stat[2] == str(pgid):
                found.append(int(name))
    return found


def _sigkill_group_sparing_trackers(pgid: int) -> None:
    """SIGKILL every process of group `pgid` but Python's multiprocessing resource trackers.

    A tracker unlinks the named semaphores (`/dev/shm/sem.mp-*`) its processes leave behind,
    once they are all gone; killed with them, it would leak every one. It ends by itself.
    The group is stopped first, so that it dies as at once: no member sees another die. A
    member killed stays listed until the kernel has torn it down (tens of ms for one holding
    a GiB: a trainer), so each is killed once and the group looked at again only for members
    not seen yet (a fork under way as it stopped). The group is then continued: the trackers,
    and anything a SIGKILL could not reach, are not left stopped.
    """
    try:
        os.killpg(pgid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        return
    seen: set[int] = set()
    for _ in range(20):
        members = [pid for pid in _group_members(pgid) if pid not in seen]
        if not members:
            break
        seen.update(members)
        for pid in members:
            if not _is_resource_tracker(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    else:  # (New members each time: give up sparing anything.)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL,
               wait_s: float = 10.0) -> None:
    """Send `sig` to the process group `proc` leads (nothing if it is gone).

    SIGKILL spares the group's multiprocessing resource trackers, so that they clean up the
    semaphores of what was killed (they end by themselves then). Then its leader has `wait_s`
    to end (and is reaped if it did; 0: no wait).
    """
    if sig == signal.SIGKILL:
        _sigkill_group_sparing_trackers(proc.pid)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    if wait_s > 0:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


def child_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with `CODE_ROOT` leading PYTHONPATH, plus `extra`.

    A None value in `extra` removes that variable.
    """
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ,
           "PYTHONPATH": str(CODE_ROOT) + (os.pathsep + path if path else ""),
           "PYTHONUNBUFFERED": "1"}
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _wait_for_trackers(mark: str, timeout_s: float = 3.0) -> None:
    """Give the resource trackers carrying `mark` `timeout_s` to clean up and end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            _is_resource_tracker(pid) for pid in processes_with_mark(mark)):
        time.sleep(0.05)


_OPEN: weakref.WeakSet[Processes] = weakref.WeakSet()


@atexit.register
def _close_open_registries() -> None:
    for registry in list(_OPEN):
        with contextlib.suppress(Exception):
            registry.close()


class Processes:
    """Processes started by a harness: each a session leader, logging to its own file.

    Args:
        root: A directory for the logs (`root/logs/<name>.<run>.log`).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mark = uuid.uuid4().hex
        self.logs_dir = root / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, list[Path]] = {}
        _OPEN.add(self)

    def spawn(self, name: str, argv: Sequence[str],
              env: Mapping[str, str | None] | None = None,
              cwd: Path | None = None, stdout: int | None = None,
              stdin: int | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` as process `name` (a name is reused after the previous one ended).

        Its environment is this process's (`CODE_ROOT` leading PYTHONPATH), `env` (None
        removes a variable), and the marker. Its output goes to its log; with `stdout`
        (`subprocess.PIPE`), its standard output goes there instead. Its standard input is
        empty (`/dev/null`), or `stdin` (`subprocess.PIPE`: the harness writes it).
        """
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"process {name} is still running")
        path = self.logs_dir / f"{name}.{len(self.logs.get(name, []))}.log"
        self.logs.setdefault(name, []).append(path)
        with open(path, "wb") as log:
            proc = children.popen(
                list(argv), stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=log if stdout is None else stdout,
                stderr=log, cwd=cwd, start_new_session=True,
                env=child_env({**(env or {}), MARK_ENV: self.mark}),
            )
        self.procs[name] = proc
        return proc

    def alive(self, name: str) -> bool:
        """Whether the latest process `name` runs."""
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the process group of `name` (SIGKILL: and reap the leader)."""
        proc = self.procs[name]
        kill_group(proc, sig, wait_s=0)
        if sig == signal.SIGKILL:
            proc.wait(10)

    def stop(self, name: str, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group of `name` and wait for its leader; SIGKILL it past `timeout_s`.

        Returns:
            Its exit code, None if it had to be killed.
        """
        proc = self.procs[name]
        if proc.poll() is not None:
            return proc.returncode
        kill_group(proc, signal.SIGTERM, wait_s=0)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(name)
            return None

    def close(self, grace_s: float = 0.0) -> list[int]:
        """Kill every process started here and anything left carrying the marker.

        Args:
            grace_s: First SIGTERM every group and give the processes this long to stop on
                their own (0: SIGKILL at once).

        Returns:
            The pids that were still alive after the groups were killed (they are killed too).
        """
        _OPEN.discard(self)
        if grace_s > 0:
            live = [p for p in self.procs.values() if p.poll() is None]
            for proc in live:
                kill_group(proc, signal.SIGTERM, wait_s=0)
            deadline = time.monotonic() + grace_s
            for proc in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.01, deadline - time.monotonic()))
        for proc in self.procs.values():
            kill_group(proc, wait_s=0)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _wait_for_trackers(self.mark)
        strays = processes_with_mark(self.mark)
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while processes_with_mark(self.mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        return strays

    def log(self, name: str, tail: int = 6000) -> str:
        """The last `tail` characters of every log of process `name`, oldest run first."""
        out = []
        for path in self.logs.get(name, []):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")
                out.append(f"----- {path.name} -----\n{text[-tail:]}")
        return "\n".join(out)

    def text(self, name: str, every_run: bool = False) -> str:
        """The whole log of the latest run of `name` ("" if it has none yet).

        With `every_run`: the logs of all its runs, oldest first.
        """
        paths = self.logs.get(name, [])
        out = []
        for path in paths if every_run else paths[-1:]:
            with contextlib.suppress(OSError):
                out.append(path.read_text(errors="replace"))
        return "".join(out)

    def all_logs(self, tail: int = 4000) -> str:
        """The tail of every log."""
        return "\n".join(self.log(name, tail) for name in self.logs)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
