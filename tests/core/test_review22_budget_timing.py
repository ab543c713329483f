"""An adversarial review of the budgets' measured options (`coordinator.budget.timing`,
`frontier_options._measured`, `BudgetLoop.calibrate`, the loop's woken rounds): each test
reproduces a defect it found (each failed on the code before the fix)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, Governed, GpuInfo
from coordinator.budget.frontier_options import Served
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.points import frontier_points
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import MIN_STEPS, Timing
from zeus_agent.wire.budget import Budget

SETTLE = 3
GPUS = (("n", 0), ("n", 1))


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple = ()


def two_gpu_frontier() -> list[Point]:
    """Three points on 2 GPUs: 1.0 s at 250 W, 1.3 s at 200 W, 1.6 s at 160 W per GPU."""
    return [Point(t, p * t * 2) for t, p in ((1.0, 250.0), (1.3, 200.0), (1.6, 160.0))]


def loop_on(cluster: Cluster, jobs: list[enforce.JobView] | None = None) -> BudgetLoop:
    book = SimpleNamespace(me="replica")
    return BudgetLoop(link=None, book=book, cluster=cluster,  # type: ignore[arg-type]
                      jobs=lambda: list(jobs or ()), cap_lease_s=10.0, view=BudgetView())


def test_overflowing_step_sums_give_no_nan_draw_and_the_budget_still_allocates() -> None:
    """Times and energies are only checked finite and >= 0 at the wire (`Measurement`): two
    steps of 1e308 s and 1e308 J sum to inf / inf, a NaN draw, kept by the smoothing for good;
    `_measured` turns the options' powers NaN, the allocator refuses the whole group, and
    `BudgetLoop.plan` then sends no cap for ANY GPU of the budget (their caps are lifted)."""
    view = fo.view(two_gpu_frontier(), two_gpu_frontier()[0], 2)
    assert view is not None
    cluster = Cluster()  # The Perseus job's 2 GPUs and 2 idle ones, all under one budget.
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(4)})
    for i in range(4):
        cluster.sample("n", i, 200.0)
    history = [(1, 1.3, 260.0)]
    job = enforce.JobView("perseus", GPUS, frontier=view, own_step_s=1.0)
    jobs = [dataclasses.replace(job, step_times=tuple(history))]
    loop = loop_on(cluster, jobs)
    loop.points = {"perseus": (1, 200.0)}  # Told point 1 (the loop's last round).
    budget = Budget(budget_id="grid", cap_w=800.0)
    for _ in range(SETTLE):
        assert len(loop.plan([budget])) == 4
    history += [(2, 1e308, 1e308), (3, 1e308, 1e308)]
    history += [(n, 1.3, 260.0) for n in range(4, 4 + 2 * MIN_STEPS)]  # (2 ranks a step.)
    jobs[0] = dataclasses.replace(job, step_times=tuple(history))
    caps = loop.plan([budget])
    (m,) = loop.timing.measured("perseus")
    assert len(caps) == 4  # Was {} (BudgetError: option power_w nan; every cap lifted).
    assert m.power_w == pytest.approx(200.0)  # The huge steps left out of the draw.


def test_one_huge_step_time_does_not_count_an_option_at_zero_watts() -> None:
    """One step of a huge (finite) time among normal ones: the draw is the energies' sum over
    the times' sum, ~0 W; only the median time is robust. `_measured` clamps a draw to the
    option's limit from above but not from below: the option, and every frontier point
    scaled like it, counts at ~0 W."""
    timing = Timing(SETTLE)
    history = [(1, 1.3, 260.0)]
    for _ in range(SETTLE):
        timing.observe("job", 1, 1.0, history, "f")
    history += [(2, 1.3, 260.0), (3, 1e12, 260.0), (4, 1.3, 260.0)]
    timing.observe("job", 1, 1.0, history, "f")
    (m,) = timing.measured("job")
    assert m.relative_time == pytest.approx(1.3)  # (The median holds.)
    assert m.power_w == pytest.approx(200.0)  # Was ~1e-9 W.


def test_a_point_measured_under_its_plans_draw_is_served_as_the_point_measured() -> None:
    """`_measured` replaces point 1's power by its measured draw (127 W, under the planned
    200 W: the very case the feature is for); `frontier_points` tells the job that power,
    and `pick` then finds point 1 over it and serves the slowest point instead. The loop
    keeps recording the steps under key 1 (`told[0]`): point 2's time and draw are learnt as
    point 1's."""
    frontier = two_gpu_frontier()
    view = fo.view(frontier, frontier[0], 2)
    assert view is not None
    measured = fo.calibrated(view, 1.0, (Served(1, 1.42, 127.0),))
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    job = enforce.JobView("perseus", GPUS, frontier=measured)
    # Room for point 1 as measured (2 x 127 W), not for the fastest point.
    p = enforce.plan(Governed("b", 260.0, 260.0, GPUS), [job], cluster)
    assert p.allocation.by_job["perseus"].key == 1
    index, power = frontier_points([p], [job], {"perseus": 1.0})["perseus"]
    assert index == 1
    assert fo.pick(frontier, 2, index, power) == index  # Was 2 (the slowest point).


