"""What the budget e2e tests share: the measured draw of some GPUs, the operator's CLI, and a
blocking call run off the event loop."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterable
from typing import Any

from zeus_agent.gpu.sim.device import SimGPU
from zeus_demo.cluster import SimCluster, console_script


def draw_w(c: SimCluster, gpus: Iterable[tuple[str, int]], seconds: float = 1.0) -> float:
    """The GPUs' (node, index) mean power over `seconds`, from their energy counters."""
    opened = [SimGPU.open(c.sim_dir(node), index) for node, index in gpus]
    before, t0 = [g.get_total_energy_j() for g in opened], time.monotonic()
    time.sleep(seconds)
    after, t1 = [g.get_total_energy_j() for g in opened], time.monotonic()
    return (sum(after) - sum(before)) / (t1 - t0)


def budget_cli(c: SimCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`zeus-coordinator budget ...` against the cluster's broker, as an operator types it."""
    return subprocess.run(
        [*console_script("zeus-coordinator", "coordinator.cli"), "budget", *args,
         "--nats-url", c.url], capture_output=True, text=True, timeout=30, check=False)


async def in_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in the loop's executor (it blocks: a sleep, a subprocess)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
