"""A Perseus job another replica drives is moved along the frontier its driver recorded, not
capped proportionally (`coordinator.budget.recorded`, `remote.Recorded`, `job_views.job_views`,
`BudgetLoop.held_here`; the bucket's side: tests/shell/test_budget_remote.py).

The replica applying the budgets drives only some jobs (rendezvous hashing): a Perseus job it
did not drive was counted at its proportional cap, a point of no frontier, squeezing the
others (the budget bench's small cluster: 3.43 times the uniform cut's loss, against 0.86
moved along its frontier).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.frontier_options import Served
from coordinator.budget.job_views import job_views
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.points import frontier_points
from coordinator.budget.recorded import (
    DRAW_TOLERANCE,
    POINT_TOLERANCE,
    draw_moved,
    frontier_record,
    frontier_view,
    point_moved,
    point_record,
)
from coordinator.budget.remote import Recorded
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import frontier_digest
from coordinator.state.records import FRONTIER_PREFIX, POINT_PREFIX, TIMING_PREFIX, job_hash
from zeus_agent.wire.budget import (
    MAX_FRONTIER_POINTS,
    Budget,
    BudgetFrontier,
    BudgetTiming,
    MeasuredOption,
)

VIEW = fo.FrontierView(times=(1.0, 1.3, 1.6), powers=(250.0, 200.0, 160.0),
                       peaks=(280.0, None, 170.0), chosen=0,
                       throttled=(fo.Throttled(150, 1.9, 140.0, 150.0),))
"""A 2-GPU job's frontier: 1.0 s at 250 W per GPU, 1.3 s at 200 W, 1.6 s at 160 W."""
GPUS = (("n", 0), ("n", 1))


def entry(prefix: str, job_id: str, value: bytes | None, operation: str = "PUT") -> Any:
    return SimpleNamespace(key=prefix + job_hash(job_id), value=value, operation=operation)


def driver(job_id: str = "perseus") -> Any:
    """A pipeline job another replica drives, as this replica's table has it."""
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r)) for r in (0, 1)}
    record = SimpleNamespace(ranks=ranks, power_limit=None)
    return SimpleNamespace(record=record, optimiser=None, job_id=job_id, recorded=None,
                           failed=None)


def test_a_frontier_record_gives_back_the_same_frontier() -> None:
    record = frontier_record("perseus", VIEW, 261.5)
    assert record is not None
    back = BudgetFrontier.model_validate_json(record.model_dump_json())
    assert frontier_view(back) == VIEW and back.own_draw_w == 261.5
    for absurd_draw in (0.0, -1.0, 1e9):  # (Left out: the frontier still recorded.)
        kept = frontier_record("perseus", VIEW, absurd_draw)
        assert kept is not None and kept.own_draw_w is None
    too_long = fo.FrontierView(times=(1.0,) * (MAX_FRONTIER_POINTS + 1),
                               powers=(100.0,) * (MAX_FRONTIER_POINTS + 1),
                               peaks=(None,) * (MAX_FRONTIER_POINTS + 1), chosen=0)
    assert frontier_record("perseus", too_long) is None
    absurd = fo.FrontierView(times=(1.0,), powers=(1e9,), peaks=(None,), chosen=0)
    assert frontier_record("perseus", absurd) is None


@pytest.mark.parametrize("bad", [
    {"powers": [250.0, 200.0]},  # a power fewer than times
    {"peaks": [None]},
    {"chosen": 3},
    {"times": [1.0, 0.0, 1.6]},
    {"times": [1.0, math.inf, 1.6]},
    {"powers": [250.0, -1.0, 160.0]},
    {"peaks": [None, 20_000.0, None]},
    {"times": []},
    {"unknown": 1},
])
def test_a_frontier_record_out_of_bounds_is_refused(bad: dict[str, Any]) -> None:
    value = {"job_id": "perseus", "times": [1.0, 1.3, 1.6], "powers": [250.0, 200.0, 160.0],
             "peaks": [None, None, None], "chosen": 0, **bad}
    with pytest.raises(ValidationError):
        BudgetFrontier.model_validate(value)


async def test_every_replica_follows_the_records_and_drops_the_bad_ones() -> None:
    follows = Recorded()
    record = frontier_record("perseus", VIEW)
    assert record is not None
    await follows.on_frontier(entry(FRONTIER_PREFIX, "perseus", record.model_dump_json().encode()))
    assert follows.frontier("perseus") == VIEW and follows.frontier("other") is None
    point = point_record("perseus", (2, 160.0))
    assert point is not None and point_record("perseus", (2, math.inf)) is None
    await follows.on_point(entry(POINT_PREFIX, "perseus", point.model_dump_json().encode()))
    assert follows.point("perseus") == (2, 160.0)
    # Another job's value under this one's key, garbage, a purge: nothing recorded.
    theirs = frontier_record("other", VIEW)
    assert theirs is not None
    await follows.on_frontier(entry(FRONTIER_PREFIX, "perseus",
                                    theirs.model_dump_json().encode()))
    assert follows.frontier("perseus") is None and follows.frontier("other") is None
    await follows.on_point(entry(POINT_PREFIX, "perseus", b"not json"))
    assert follows.point("perseus") is None
    await follows.on_point(entry(POINT_PREFIX, "perseus", point.model_dump_json().encode()))
    await follows.on_point(entry(POINT_PREFIX, "perseus", None, "PURGE"))
    assert follows.point("perseus") is None and follows.points == {}


