"""The sweep's candidates pruned as it goes (bounded memory) give the same frontier."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.pipeline.planner import PlannerStats, frontier, plan_frontier
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
