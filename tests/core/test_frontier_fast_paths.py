"""The planner's fast paths give exactly the frontier its plain pieces give.

The sweep runs its loops compiled (`coordinator.pipeline.planner.kernels`: longest paths, the
critical subgraph, capacities, a max flow by Dinic's algorithm started from the last step's
flow, rounding and timing plans, reclaiming slack, shrinking a step and snapping it to the
hulls, the plans on its way), rounds a step's plans in one batch, keeps
every operation's place on its hull and redoes it only for the operations that moved, counts
fitting options by table and walks a longest path back only when its rate is needed. Each has
a plain stand-in (`planner_reference_kit`: Python loops, numpy, scipy's max flow from zero):
with all of them patched in, the frontier (times, energies, plans) and the sweep's counts are
the same, bit for bit, on 1F1B, interleaved, zero-bubble and GPipe schedules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.pipeline.planner import PlannerStats, frontier, kernels, plan_frontier
from coordinator.pipeline.planner.cut import CutNetwork
from coordinator.pipeline.planner.graph import Graph, OptionTable
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.planner.profile_file import load_profile
from coordinator.pipeline.planner.schedules import rank_orders
from tests.core import planner_reference_kit as kit

pytestmark = pytest.mark.core

PROFILES = Path(__file__).resolve().parents[2] / "data" / "perseus" / "stage_profiles"


def run(name: str, schedule: str, microbatches: int,
        virtual: int | None) -> tuple[list[tuple[float, float, object]], PlannerStats]:
    profile = load_profile(PROFILES / f"{name}.csv")
    if schedule == "zero-bubble":
        profile = profile.with_split_backward()
    orders = LearnedSchedule.from_orders(rank_orders(schedule, 8, microbatches, virtual))
    stats = PlannerStats()
    points = plan_frontier(profile, microbatches, stats=stats, schedule=orders)
    return [(p.time, p.energy, p.plan) for p in points], stats


@pytest.mark.parametrize(("name", "schedule", "microbatches", "virtual"), [
    ("gpt3-175b+a40_bf16", "1f1b", 12, None),
    ("bloom+a100_sxm_bf16", "interleaved-1f1b", 6, 2),
    ("bloom+a40_bf16", "zero-bubble", 6, None),
    ("gpt3-175b+a100_sxm_bf16", "gpipe", 6, None),
])
def test_the_fast_paths_change_no_plan(monkeypatch: pytest.MonkeyPatch, name: str,
                                       schedule: str, microbatches: int,
                                       virtual: int | None) -> None:
    fast, fast_stats = run(name, schedule, microbatches, virtual)
    monkeypatch.setattr(CutNetwork, "warm", False)
    monkeypatch.setattr(CutNetwork, "compiled", False)
    monkeypatch.setattr(frontier, "_cut_step", kit.cut_step_in_numpy)
    monkeypatch.setattr(frontier._Candidates, "record_many", kit.record_one_by_one)
    monkeypatch.setattr(frontier._OnHull, "update", kit.place_everyone)
    monkeypatch.setattr(frontier, "_shrink", kit.shrink_in_numpy)
    monkeypatch.setattr(kernels, "on_the_way", kit.on_the_way_in_numpy)
    monkeypatch.setattr(OptionTable, "fitting", kit.fitting_by_comparison)
    monkeypatch.setattr(Graph, "path_rate", kit.tracked_rate)
    monkeypatch.setattr(Graph, "forward", kit.forward_in_python)
    monkeypatch.setattr(Graph, "backward", kit.backward_in_python)
    monkeypatch.setattr(Graph, "plan_times", kit.plan_times_by_level)
    monkeypatch.setattr(Graph, "reclaim_many", kit.reclaim_by_level)
    plain, plain_stats = run(name, schedule, microbatches, virtual)
    assert len(fast) > 20
    assert fast == plain
    assert (fast_stats.iterations, fast_stats.candidates, fast_stats.stopped) == (
        plain_stats.iterations, plain_stats.candidates, plain_stats.stopped)