def test_a_frontier_is_recorded_again_when_its_own_draw_moved() -> None:
    assert not draw_moved(None, None) and not draw_moved(250.0, 250.0 * (1 + DRAW_TOLERANCE / 2))
    assert draw_moved(None, 250.0) and draw_moved(250.0, None)
    assert draw_moved(250.0, 250.0 * (1 + 2 * DRAW_TOLERANCE))


def test_a_point_is_recorded_again_only_when_it_moved() -> None:
    assert point_moved(None, (2, 160.0))
    assert not point_moved((2, 160.0), (2, 160.0 * (1 + POINT_TOLERANCE / 2)))
    assert point_moved((2, 160.0), (2, 160.0 * (1 + 2 * POINT_TOLERANCE)))
    assert point_moved((2, 160.0), (1, 160.0))


def test_a_job_another_replica_drives_brings_the_frontier_it_recorded() -> None:
    follows = Recorded()
    (seen,) = job_views([driver()], follows)  # Nothing recorded: capped proportionally.
    assert seen.remote and seen.frontier is None
    follows.frontiers[job_hash("perseus")] = ("perseus", VIEW, 275.0, False)
    (seen,) = job_views([driver()], follows)
    assert seen.remote and seen.frontier == VIEW and seen.gpus == GPUS
    assert seen.own_draw_w == 275.0


def test_the_owner_calibrates_such_a_job_by_the_draw_its_driver_measured() -> None:
    """From the ranks' energies at its own point (275 W a GPU where 250 W were planned), not
    the GPUs' samples (250 W here: calibration 1)."""
    loop, _ = plan_with([enforce.JobView("perseus", GPUS, frontier=VIEW, own_draw_w=275.0,
                                         remote=True)])
    assert loop.ratios == {"perseus": pytest.approx(1.1)}
    (view,) = loop.views
    assert view.frontier is not None and view.frontier.powers[2] == pytest.approx(176.0)


def plan_with(jobs: list[enforce.JobView]) -> tuple[BudgetLoop, dict[str, tuple[int, float]]]:
    """The owner's plan of a 340 W budget over the job's 2 GPUs; the points it gives.

    The GPUs sampled at the job's planned 250 W (its frontier's calibration: 1).
    """
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 250.0)
    loop = BudgetLoop(link=None, book=SimpleNamespace(me="owner"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: jobs, cap_lease_s=10.0, view=BudgetView())
    loop.plan([Budget(budget_id="grid", cap_w=340.0)], True)
    return loop, frontier_points(loop.plans.values(), loop.views, loop.ratios)


def test_the_owner_moves_such_a_job_along_its_frontier_instead_of_capping_it() -> None:
    remote = enforce.JobView("perseus", GPUS, frontier=VIEW, remote=True)
    loop, points = plan_with([remote])
    (share,) = loop.plans["grid"].allocation.shares
    assert share.key == 2 and points == {"perseus": (2, 160.0)}  # 1.6 s at 160 W a GPU
    assert loop.plans["grid"].caps == {gpu: 179 for gpu in GPUS}  # its peak, 5 % over
    assert loop.statuses["grid"].shares[0].slowdown == pytest.approx(0.6)
    loop, points = plan_with([enforce.JobView("perseus", GPUS, remote=True)])
    (share,) = loop.plans["grid"].allocation.shares
    assert share.key is None and points == {}  # (Nothing recorded: a proportional cap.)


def test_the_replica_driving_it_serves_the_owners_point_else_holds_its_own() -> None:
    loop = BudgetLoop(link=None, book=None, cluster=plan_with([])[0].cluster,  # type: ignore[arg-type]
                      jobs=list, cap_lease_s=10.0, view=BudgetView())
    mine = enforce.JobView("perseus", GPUS, frontier=VIEW)
    theirs = enforce.JobView("other", GPUS, frontier=VIEW, remote=True)
    grid = [Budget(budget_id="grid", cap_w=400.0)]
    assert loop.held_here(grid, [mine, theirs]) == {"perseus": (0, math.inf)}  # its own
    loop.view.remote.points[job_hash("perseus")] = ("perseus", (2, 160.0))
    loop.view.remote.points[job_hash("other")] = ("other", (1, 200.0))
    assert loop.held_here(grid, [mine, theirs]) == {"perseus": (2, 160.0)}
    assert loop.held_here([], [mine, theirs]) == {}  # No budget governs it: its own plan.


async def test_the_measures_its_driver_recorded_count_for_their_frontier_only() -> None:
    follows = Recorded()
    digest = frontier_digest(VIEW.chosen, VIEW.times)
    kept = BudgetTiming(job_id="perseus", frontier=digest, options=[
        MeasuredOption(key=-150, relative_time=2.5, power_w=140.0),
        MeasuredOption(key=2, relative_time=2.0, power_w=None)])
    await follows.on_timing(entry(TIMING_PREFIX, "perseus", kept.model_dump_json().encode()))
    assert follows.measured("perseus", digest) == (Served(2, 2.0, None),
                                                   Served(-150, 2.5, 140.0))
    assert follows.measured("perseus", frontier_digest(0, (1.0,))) is None  # planned again
    assert follows.measured("other", digest) is None
    await follows.on_timing(entry(TIMING_PREFIX, "perseus", None, "DEL"))
    assert follows.measured("perseus", digest) is None
