"""The sweep's candidates pruned as it goes (bounded memory) give the same frontier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.pipeline.planner import PlannerStats, frontier, plan_frontier
from coordinator.pipeline.planner.dag import Synchronous1F1B, build_dag
from coordinator.pipeline.planner.graph import Graph
from coordinator.pipeline.planner.profile_file import load_profile

pytestmark = pytest.mark.core

PROFILE = (Path(__file__).resolve().parents[2] / "data" / "perseus" / "stage_profiles"
           / "gpt3-175b+a40_bf16.csv")


def test_pruning_dominated_candidates_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_profile(PROFILE)
    whole = PlannerStats()
    expected = plan_frontier(profile, 6, stats=whole)
    monkeypatch.setattr(frontier, "PRUNE_EVERY", 8)
    pruned = PlannerStats()
    got = plan_frontier(profile, 6, stats=pruned)
    assert whole.candidates > 8 * 10  # Pruned many times over.
    assert pruned.candidates == whole.candidates
    assert [(p.time, p.energy, p.plan) for p in got] == [
        (p.time, p.energy, p.plan) for p in expected]


def test_a_duration_an_ulp_past_the_slowest_option_is_recorded() -> None:
    """Seen on 8 x 2 x 96 interleaved: an operation reached its slowest option with a rounding
    error, and the 'slower' rounding indexed past the last option."""
    times = np.array([[1.0, 2.0], [1.0, np.inf]])
    costs = np.array([[5.0, 3.0], [4.0, np.inf]])
    ops = frontier._Ops(np.array([0, 1]), times, costs, times, np.array([2, 1]),
                        np.zeros((2, 2)), np.arange(2), eps_t=1e-9)
    graph = Graph(build_dag(Synchronous1F1B(1, 1)))  # (Two operations; a new plan is timed.)
    candidates = frontier._Candidates(ops, graph, 2, 0.0)
    candidates.record(np.array([np.nextafter(2.0, 3.0), 1.0]), 2.0)
    # Rounded "the other way" it is the same plan: recorded once.
    assert [p.tolist() for p in candidates.plan] == [[1, 0]]
    assert candidates.energy == [7.0]