def test_a_deeper_cap_never_counts_faster_than_the_slowest_point_as_measured() -> None:
    """The slowest point measured at 3x its own point's time; no cap measured: the throttled
    options keep the model (the slowest point's PLANNED time stretched to the cap), so the
    slowest point's plan under a 150 W cap counts at 1.7 s while uncapped it ran 3.0 s:
    `slowest` starts at 0, not at the last point's time."""
    view = fo.FrontierView(times=(1.0, 1.6), powers=(250.0, 160.0), peaks=(280.0, 170.0),
                           chosen=0)
    measured = fo.calibrated(view, 1.0, (Served(1, 3.0, None),))
    opts = {o.key: o for o in fo.options(measured, 100, 300)}
    assert opts[1].time_s == pytest.approx(3.0)
    assert opts[-150].time_s >= opts[1].time_s  # Was 1.71 < 3.0.


def test_steps_run_while_a_straggler_held_the_job_are_not_learnt_as_the_cap() -> None:
    """While a straggler holds the job (`own_point` False) nothing is measured, but the watch
    and its mark stay: once the straggler goes, the next measure takes every step since the
    settling, the straggler's slow ones included."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    loop = loop_on(cluster)
    view = fo.FrontierView(times=(1.0, 1.6), powers=(250.0, 160.0), peaks=(280.0, 170.0),
                           chosen=0)
    job = enforce.JobView("perseus", GPUS, frontier=view, own_step_s=1.0)
    loop.points = {"perseus": (-125, 125.0)}
    history: list[tuple[int, float, float | None]] = []
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):  # (2 ranks: 2 reports a step.)
        history.append((n + 1, 2.4, 2.4 * 105.0))
        loop.calibrate([dataclasses.replace(job, step_times=tuple(history))])
    (before,) = loop.timing.measured("perseus")
    assert before.relative_time == pytest.approx(2.4)
    for _ in range(10):  # A straggler: 9 s steps.
        history.append((len(history) + 1, 9.0, 9.0 * 105.0))
        loop.calibrate([dataclasses.replace(job, step_times=tuple(history), own_point=False)])
    for _ in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):  # It went: the cap's steps again.
        history.append((len(history) + 1, 2.4, 2.4 * 105.0))
        loop.calibrate([dataclasses.replace(job, step_times=tuple(history))])
    (after,) = loop.timing.measured("perseus")
    assert after.relative_time == pytest.approx(2.4)  # Was 5.7 (the 9 s steps counted).


def test_a_job_whose_step_numbers_start_again_is_measured_again() -> None:
    """`StragglerHandling.steps_timed` lives in the job object: a job restarted (a new
    `PipelineJob`, same frontier, same point told) numbers its steps from 1 again, all under
    the watch's old mark: nothing is measured until it has run that many rank-steps."""
    timing = Timing(SETTLE)
    old = [(n, 1.0, 100.0) for n in range(4000, 4064)]
    for _ in range(SETTLE):
        timing.observe("job", 1, 1.0, old[:10], "f")
    timing.observe("job", 1, 1.0, old, "f")
    assert timing.measured("job")
    timing.served.clear()  # (Only to see whether the new steps are measured.)
    new = [(n, 2.0, 200.0) for n in range(1, 20)]
    for _ in range(SETTLE):  # Numbered from 1 again: settled afresh from there.
        timing.observe("job", 1, 1.0, new[:5], "f")
    timing.observe("job", 1, 1.0, new, "f")
    assert timing.measured("job")  # Was () (1..19 all under the old mark, 4009).


def test_a_woken_round_does_not_count_the_same_samples_as_another_round_over() -> None:
    """`every(..., wake=...)` runs a tick between the grid's (any `budget.>` or
    `budget_lifted.>` entry: another budget set, a lift's bookkeeping, a watch replayed after
    a reconnect); the agents' samples come once a second, so that tick sees the samples the
    last one saw. The tightener counts it as one more round over the room: `OVER_ROUNDS`
    ("samples are noisy") is met by ONE sample, and the backoff takes its excess twice."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    loop = loop_on(cluster)
    budget = Budget(budget_id="grid", cap_w=400.0)
    for i in range(2):
        cluster.sample("n", i, 180.0)
    for _ in range(enforce.SETTLE_ROUNDS + 20):  # Settled under the room, margin released.
        loop.plan([budget])
    tight = loop.tighteners["grid"]
    assert tight.backoff_w == 0.0 and tight.over_rounds == 0
    for i in range(2):  # One grid round's samples: over the room.
        cluster.sample("n", i, 230.0)
    loop.plan([budget])
    assert tight.over_rounds == 1 and tight.backoff_w == 0.0
    loop.plan([budget], counting=False)  # A woken round (`tick`), no new sample.
    assert tight.backoff_w == 0.0 and tight.over_rounds == 1  # Was 68 W (counted twice).
    loop.plan([budget])  # The next round of its own: over again, the backoff takes it.
    assert tight.over_rounds == 2 and tight.backoff_w > 0
