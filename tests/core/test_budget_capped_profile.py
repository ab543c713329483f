"""A Perseus job's frontier planned from a profile a budget's caps throttled is not planned on.

The job profiled (a drift re-profile) while a budget governed its GPUs: its fast clocks ran
throttled, so its new frontier has them cooler than they are. On the 16 x 8 bench the budget
then counted a point of such a frontier at 694 W while it drew 1,024 W, and after the owner's
kill the new owner, planning on it, went over the cap (`budget.capped_profiles`).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.capped_profiles import CappedProfiles
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from zeus_agent.wire.budget import Budget

GPUS = (("n", 0), ("n", 1))
OWN = fo.FrontierView((1.0, 1.3), (280.0, 150.0), (None, None), 0)
"""Its frontier profiled with no budget: its own point draws 280 W per GPU."""
CAPPED = fo.FrontierView((1.0, 1.2), (140.0, 100.0), (None, None), 0)
"""Its frontier profiled under a budget's caps: the same point, counted at half its draw."""


def job(frontier: fo.FrontierView | None) -> enforce.JobView:
    return enforce.JobView("perseus", GPUS, frontier=frontier)


def test_a_frontier_planned_after_rounds_profiling_under_a_budget_is_not_trusted() -> None:
    p = CappedProfiles()
    p.observe([job(OWN)], set())
    assert p.trusted(job(OWN)) == job(OWN)
    p.observe([job(None)], set(GPUS))  # Re-profiling; a budget governs its GPUs.
    p.observe([job(None)], set())  # (The budget lifted before the profile was done.)
    p.observe([job(CAPPED)], set())
    assert p.trusted(job(CAPPED)) == job(None)
    p.observe([job(CAPPED)], set())  # Still that frontier: still not trusted.
    assert p.trusted(job(CAPPED)).frontier is None
    p.observe([job(None)], set())  # Profiled again, no budget anywhere near it.
    p.observe([job(OWN)], set())
    assert p.trusted(job(OWN)) == job(OWN)


def test_a_frontier_appearing_while_a_budget_governs_its_gpus_is_not_trusted() -> None:
    p = CappedProfiles()
    p.observe([job(OWN)], set(GPUS))  # First seen with it: nothing says how it was planned.
    assert p.trusted(job(OWN)) == job(OWN)
    p.observe([job(CAPPED)], set(GPUS))  # Planned again between two rounds, under the caps.
    assert p.trusted(job(CAPPED)).frontier is None


def test_the_same_frontier_seen_again_after_a_round_without_one_is_trusted() -> None:
    """A replica that takes a job over replays it: a round or two without its frontier."""
    p = CappedProfiles()
    p.observe([job(OWN)], set(GPUS))
    p.observe([job(None)], set(GPUS))
    p.observe([job(OWN)], set(GPUS))
    assert p.trusted(job(OWN)) == job(OWN)


def test_rounds_not_observed_leave_nothing_known_of_the_rounds_between() -> None:
    p = CappedProfiles()
    p.observe([job(OWN)], set(GPUS))
    p.unobserved()  # No budget: the loop does not look (the job planned again, no caps).
    p.observe([job(CAPPED)], set(GPUS))
    assert p.trusted(job(CAPPED)) == job(CAPPED)
    p.observe([job(None)], set(GPUS))
    p.observe([job(OWN)], set(GPUS))
    p.unobserved()  # What was found stays found.
    assert p.trusted(job(OWN)).frontier is None
    p.observe([], set())  # The job is gone.
    assert p.untrusted == {} and p.frontiers == {}


def test_a_job_first_seen_without_a_frontier_is_not_profiling_under_the_caps() -> None:
    """Another replica's job, whose frontier its driver records once a budget exists (the
    16 x 8 bench's first event: the owner saw it so and capped it proportionally for the whole
    cut), or a job this replica replays after taking it over."""
    for first in (replace(job(None), remote=True), job(None)):
        p = CappedProfiles()
        p.observe([first], set(GPUS))
        p.observe([first], set(GPUS))
        p.observe([job(OWN)], set(GPUS))
        assert p.trusted(job(OWN)) == job(OWN)


def test_another_replicas_job_planning_again_between_two_governed_rounds_is_not_trusted() -> None:
    theirs = replace(job(None), remote=True)  # (Its record purged while it profiles.)
    p = CappedProfiles()
    p.observe([replace(job(OWN), remote=True)], set(GPUS))
    p.observe([theirs], set(GPUS))
    p.observe([replace(job(CAPPED), remote=True)], set(GPUS))
    assert p.trusted(replace(job(CAPPED), remote=True)).frontier is None


def loop_for(views: list[enforce.JobView]) -> BudgetLoop:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 250.0)
    return BudgetLoop(link=None, book=SimpleNamespace(me="r"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: views, cap_lease_s=10.0, view=BudgetView())


def test_the_owner_caps_such_a_job_proportionally_at_its_cap_not_at_its_frontiers_draw() -> None:
    """Fails on main (50d9958): the share is the capped frontier's own point, at 280 W."""
    budget = Budget(budget_id="grid", cap_w=520.0)
    views = [job(OWN)]
    loop = loop_for(views)
    loop.plan([budget])
    views[0] = job(None)  # Its drift re-profile, under the budget's caps.
    loop.plan([budget])
    views[0] = job(CAPPED)
    loop.plan([budget])
    (share,) = loop.plans["grid"].allocation.shares
    assert share.key is None  # No frontier point: capped proportionally,
    assert share.expected_w == 2 * share.limit_w  # counted at its cap.
    assert "perseus" not in {j.job_id for j in loop.views if j.frontier is not None}


def test_a_frontier_planned_with_no_budget_is_planned_on() -> None:
    budget = Budget(budget_id="grid", cap_w=520.0)
    views = [job(None)]  # Profiling, no budget yet.
    loop = loop_for(views)
    loop.profiles.observe(views, set())
    views[0] = job(OWN)
    loop.plan([budget])
    (share,) = loop.plans["grid"].allocation.shares
    assert share.key is not None
