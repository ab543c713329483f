"""Shared by the benchmarks.

* `machine()`, `now()`, `load()`: what every benchmark stamps on its JSON line.
* `pct(sorted_values, q)`: the nearest-rank quantile; `SHM_ROOT`: where temporary state goes
  (in memory where the machine has /dev/shm: a simulated GPU's state file, as its registers).
* `Replicas`: coordinator replicas as real `zeus-coordinator run` processes (each its own
  interpreter, GIL and CPU share, as deployed), with their `/healthz`, CPU time and logs;
  they die with the benchmark, SIGKILL included (`zeus_agent.children.popen`).
* `spread()`: median, min and max of repeated runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeus_agent import children
from zeus_agent.broker import check_jetstream_sync

REPO_ROOT = Path(__file__).resolve().parent.parent


SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""A temporary directory's parent: memory when the machine has it (None: the default)."""


def pct(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of sorted values."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def machine() -> str:
    """The host, CPU count, platform and Python version."""
    return (
        f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu "
        f"{platform.platform()} python {platform.python_version()}"
    )


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load() -> str:
    """The 1, 5 and 15 minute load averages, as text."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by process `pid` (s); 0 if it is gone."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except ImportError:  # pragma: no cover - psutil is a dependency of the dev extras
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except Exception:  # noqa: BLE001 - the process ended
        return 0.0


class Replicas:
    """Coordinator replicas, each a `python -m coordinator.cli run` process.

    Each gets `--replica-name <name>`, its own state directory and `/healthz` port (for
    readiness and its `dropped` counters), and logs to `<root>/<name>.log`. `profile_dir`
    runs each under cProfile (`<profile_dir>/<name>.prof`, written when it stops cleanly).
    """

    def __init__(self, url: str, root: Path, names: Sequence[str], args: Sequence[str] = (),
                 profile_dir: Path | None = None) -> None:
        self.url = url
        self.root = root
        self.names = list(names)
        self.args = list(args)
        self.profile_dir = profile_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str) -> None:
        """Start replica `name` (not waiting for it)."""
        port = self.ports.setdefault(name, free_port())
        python = [sys.executable]
        if self.profile_dir is not None:
            python += ["-m", "cProfile", "-o", str(self.profile_dir / f"{name}.prof")]
        argv = [*python, "-m", "coordinator.cli", "run", "--nats-url", self.url,
                "--replica-name", name, "--state-dir", str(self.root / name),
                "--dump-dir", str(self.root / name / "dump"), "--status-port", str(port),
                "--log-level", "WARNING", *self.args]
        log = (self.root / f"{name}.log").open("ab")
        self.procs[name] = children.popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def start_all(self) -> None:
        """Start every replica."""
        for name in self.names:
            self.start(name)

    def health(self, name: str) -> dict[str, Any] | None:
        """Replica `name`'s `/healthz` JSON (None: not answering, or unhealthy)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[name]}/healthz",
                                        timeout=2) as r:
                return dict(json.loads(r.read()))
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def wait_healthy(self, timeout_s: float = 30.0, names: Sequence[str] | None = None) -> None:
        """Until every replica (or `names`) answers `/healthz` with 200.

        Raises:
            RuntimeError: One exited, or did not become healthy in time (its log's tail).
        """
        deadline = time.monotonic() + timeout_s
        for name in names or self.names:
            while self.health(name) is None:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"coordinator replica {name} did not start:\n"
                                       + self.log_tail(name))
                time.sleep(0.05)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def cpu_s(self, name: str) -> float:
        """CPU time replica `name` used so far (s)."""
        return cpu_seconds(self.pid(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to replica `name` (SIGKILL: it releases nothing) and reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every replica (a clean stop: profiles get written), SIGKILL laggards."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def print_logs(self, chars: int = 3000) -> None:
        """Every replica's log tail, to stderr (when a run failed)."""
        for name in self.names:
            print(f"== log of replica {name}:\n{self.log_tail(name, chars)}", file=sys.stderr)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return (self.root / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def spread(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """Median, min, max and every value of repeated measurements."""
    ordered = sorted(values)
    n = len(ordered)
    median = (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2) if n else 0
    return {"median": round(median, digits), "min": round(ordered[0], digits) if n else None,
            "max": round(ordered[-1], digits) if n else None,
            "runs": [round(v, digits) for v in values]}


def jetstream_syncs(text: str) -> list[str]:
    """A `--jetstream-sync` argument: sync_interval settings nats-server accepts, in order,
    each once (`always,2m`: measure the project's default beside nats-server's)."""
    import argparse

    try:
        values = [check_jetstream_sync(v.strip()) for v in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return list(dict.fromkeys(values))
