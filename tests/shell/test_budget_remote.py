"""A Perseus job another replica drives, moved along its frontier by the budgets' owner, over
a real nats-server (`coordinator.budget.remote`).

The replica driving the job records its frontier in the state bucket; the owner, following
it, plans the job on it (a frontier point, not a proportional cap) and records the point it
gives; the driving replica, following that, serves it while the budget governs the job's
GPUs, and its own plan once the budget is lifted (the owner purges the point). A frontier the
job no longer serves is purged by its driver, and the owner caps the job proportionally.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.job_views import job_views
from coordinator.budget.points import frontier_points
from coordinator.budget.store import TimingStore
from coordinator.budget.timing import MIN_STEPS, frontier_digest
from coordinator.state.jetstream import JetStreamState
from coordinator.state.records import FRONTIER_PREFIX, POINT_PREFIX, TIMING_PREFIX, job_hash
from tests.shell.budget_remote_kit import replica, theirs, until
from zeus_agent.wire.budget import Budget

VIEW = fo.FrontierView(times=(1.0, 1.3, 1.6), powers=(250.0, 200.0, 160.0),
                       peaks=(280.0, 230.0, 170.0), chosen=0)
"""A 2-GPU job's frontier: 1.0 s at 250 W per GPU, 1.3 s at 200 W, 1.6 s at 160 W."""
GPUS = (("n", 0), ("n", 1))
GRID = Budget(budget_id="grid", cap_w=340.0)
"""170 W per GPU: the job must go to its slowest point (320 W in all)."""



@pytest.mark.timeout(30)
async def test_the_owner_moves_another_replicas_perseus_job_along_its_frontier(nc) -> None:
    state = JetStreamState(nc, "zeus", bucket=f"t-{uuid.uuid4().hex[:12]}")
    await state.open()
    mine = [enforce.JobView("perseus", GPUS, frontier=VIEW)]  # (The driver's own view.)
    driving = replica(state.kv, "driving", lambda: mine)
    owner = replica(state.kv, "owner", lambda: job_views([theirs()], owner.view.remote))
    for loop in (driving, owner):
        await state.watch(f"{FRONTIER_PREFIX}>", loop.view.remote.on_frontier)
        await state.watch(f"{POINT_PREFIX}>", loop.view.remote.on_point)
        await state.watch(f"{TIMING_PREFIX}>", loop.view.remote.on_timing)

    def owners_plan(budgets: list[Budget]) -> dict[str, tuple[int, float]]:
        owner.plan(budgets, True)
        return frontier_points(owner.plans.values(), owner.views, owner.ratios)

    owners_plan([GRID])  # Nothing recorded yet: capped proportionally.
    (share,) = owner.plans["grid"].allocation.shares
    assert share.key is None

    await driving.bucket.record_frontiers(mine)
    await until(lambda: owner.view.remote.frontier("perseus") == VIEW, "the frontier recorded")
    assert owner.view.remote.own_draw_w("perseus") is None  # (Not measured yet.)
    points = owners_plan([GRID])
    (share,) = owner.plans["grid"].allocation.shares
    assert share.key == 2 and points == {"perseus": (2, 160.0)}  # its slowest point
    assert owner.statuses["grid"].shares[0].slowdown == pytest.approx(0.6)
    await owner.tell(points)  # (No job of its own to serve: `serve` is unset here.)
    await owner.bucket.record_points(points, owner.views)
    await until(lambda: driving.view.remote.point("perseus") == (2, 160.0), "the point")
    assert driving.held_here([GRID], mine) == {"perseus": (2, 160.0)}  # served there

    # Recorded once: a round with the same point and frontier writes nothing.
    keys = (POINT_PREFIX + job_hash("perseus"), FRONTIER_PREFIX + job_hash("perseus"))
    before = [(await state.kv.get(k)).revision for k in keys]
    await owner.bucket.record_points(owners_plan([GRID]), owner.views)
    await driving.bucket.record_frontiers(mine)
    assert [(await state.kv.get(k)).revision for k in keys] == before

    # Its own draw measured (the same 250 W a GPU the samples said): the frontier is recorded
    # again with it, and the owner follows it.
    mine = [dataclasses.replace(mine[0], own_draw_w=250.0)]
    await driving.bucket.record_frontiers(mine)
    await until(lambda: owner.view.remote.own_draw_w("perseus") == 250.0, "the own draw")

    # The driver measures the job at that point (2.0 s, where the plan said 1.6 s) and
    # records it; the owner counts the job's options at it.
    digest = frontier_digest(VIEW.chosen, VIEW.times)
    history: list[tuple[int, float, float | None]] = []
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):
        history.append((n + 1, 2.0, 2.0 * 150.0))
        served = [dataclasses.replace(mine[0], step_times=tuple(history), own_step_s=1.0)]
        driving.measure_here(served, driving.held_here([GRID], served))
        await driving.bucket.keep_timing(served, driving.timing)
    assert [(m.key, m.relative_time) for m in driving.timing.measured("perseus")] == [(2, 2.0)]
    await until(lambda: owner.view.remote.measured("perseus", digest) is not None, "measures")
    assert owner.view.remote.measured("perseus", "0" * 32) is None  # (another frontier's)
    owners_plan([GRID])
    assert owner.statuses["grid"].shares[0].slowdown == pytest.approx(1.0)  # 2.0 s, not 1.6
    assert owner.timing.record("perseus") is None  # (Not the owner's to write...)
    await owner.bucket.keep_timing(owner.views, owner.timing)
    assert await TimingStore(state.kv).get("perseus") is not None  # (...nor to purge.)

    # The budget lifted: no point any more.
    await owner.bucket.record_points(owners_plan([]), owner.views)
    await until(lambda: driving.view.remote.point("perseus") is None, "the point purged")
    assert driving.held_here([], mine) == {}  # its own plan

    mine = [enforce.JobView("perseus", GPUS)]  # It stopped serving a plan of its frontier.
    await driving.bucket.record_frontiers(mine)
    await until(lambda: owner.view.remote.frontier("perseus") is None, "the frontier purged")
    owners_plan([GRID])
    (share,) = owner.plans["grid"].allocation.shares
    assert share.key is None
    await state.close()

