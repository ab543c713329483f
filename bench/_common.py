"""Shared by the benchmarks.

* `machine()`, `now()`, `load()`: what every benchmark stamps on its JSON line.
* `pct(sorted_values, q)`: the nearest-rank quantile; `SHM_ROOT`: where temporary state goes
  (in memory where the machine has /dev/shm: a simulated GPU's state file, as its registers).
* `Replicas`, `cpu_seconds`, `free_port`: the cluster harness's (`zeus_demo.cluster`):
  coordinator replicas as real `coordinator.cli run` processes (each its own interpreter, GIL
  and CPU share, as deployed) with their `/healthz`, CPU time and logs, dying with the
  benchmark, SIGKILL included.
* `spread()`: median, min and max of repeated runs.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence
from typing import Any

from zeus_agent.broker import check_jetstream_sync
from zeus_demo.cluster import Replicas, cpu_seconds, free_port

__all__ = ["SHM_ROOT", "Replicas", "cpu_seconds", "free_port", "jetstream_syncs", "load",
           "machine", "now", "pct", "spread"]

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


def load() -> str:
    """The 1, 5 and 15 minute load averages, as text."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


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
