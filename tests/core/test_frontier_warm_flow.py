"""Each step's max flow starts from the last step's: the same cuts, so the same frontier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.pipeline.planner import PlannerStats, plan_frontier
from coordinator.pipeline.planner.cut import CutNetwork
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.planner.profile_file import load_profile
from coordinator.pipeline.planner.schedules import rank_orders

pytestmark = pytest.mark.core

PROFILES = Path(__file__).resolve().parents[2] / "data" / "perseus" / "stage_profiles"


@pytest.mark.parametrize(("name", "schedule", "microbatches"), [
    ("gpt3-175b+a40_bf16", "1f1b", 8),
    ("bloom+a100_sxm_bf16", "interleaved-1f1b", 4),
])
def test_warm_started_flows_give_the_same_frontier(
    monkeypatch: pytest.MonkeyPatch, name: str, schedule: str, microbatches: int
) -> None:
    profile = load_profile(PROFILES / f"{name}.csv")
    virtual = None if schedule == "1f1b" else 2
    orders = LearnedSchedule.from_orders(rank_orders(schedule, 8, microbatches, virtual))
    warm_stats = PlannerStats()
    warm = plan_frontier(profile, microbatches, stats=warm_stats, schedule=orders)
    # Most steps start from the last flow carried over; some (a new scale) from it rebalanced.
    assert warm_stats.extra["flows_carried"] > warm_stats.iterations // 2
    assert warm_stats.extra["flows_rebalanced"] > 0
    assert sum(warm_stats.extra[key] for key in (
        "flows_carried", "flows_rebalanced", "flows_from_zero")) == warm_stats.iterations
    monkeypatch.setattr(CutNetwork, "warm", False)
    cold_stats = PlannerStats()
    cold = plan_frontier(profile, microbatches, stats=cold_stats, schedule=orders)
    assert warm_stats.iterations == cold_stats.iterations
    assert [(p.time, p.energy, p.plan) for p in warm] == [
        (p.time, p.energy, p.plan) for p in cold]


def test_a_carried_flow_moves_between_an_operations_arcs_or_starts_from_zero() -> None:
    """An operation whose own arc lost capacity passes that flow to its lower-bound arcs (the
    capacities it gained there); where they cannot take it, or the scale changed, the flow
    starts from zero."""
    network = CutNetwork.__new__(CutNetwork)
    # One operation: its own arc at 0, its lower bound's source arc at 2, sink arc at 4; each
    # reverse right after it.
    own = np.array([[0], [2], [4]])
    network.reverse = np.array([1, 0, 3, 2, 5, 4])
    network.flow = np.array([3, -3, 1, -1, 1, -1])
    network.scale = 1.0
    moved = network._carried(np.array([1, 0, 3, 0, 3, 0]), own, 1.0)
    assert moved.tolist() == [1, -1, 3, -3, 3, -3]
    assert not network._carried(np.array([1, 0, 2, 0, 3, 0]), own, 1.0).any()
    assert network._carried(np.array([3, 0, 1, 0, 1, 0]), own, 1.0).tolist() == [
        3, -3, 1, -1, 1, -1]
    assert not network._carried(np.array([3, 0, 1, 0, 1, 0]), own, 2.0).any()  # Another scale.


def test_the_compiled_max_flow_or_scipys_finds_the_same_cuts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's flow is augmented by the compiled Dinic's algorithm from the carried (or
    rebalanced) flow, or by scipy's max flow: either way the frontier is the same."""
    profile = load_profile(PROFILES / "bloom+a40_bf16.csv")
    compiled = PlannerStats()
    by_kernel = plan_frontier(profile, 6, stats=compiled)
    monkeypatch.setattr(CutNetwork, "compiled", False)
    scipy_stats = PlannerStats()
    by_scipy = plan_frontier(profile, 6, stats=scipy_stats)
    assert compiled.iterations == scipy_stats.iterations
    assert [(p.time, p.energy, p.plan) for p in by_kernel] == [
        (p.time, p.energy, p.plan) for p in by_scipy]
