"""`python -m coordinator.pipeline.planner.warm`: the synthetic pipeline it plans takes every
path of the kernels, so `make install` leaves no kernel for a first plan to compile."""

from __future__ import annotations

import pytest

from coordinator.pipeline.planner import plan_frontier
from coordinator.pipeline.planner.warm import synthetic_profile, warm

pytestmark = pytest.mark.core


def test_the_warm_up_plan_carries_rebalances_and_restarts_flows() -> None:
    stats = warm()
    assert stats.iterations > 100
    # A flow from zero, flows carried over, and flows rebalanced after a capacity-scale change:
    # each path of the max flow's kernels ran (and so was compiled).
    assert stats.extra["flows_from_zero"] >= 1
    assert stats.extra["flows_carried"] >= 1
    assert stats.extra["flows_rebalanced"] >= 1


def test_the_synthetic_profile_is_a_frontier_of_slower_and_cheaper_plans() -> None:
    points = plan_frontier(synthetic_profile(stages=2), 4)
    assert len(points) > 2
    times = [p.time for p in points]
    energies = [p.energy for p in points]
    assert times == sorted(times)
    assert energies == sorted(energies, reverse=True)
