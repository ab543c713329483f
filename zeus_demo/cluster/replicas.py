"""`Replicas`: coordinator replicas as real `python -m coordinator.cli run` processes.

Each is its own interpreter (its own GIL and CPU share, as deployed), with `--replica-name
<name>`, its own state directory and `/healthz` port (readiness and its `dropped` counters); its
CPU time can be read. They are in a `Processes` registry, so they die with the harness.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeus_demo.cluster.ports import free_port
from zeus_demo.cluster.processes import CODE_ROOT, Processes

__all__ = ["Replicas", "cpu_seconds"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by process `pid` (s); 0 if it is gone."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except ImportError:  # pragma: no cover - psutil is a dependency of the dev extras
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except Exception:  # noqa: BLE001 - the process ended
        return 0.0


class Replicas:
    """Coordinator replicas `names`, connected to `url`, their files under `root`.

    Args:
        url: The NATS URL they connect to.
        root: Their state directories (`root/<name>`) and logs.
        names: The replicas' names.
        args: Extra flags of `coordinator.cli run`.
        profile_dir: Run each under cProfile (`<profile_dir>/<name>.prof`, written when it
            stops cleanly).
        procs: The registry to start them in (default: one of their own, under `root`).
        log_level: Their `--log-level`.
        env: Their environment's changes (`Processes.spawn`'s: None removes a variable).
    """

    def __init__(self, url: str, root: Path, names: Sequence[str], args: Sequence[str] = (),
                 profile_dir: Path | None = None, procs: Processes | None = None,
                 log_level: str = "WARNING", env: Mapping[str, str | None] | None = None) -> None:
        self.url = url
        self.root = root
        self.names = list(names)
        self.args = list(args)
        self.profile_dir = profile_dir
        self.procs = procs if procs is not None else Processes(root)
        self.log_level = log_level
        self.env = dict(env or {})
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
                "--log-level", self.log_level, *self.args]
        self.procs.spawn(name, argv, env=self.env, cwd=CODE_ROOT)

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
                if not self.alive(name) or time.monotonic() > deadline:
                    raise RuntimeError(f"coordinator replica {name} did not start:\n"
                                       + self.log_tail(name))
                time.sleep(0.05)

    def pid(self, name: str) -> int:
        """The process id of replica `name`."""
        return self.procs.procs[name].pid

    def alive(self, name: str) -> bool:
        """Whether replica `name` runs."""
        return self.procs.alive(name)

    def cpu_s(self, name: str) -> float:
        """CPU time replica `name` used so far (s)."""
        return cpu_seconds(self.pid(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to replica `name` (SIGKILL: it releases nothing) and reap it."""
        proc = self.procs.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every replica (a clean stop: profiles get written), SIGKILL laggards."""
        live = [self.procs.procs[n] for n in self.names if self.alive(n)]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop every replica and whatever it left (the registry's `close`)."""
        self.stop_all()
        self.procs.close()

    def print_logs(self, chars: int = 3000) -> None:
        """Every replica's log tail, to stderr (when a run failed)."""
        for name in self.names:
            print(f"== log of replica {name}:\n{self.log_tail(name, chars)}", file=sys.stderr)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The last `chars` characters of replica `name`'s log."""
        return self.procs.text(name)[-chars:]
