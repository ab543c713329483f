"""Shared by the shell tests of budgets over another replica's Perseus job: a budget loop on a
2-GPU node, the job as the owner's table has it, a poll."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from coordinator.budget import enforce
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView


def replica(kv: Any, name: str, jobs: Callable[[], list[enforce.JobView]]) -> BudgetLoop:
    """A replica's budget loop over the bucket `kv`, its node's 2 GPUs drawing 250 W each."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 250.0)  # (The job's planned draw: calibration 1.)
    link: Any = SimpleNamespace(require_state=lambda: SimpleNamespace(kv=kv))
    return BudgetLoop(link=link, book=SimpleNamespace(me=name),  # type: ignore[arg-type]
                      cluster=cluster, jobs=jobs, cap_lease_s=30.0, view=BudgetView())


def theirs() -> Any:
    """The job as the owner's table has it: driven by another replica."""
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r)) for r in (0, 1)}
    return SimpleNamespace(record=SimpleNamespace(ranks=ranks, power_limit=None),
                           optimiser=None, job_id="perseus", recorded=None, failed=None)


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll `check` for up to 5 s."""
    for _ in range(100):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not seen: {what}")
