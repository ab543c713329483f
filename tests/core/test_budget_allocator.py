"""The budget allocator against brute force: optimal, under the cap, ties broken as documented."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.budget.allocator import (
    Allocation,
    BelowFloorError,
    BudgetError,
    Group,
    Option,
    ProfiledJob,
    UnprofiledJob,
    allocate,
    floor_w,
    uniform_cut,
)


@st.composite
def jobs(draw: st.DrawFn, index: int) -> ProfiledJob:
    """A job with integer-watt options, so 1 W cells make the DP exact and comparable."""
    n = draw(st.integers(1, 4))
    limits = sorted(draw(st.sets(st.integers(100, 300), min_size=n, max_size=n)))
    options = []
    for limit in limits:
        power = draw(st.integers(60, limit))
        time = draw(st.integers(10, 40)) / 10
        options.append(Option(key=limit, time_s=time, power_w=float(power), limit_w=limit))
    optimum = draw(st.sampled_from(limits))
    weight = draw(st.sampled_from([1.0, 1.0, 0.5, 2.0, 3.0]))
    gpus = draw(st.integers(1, 3))
    return ProfiledJob(f"j{index}", gpus, tuple(options), optimum, limits[0], weight)


@st.composite
def groups(draw: st.DrawFn) -> Group:
    n = draw(st.integers(1, 4))
    js = tuple(draw(jobs(i)) for i in range(n))
    idle = float(draw(st.integers(0, 200)))
    floor = floor_w(Group(cap_w=0, jobs=js, idle_w=idle))
    top = idle + sum(j.gpus * max(o.power_w for o in j.options) for j in js)
    cap = float(draw(st.integers(int(floor), max(int(floor), int(top)) + 10)))
    return Group(cap_w=cap, jobs=js, idle_w=idle)


def brute(group: Group) -> tuple[float, float]:
    """(least cost, least draw among the allocations of least cost) by enumeration."""
    offered = []
    for j in group.jobs:
        best = next(o for o in j.options if o.key == j.optimum)
        offered.append(
            [
                (j.weight * max(0.0, o.time_s / best.time_s - 1), j.gpus * o.power_w)
                for o in j.options
                if o.power_w <= best.power_w
            ]
        )
    found: list[tuple[float, float]] = []
    for combo in itertools.product(*offered):
        draw = group.idle_w + sum(p for _, p in combo)
        if draw <= group.cap_w:
            found.append((sum(c for c, _ in combo), draw))
    cost = min(c for c, _ in found)
    return cost, min(d for c, d in found if math.isclose(c, cost, abs_tol=1e-9))


def check_consistent(group: Group, alloc: Allocation) -> None:
    assert alloc.expected_w <= group.cap_w + 1e-9
    assert [s.job_id for s in alloc.shares] == sorted(j.job_id for j in group.jobs)
    total = group.idle_w
    for j in group.jobs:
        share = alloc.by_job[j.job_id]
        option = next(o for o in j.options if o.key == share.key)
        assert share.limit_w == option.limit_w
        total += j.gpus * option.power_w
    assert math.isclose(alloc.expected_w, total)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_optimal_feasible_and_least_draw_on_ties(group: Group) -> None:
    alloc = allocate(group)
    check_consistent(group, alloc)
    optima = group.idle_w + sum(
        j.gpus * o.power_w for j in group.jobs for o in j.options if o.key == j.optimum
    )
    if optima <= group.cap_w:
        assert all(alloc.by_job[j.job_id].key == j.optimum for j in group.jobs)
        return
    cost, draw = brute(group)
    assert math.isclose(alloc.cost, cost, abs_tol=1e-9)
    assert math.isclose(alloc.expected_w, draw, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(groups())
def test_deterministic_and_never_worse_than_the_uniform_cut(group: Group) -> None:
    alloc = allocate(group)
    assert allocate(group) == alloc
    reordered = Group(group.cap_w, tuple(reversed(group.jobs)), idle_w=group.idle_w)
    assert allocate(reordered).shares == alloc.shares
    uniform = uniform_cut(group)
    if uniform.expected_w <= group.cap_w:
        assert alloc.cost <= uniform.cost + 1e-9


@settings(max_examples=100, deadline=None)
@given(groups(), st.integers(2, 64))
def test_coarse_cells_never_exceed_the_cap(group: Group, cells: int) -> None:
    """With few cells the draw is still under the cap, and as good as brute force a bit lower."""
    alloc = allocate(group, max_cells=cells)
    check_consistent(group, alloc)
    slack = alloc.resolution_w * len(group.jobs)
    lower = Group(group.cap_w - slack, group.jobs, idle_w=group.idle_w)
    if lower.cap_w >= floor_w(lower):
        assert alloc.cost <= brute(lower)[0] + 1e-9


def test_a_tie_between_jobs_goes_the_same_way_whatever_their_order() -> None:
    """Two identical jobs, room for one at its optimum: the one whose id sorts first gets it,
    listed first or last (found by hypothesis: the pick followed the group's order)."""
    slow = Option(key=100, time_s=1.1, power_w=60.0, limit_w=100)
    fast = Option(key=101, time_s=1.0, power_w=101.0, limit_w=101)
    jobs = tuple(ProfiledJob(name, 2, (slow, fast), optimum=101, min_limit_w=100)
                 for name in ("j0", "j1"))
    for order in (jobs, jobs[::-1]):
        alloc = allocate(Group(cap_w=400.0, jobs=order))
        assert [(s.job_id, s.key) for s in alloc.shares] == [("j0", 101), ("j1", 100)]


def test_the_budget_never_raises_a_job_above_its_optimum() -> None:
    fast = Option(key=300, time_s=1.0, power_w=280.0, limit_w=300)
    chosen = Option(key=200, time_s=1.2, power_w=190.0, limit_w=200)
    job = ProfiledJob("a", 4, (fast, chosen), optimum=200, min_limit_w=200)
    alloc = allocate(Group(cap_w=10_000.0, jobs=(job,)))
    assert alloc.by_job["a"].key == 200
    assert alloc.cost == 0.0


def test_the_slower_job_is_cut_first_and_weights_matter() -> None:
    def job(name: str, slow_at_low: float, weight: float = 1.0) -> ProfiledJob:
        return ProfiledJob(
            name,
            1,
            (Option(300, 1.0, 300.0, 300), Option(200, slow_at_low, 200.0, 200)),
            optimum=300,
            min_limit_w=200,
            weight=weight,
        )

    group = Group(cap_w=500.0, jobs=(job("a", 1.5), job("b", 1.1)))
    assert allocate(group).by_job["b"].key == 200
    assert allocate(group).by_job["a"].key == 300
    weighted = Group(cap_w=500.0, jobs=(job("a", 1.5), job("b", 1.1, weight=10.0)))
    assert allocate(weighted).by_job["a"].key == 200


def test_below_the_floor_is_refused_with_the_floor() -> None:
    job = ProfiledJob("a", 8, (Option(150, 1.0, 140.0, 150),), 150, min_limit_w=150)
    with pytest.raises(BelowFloorError, match="floor 1250 W") as err:
        allocate(Group(cap_w=1000.0, jobs=(job,), idle_w=50.0))
    assert err.value.floor_w == 1250.0


@pytest.mark.parametrize(
    "group",
    [
        Group(cap_w=float("nan")),
        Group(cap_w=-1.0),
        Group(cap_w=100.0, idle_w=float("inf")),
        Group(cap_w=1e4, jobs=(ProfiledJob("a", 0, (Option(1, 1.0, 1.0, 1),), 1, 1),)),
        Group(cap_w=1e4, jobs=(ProfiledJob("a", 1, (Option(1, 1.0, 1.0, 1),), 2, 1),)),
        Group(cap_w=1e4, jobs=(ProfiledJob("a", 1, (Option(1, 0.0, 1.0, 1),), 1, 1),)),
        Group(cap_w=1e4, unprofiled=(UnprofiledJob("a", 1, 200, 100),)),
    ],
)
def test_bad_groups_are_refused(group: Group) -> None:
    with pytest.raises(BudgetError):
        allocate(group)


def test_unprofiled_jobs_are_capped_proportionally() -> None:
    known = ProfiledJob(
        "a", 2, (Option(300, 1.0, 300.0, 300), Option(150, 2.0, 150.0, 150)), 300, 150
    )
    new = UnprofiledJob("b", 2, min_limit_w=100, max_limit_w=300)
    # Uncapped: 600 + 600 = 1200 W; a 900 W cap is 75 %: the new job's GPUs get 225 W each.
    alloc = allocate(Group(cap_w=900.0, jobs=(known,), unprofiled=(new,)))
    assert alloc.by_job["b"].limit_w == 225
    assert alloc.by_job["b"].expected_w == 450.0
    assert alloc.by_job["a"].key == 150
    assert alloc.expected_w <= 900.0
    # If the profiled job cannot fit beside the proportional share, the new job goes to its minimum.
    tight = allocate(Group(cap_w=520.0, jobs=(known,), unprofiled=(new,)))
    assert tight.by_job["b"].limit_w == 100


def test_uniform_cut_gives_every_gpu_one_limit() -> None:
    def job(name: str, gpus: int) -> ProfiledJob:
        options = tuple(Option(w, 300.0 / w, w * 0.9, w) for w in (300, 250, 200, 150))
        return ProfiledJob(name, gpus, options, 300, 150)

    group = Group(cap_w=1000.0, jobs=(job("a", 2), job("b", 3)))
    uniform = uniform_cut(group)
    assert {s.limit_w for s in uniform.shares} == {200}
    assert uniform.expected_w <= 1000.0


def test_thousands_of_gpus_allocate_with_the_resolution_stated() -> None:
    options = tuple(Option(w, 100.0 / (w**0.5), w * 0.85, w) for w in range(400, 99, -25))
    js = tuple(ProfiledJob(f"j{i:03d}", 8, options, 400, 100, 1.0 + i % 3) for i in range(375))
    top = sum(8 * 400 * 0.85 for _ in js)
    alloc = allocate(Group(cap_w=0.75 * top, jobs=js))
    assert alloc.expected_w <= 0.75 * top
    assert alloc.resolution_w >= 1.0
    assert alloc.cost > 0
