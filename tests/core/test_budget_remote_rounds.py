"""Two replicas' budget rounds (`BudgetLoop.tick`) around a Perseus job the owner does not
drive: the driver records its frontier, the owner plans on it and records a point, the driver
serves that point, measures the job there and records the measures, and the owner's next
plans count them. The state bucket is a dict whose writes reach both replicas' followers at
once, as the bucket's watches do (tests/shell/test_budget_remote.py: a real nats-server).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.job_views import job_views
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import MIN_STEPS
from coordinator.state.records import FRONTIER_PREFIX, POINT_PREFIX, TIMING_PREFIX
from zeus_agent.wire.budget import Budget

NOW = 1_800_000_000.0
GPUS = (("n", 0), ("n", 1))
VIEW = fo.FrontierView(times=(1.0, 1.3, 1.6), powers=(250.0, 200.0, 160.0),
                       peaks=(280.0, 230.0, 170.0), chosen=0)
GRID = Budget(budget_id="grid", cap_w=340.0)
"""170 W per GPU: the job must go to its slowest point (320 W in all)."""

OnEntry = Callable[[Any], Awaitable[None]]


class Kv:
    """A state bucket: a dict, each write fed to the followers of its keys."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.followers: list[tuple[str, OnEntry]] = []

    async def get(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        if key not in self.values:
            raise KeyNotFoundError
        return SimpleNamespace(key=key, value=self.values[key])

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value
        await self._feed(key, value, "PUT")

    async def purge(self, key: str) -> None:
        self.values.pop(key, None)
        await self._feed(key, None, "PURGE")

    async def _feed(self, key: str, value: bytes | None, operation: str) -> None:
        for prefix, callback in self.followers:
            if key.startswith(prefix):
                await callback(SimpleNamespace(key=key, value=value, operation=operation))


def replica(kv: Kv, owns: bool, jobs: Callable[[BudgetLoop], list[enforce.JobView]],
            served: list[dict[str, tuple[int, float]]]) -> BudgetLoop:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 250.0)  # (The job's planned draw: calibration 1.)
    state = SimpleNamespace(kv=kv)
    link: Any = SimpleNamespace(state=state, connected=True, require_state=lambda: state,
                                prefix="zeus", nc=SimpleNamespace(publish=_publish))
    book: Any = SimpleNamespace(owns=lambda key, now: owns, claimable=lambda keys, now: [],
                                me="owner" if owns else "driver")

    async def serve(points: dict[str, tuple[int, float]]) -> None:
        served.append(dict(points))

    view = BudgetView()
    view.budgets = {"grid": (GRID, NOW - 10)}
    loop = BudgetLoop(link=link, book=book, cluster=cluster, jobs=lambda: jobs(loop),
                      cap_lease_s=30.0, view=view, wall=lambda: NOW, serve=serve)
    for prefix, callback in ((FRONTIER_PREFIX, view.remote.on_frontier),
                             (POINT_PREFIX, view.remote.on_point),
                             (TIMING_PREFIX, view.remote.on_timing)):
        kv.followers.append((prefix, callback))

    async def send(key: Any, cap_w: Any, by: str, lease_s: Any = None) -> bool:
        return True

    loop.send = send  # type: ignore[method-assign]
    return loop


async def _publish(subject: str, data: bytes) -> None:
    return None


def theirs() -> Any:
    """The job as the owner's table has it: driven by another replica."""
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r)) for r in (0, 1)}
    return SimpleNamespace(record=SimpleNamespace(ranks=ranks, power_limit=None),
                           optimiser=None, job_id="perseus", recorded=None, failed=None)


def rounds(*loops: BudgetLoop) -> None:
    for loop in loops:
        loop.counted_at = -math.inf  # (Each a round of its own, not a woken one.)
        asyncio.run(loop.tick())


def test_the_driver_serves_the_owners_point_and_the_owner_plans_on_its_measures() -> None:
    kv = Kv()
    history: list[tuple[int, float, float | None]] = []
    served: list[dict[str, tuple[int, float]]] = []
    driver = replica(kv, False, lambda _: [enforce.JobView(
        "perseus", GPUS, frontier=VIEW, step_times=tuple(history), own_step_s=1.0)], served)
    owner = replica(kv, True, lambda loop: job_views([theirs()], loop.view.remote), [])
    rounds(driver)  # Its frontier recorded; nothing told yet: its own plan, held.
    assert served[-1] == {"perseus": (0, math.inf)}
    rounds(owner)
    (share,) = owner.plans["grid"].allocation.shares
    assert share.key == 2 and owner.statuses["grid"].shares[0].slowdown == pytest.approx(0.6)
    rounds(driver)
    assert served[-1] == {"perseus": (2, 160.0)}  # the owner's point
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):
        history.append((n + 1, 2.0, 2.0 * 150.0))  # 2.0 s there, the plan said 1.6 s
        rounds(driver)
    assert [(m.key, m.relative_time) for m in driver.timing.measured("perseus")] == [(2, 2.0)]
    rounds(owner)
    assert owner.statuses["grid"].shares[0].slowdown == pytest.approx(1.0)
    assert owner.timing.measured("perseus") == ()  # (Its driver's measures, followed.)

    owner.view.budgets = driver.view.budgets = {}  # Lifted: the point goes, its own plan back.
    rounds(owner, driver)
    assert not any(k.startswith(POINT_PREFIX) for k in kv.values)
    assert served[-1] == {}
    assert any(k.startswith(TIMING_PREFIX) for k in kv.values)  # (Kept while the job lives.)
