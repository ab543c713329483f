"""A Perseus job in a power budget: its frontier as the allocator's options (power per GPU as
the planner counts energy, a node cap at the point's highest instruction power), a tighter cap
giving it a slower point, a lift its own point back, and the job serving the point through its
straggler machinery (every pipeline at that point; the scheduler gets no results meanwhile)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from coordinator.budget import allocator as alloc
from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, Governed, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.points import frontier_points
from coordinator.budget.store import BudgetView
from coordinator.optimizer import InstallSchedules, StatusUpdate
from coordinator.pipeline import budget_point, planner
from coordinator.pipeline.job import PipelineJob
from tests.core.straggler_kit import FRONTIER, Trainer, Watching, make_job
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.budget import Budget


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[tuple[tuple[str, int], ...], ...]


def two_stage(clock: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    return ((("forward", clock), ("backward", clock)), (("forward", clock), ("backward", clock)))


# Two stages on 2 GPUs; energies per iteration of both GPUs (blocking power included).
PIPE = [Point(1.0, 560.0, two_stage(1500)), Point(1.1, 484.0, two_stage(1200)),
        Point(1.3, 390.0, two_stage(1000)), Point(1.7, 340.0, two_stage(800))]
WATTS = {1500: 300.0, 1200: 250.0, 1000: 180.0, 800: 120.0}
"""A forward's power at each clock; a backward draws 10 W more on stage 1."""
ROWS = [(s, kind, mhz, 0.1, 0.1 * (w + (10 * s if kind == "backward" else 0)))
        for s in (0, 1) for mhz, w in WATTS.items() for kind in ("forward", "backward")]


def test_a_frontier_becomes_one_option_per_point_keyed_by_its_index() -> None:
    view = fo.view(PIPE, PIPE[0], gpus=2, rows=ROWS)
    assert view is not None and view.chosen == 0
    assert view.times == (1.0, 1.1, 1.3, 1.7)
    assert view.powers == pytest.approx([280.0, 220.0, 150.0, 100.0])  # E / T / GPUs
    assert view.peaks == pytest.approx([310.0, 260.0, 190.0, 130.0])  # stage 1's backward
    options = fo.options(view, 100, 300)
    assert [o.key for o in options[:4]] == [0, 1, 2, 3]
    # ceil(peak * 5 %) within the GPUs' limits: 310 W * 1.05 is over 300 W.
    assert [o.limit_w for o in options[:4]] == [300, 273, 200, 137]
    assert len(options) == 4  # The slowest point draws the GPUs' minimum already.
    # GPUs that go lower: under the slowest point's 100 W, caps every 25 W down to their
    # minimum, each counted at the cap, at the same energy per iteration.
    throttled = fo.options(view, 50, 300)[4:]
    assert [(o.key, o.limit_w, o.power_w) for o in throttled] == [(-75, 75, 75.0), (-50, 50, 50.0)]
    for o in throttled:
        assert o.power_w * o.time_s == pytest.approx(100.0 * 1.7)
    unknown = fo.view(PIPE, PIPE[1], gpus=2)  # No profile rows: the maximum limit.
    assert unknown is not None and unknown.chosen == 1 and unknown.peaks == (None,) * 4
    # No peak: the points' caps at the maximum; throttled from the slowest one's power.
    assert [(o.key, o.limit_w) for o in fo.options(unknown, 100, 300)] == [
        (1, 300), (2, 300), (3, 300)]  # From its own point on; its 100 W is the minimum.
    assert [o.key for o in fo.options(unknown, 60, 300)][3:] == [-75, -60]
    assert fo.view([], PIPE[0], 2) is None and fo.view(PIPE, PIPE[0], 0) is None
    assert fo.view([Point(0.0, 1.0, two_stage(800))], PIPE[0], 2) is None


def test_a_one_stage_profile_serves_every_stage_and_a_missing_row_gives_no_peak() -> None:
    rows = [(0, k, mhz, 0.1, 20.0) for k in ("forward", "backward") for mhz in (1500, 1200)]
    view = fo.view(PIPE[:2], PIPE[0], gpus=4, rows=rows)
    assert view is not None and view.peaks == pytest.approx([100.0, 100.0])  # 200 W / 2 GPUs
    partial = fo.view(PIPE[:3], PIPE[0], gpus=4, rows=rows)  # 1000 MHz not profiled
    assert partial is not None and partial.peaks[2] is None


def pipeline_job(weight: float = 1.0, min_limit_w: int = 100) -> alloc.ProfiledJob:
    view = fo.view(PIPE, PIPE[0], gpus=2, rows=ROWS)
    assert view is not None
    return fo.profiled_job("perseus", view, 2, min_limit_w, 300, weight)


def power_job(weight: float = 1.0) -> alloc.ProfiledJob:
    options = (alloc.Option(300, 1.0, 280.0, 300), alloc.Option(250, 1.05, 240.0, 250),
               alloc.Option(200, 1.2, 195.0, 200), alloc.Option(150, 1.5, 150.0, 150))
    return alloc.ProfiledJob("dp", 2, options, 300, 150, weight)


def test_fewer_watts_give_the_perseus_job_a_slower_point_and_ample_ones_its_own() -> None:
    jobs = (pipeline_job(), power_job())
    ample = alloc.allocate(alloc.Group(10_000, jobs))
    assert ample.by_job["perseus"].key == 0 and ample.by_job["perseus"].slowdown == 0
    keys = []
    for cap in (1100, 1000, 900, 800, 700):
        a = alloc.allocate(alloc.Group(cap, jobs))
        assert a.expected_w <= cap
        keys.append(a.by_job["perseus"].key)
        share = a.by_job["perseus"]
        option = next(o for o in jobs[0].options if o.key == share.key)
        assert share.expected_w == pytest.approx(2 * option.power_w)
        assert share.slowdown == pytest.approx(option.time_s / PIPE[0].time - 1)
        assert share.limit_w == option.limit_w
    times = [PIPE[0].time * (1 + alloc.allocate(alloc.Group(c, jobs)).by_job["perseus"].slowdown)
             for c in (1100, 1000, 900, 800, 700)]
    assert times == sorted(times) and times[0] < times[-1]  # Fewer watts, a slower point.
    # At 700 W the knapsack's choice beats every allocation a uniform cut could make.
    tight = alloc.allocate(alloc.Group(700, jobs))
    assert tight.cost <= alloc.uniform_cut(alloc.Group(700, jobs)).cost


def test_a_cap_under_the_slowest_points_draw_throttles_it_and_the_job_serves_that_point() -> None:
    jobs = (pipeline_job(min_limit_w=50), power_job(weight=5.0))  # dp's slowdown weighs 5x.
    a = alloc.allocate(alloc.Group(540, jobs))  # dp at 195 W leaves 75 W per pipeline GPU.
    share = a.by_job["perseus"]
    assert a.by_job["dp"].key == 200
    assert a.expected_w <= 540 and share.key is not None and share.key < 0
    assert share.limit_w == -share.key == 75
    assert fo.pick(PIPE, 2, share.key, share.expected_w / 2) == 3  # The slowest point.


def test_a_point_faster_than_the_jobs_own_is_never_offered() -> None:
    view = fo.view(PIPE, PIPE[1], gpus=2, rows=ROWS)
    assert view is not None
    job = fo.profiled_job("perseus", view, 2, 100, 300)
    assert alloc.allocate(alloc.Group(10_000, (job,))).by_job["perseus"].key == 1


def test_pick_serves_the_index_or_the_nearest_point_at_or_under_its_power() -> None:
    assert fo.pick(PIPE, 2, 2, 150.0) == 2
    assert fo.pick(PIPE, 2, 2, 160.0) == 2
    assert fo.pick(PIPE, 2, 7, 160.0) == 2  # Index gone (a re-plan): fastest under 160 W.
    assert fo.pick(PIPE, 2, 1, 160.0) == 2  # Point 1 draws 220 W now: the nearest under.
    assert fo.pick(PIPE, 2, 1, 50.0) == 3  # Nothing under: the least power there is.
    assert fo.pick(PIPE, 2, -150, 900.0) == 3  # A throttled option: the slowest, capped.
    with pytest.raises(ValueError):
        fo.pick([], 2, 0, 100.0)


# ------------------------------------------------------------------ a budget's plan


GPUS = [("n", i) for i in range(4)]


def cluster() -> Cluster:
    c = Cluster()
    c.announce("n", {}, {i: GpuInfo(100, 300) for i in range(4)})
    for key in GPUS:
        c.sample(*key, 280.0)
    return c


def views() -> list[enforce.JobView]:
    frontier = fo.view(PIPE, PIPE[0], gpus=2, rows=ROWS)
    measured = tuple(PowerLimitMeasurement(power_limit=o.limit_w, time=o.time_s,
                                           energy=2 * o.power_w * o.time_s)
                     for o in power_job().options)
    return [enforce.JobView("perseus", (GPUS[0], GPUS[1]), frontier=frontier),
            enforce.JobView("dp", (GPUS[2], GPUS[3]), measured, 300)]


def test_a_budget_caps_the_pipeline_gpus_at_their_points_limit_and_names_the_point() -> None:
    jobs = views()
    ample = enforce.plan(Governed("grid", 5000, 5000, tuple(GPUS)), jobs, cluster())
    assert jobs[0].frontier is not None
    own = jobs[0].frontier.chosen
    # Its own point: told so (its plan stays, capped), no other job is a pipeline's.
    assert frontier_points([ample], jobs) == {"perseus": (own, pytest.approx(
        ample.allocation.by_job["perseus"].expected_w / 2))}
    assert ample.caps[GPUS[0]] == ample.caps[GPUS[1]] == 300
    tight = enforce.plan(Governed("grid", 760, 760, tuple(GPUS)), jobs, cluster())
    share = tight.allocation.by_job["perseus"]
    assert share.key is not None and share.key > 0
    assert jobs[0].frontier is not None
    limit = fo.options(jobs[0].frontier, 100, 300)[share.key].limit_w
    assert tight.caps[GPUS[0]] == tight.caps[GPUS[1]] == limit
    points = frontier_points([tight], jobs)
    assert points == {"perseus": (share.key, pytest.approx(share.expected_w / 2))}
    # A calibrated job is told its planned power: the allocator's over its ratio.
    told = frontier_points([tight], jobs, {"perseus": 1.25})
    assert told == {"perseus": (share.key, pytest.approx(share.expected_w / 2 / 1.25))}
    tighter = enforce.plan(Governed("other", 600, 600, tuple(GPUS)), jobs, cluster())
    both = frontier_points([tight, tighter], jobs)  # Two budgets: the point of least power.
    assert both["perseus"][0] == max(share.key, tighter.allocation.by_job["perseus"].key or 0)


# ------------------------------------------------------------------ the job serves the point


def serving_job() -> tuple[PipelineJob, Trainer]:
    job = make_job(2)
    trainer = Trainer(job)
    trainer.iterate(n=3)  # Discovery, one profiling window, then FRONTIER[0] is served.
    assert job.phase == "serving"
    return job, trainer


def clocks(job: PipelineJob) -> set[int]:
    return {f for s in job.schedules.values() for _, f in s.frequencies}


def clocks_by_pipeline(job: PipelineJob) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for rank, schedule in job.schedules.items():
        out.setdefault(job.rank_infos[rank].dp_rank, set()).update(
            f for _, f in schedule.frequencies)
    return out


def seen(job: PipelineJob) -> int:
    """Result windows the scheduler was given while serving."""
    assert isinstance(job.scheduler, Watching)
    return job.scheduler.seen


def test_the_job_serves_the_budgets_point_on_every_pipeline_and_its_own_after_the_lift() -> None:
    job, trainer = serving_job()
    view = budget_point.frontier_of(job)
    assert view is not None and view.chosen == 0 and len(view.times) == len(FRONTIER)
    assert view.powers[2] == pytest.approx(80.0 / 1.5 / 4)  # 2 stages x 2 pipelines
    before, version = seen(job), job.version
    actions = budget_point.serve(job, (2, view.powers[2]))
    (install,) = [a for a in actions if isinstance(a, InstallSchedules)]
    assert install.version == version + 1 and clocks(job) == {1000}
    status = [a for a in actions if isinstance(a, StatusUpdate)][-1]
    assert status.state == "serving" and "power budget" in status.message
    assert budget_point.serve(job, (2, view.powers[2])) == []  # Told again: nothing new.
    trainer.iterate({0: 1.5, 1: 1.5}, n=4)  # Slower, as planned: no straggler, no results.
    assert seen(job) == before and job.detected == {}
    still = budget_point.frontier_of(job)
    assert still is not None and still.chosen == 0  # Its own choice, the budget's aside.
    actions = budget_point.serve(job, None)
    assert [a for a in actions if isinstance(a, InstallSchedules)] and clocks(job) == {1500}
    assert job.straggling.budget is None
    trainer.iterate(n=2)
    assert seen(job) > before
    assert budget_point.serve(job, None) == []


def test_a_budget_that_leaves_the_job_its_own_point_holds_the_drift_watch_until_it_lifts(
) -> None:
    job, trainer = serving_job()
    view = budget_point.frontier_of(job)
    assert view is not None
    before, version = seen(job), job.version
    assert budget_point.serve(job, (view.chosen, view.powers[view.chosen])) == []
    assert job.version == version and job.straggling.budget is None  # Its plan, unchanged,
    assert job.straggling.holding()  # but capped: the tightener may throttle it.
    trainer.iterate({0: 1.3, 1: 1.3}, n=4)  # Throttled by the cap: no drift, no results.
    assert seen(job) == before and job.phase == "serving"
    assert budget_point.serve(job, None) == []  # Lifted: nothing to install,
    assert not job.straggling.holding()
    trainer.iterate(n=2)
    assert seen(job) > before  # and its times are the plan's again.


def test_a_straggler_under_a_budget_slows_the_others_past_the_budgets_point() -> None:
    job, _ = serving_job()
    budget_point.serve(job, (1, 90.0 / 1.2 / 4))
    assert clocks(job) == {1200}
    job.set_straggler(1, 1.5)  # 1.2 s x 1.5 x 0.98 = 1.76 s: the 1.5 s point, 1000 MHz.
    assert clocks_by_pipeline(job) == {0: {1000}, 1: {1200}}  # The straggler: the budget's.
    budget_point.serve(job, None)  # 1.0 s x 1.5 x 0.98 = 1.47 s: the 1.2 s point.
    assert clocks_by_pipeline(job) == {0: {1200}, 1: {1500}}  # The straggler: the chosen one.


def test_a_job_not_serving_a_frontier_has_none_and_a_point_changes_nothing() -> None:
    job = make_job(2)
    assert budget_point.frontier_of(job) is None
    assert budget_point.serve(job, (1, 10.0)) == []


def test_a_uniform_cut_keeps_the_fastest_point_its_limit_does_not_throttle() -> None:
    unknown = fo.view(PIPE, PIPE[0], gpus=2)  # No peaks: every point capped at 300 W.
    assert unknown is not None
    job = fo.profiled_job("perseus", unknown, 2, 50, 300)
    ample = alloc.uniform_cut(alloc.Group(10_000, (job,)))
    assert ample.by_job["perseus"].key == 0  # Not the slowest of the points at 300 W.
    tight = alloc.uniform_cut(alloc.Group(150, (job,)))  # Throttled under its slowest point.
    share = tight.by_job["perseus"]
    assert share.key is not None and share.key < 0 and tight.expected_w <= 150


def test_under_its_slowest_point_a_planned_frontier_is_throttled_as_the_planner_counts_it(
        ) -> None:
    clocks = {1500: (0.10, 300.0), 1200: (0.12, 220.0), 1000: (0.15, 160.0), 800: (0.2, 120.0)}
    rows = [(s, kind, mhz, t * (2 if kind == "backward" else 1),
             t * (2 if kind == "backward" else 1) * w)
            for s in (0, 1) for kind in ("forward", "backward") for mhz, (t, w) in clocks.items()]
    profile = planner.InstructionProfile.from_rows(rows)
    frontier = planner.plan_frontier(profile, 4, num_stages=2, p_block_w=60.0)

    def evaluate(plan: object) -> tuple[float, float]:
        return planner.evaluate(profile, plan, 4, 60.0)  # type: ignore[arg-type]

    view = fo.view(frontier, frontier[0], 2, rows, evaluate)
    assert view is not None and view.peaks[0] == 300.0 and view.peaks[-1] == 160.0
    # 150 W: every 1000 MHz instruction of the slowest plan drops to 800 MHz (120 W).
    (th,) = view.throttled
    slowest = [tuple((n, 800) for n, _ in row) for row in frontier[-1].plan]
    time, energy = planner.evaluate(profile, slowest, 4, 60.0)
    assert (th.cap_w, th.time_s, th.power_w, th.peak_w) == (
        150, pytest.approx(time), pytest.approx(energy / time / 2), 120.0)
    options = fo.options(view, 100, 300)
    assert [(o.key, o.limit_w) for o in options[len(frontier):]] == [(-150, 150), (-100, 100)]
    below = options[-1]  # Under its 108 W: at the cap, the same energy per iteration.
    assert below.power_w == 100 and below.power_w * below.time_s == pytest.approx(
        th.power_w * th.time_s)
    # Calibrated by a job drawing 1.5x its plan: the 150 W plan would draw 162 W, over its
    # cap; the GPUs draw 150 W at most and take longer for the same energy.
    hot = fo.options(fo.calibrated(view, 1.5), 100, 300)
    capped = next(o for o in hot if o.key == -150)
    assert capped.power_w == 150.0 and capped.power_w * capped.time_s == pytest.approx(
        1.5 * th.power_w * th.time_s)
    assert all(o.power_w <= o.limit_w for o in hot if o.key < 0)


class Profiled(Watching):
    """`Watching` with what Perseus keeps of its plan: its profile, microbatches, P_block."""

    profile_rows = [(s, kind, mhz, 0.1, 0.1 * w) for s in (0, 1)
                    for kind in ("forward", "backward")
                    for mhz, w in ((1500, 290.0), (1200, 220.0), (1000, 170.0), (900, 140.0),
                                   (800, 100.0))]
    num_microbatches = 2
    p_block_used = 50.0


def test_a_served_perseus_frontier_brings_its_throttled_plans() -> None:
    job = make_job(2, scheduler=Profiled)
    Trainer(job).iterate(n=3)
    view = budget_point.frontier_of(job)
    assert view is not None and view.peaks == (145.0, 110.0, 85.0, 70.0)  # 2 pipelines
    # The slowest plan (900 MHz, 70 W per GPU) under a 50 W cap: at 800 MHz, as planned.
    (th,) = view.throttled
    at_800 = planner.evaluate(planner.InstructionProfile.from_rows(Profiled.profile_rows),
                              [tuple((n, 800) for n, _ in row) for row in FRONTIER[-1].plan],
                              2, 50.0)
    assert (th.cap_w, th.peak_w) == (50, 50.0)
    assert (th.time_s, th.power_w) == pytest.approx((at_800[0], at_800[1] / at_800[0] / 4))
    assert budget_point.frontier_of(job) is view  # Read again: the same (kept) view.


def test_a_plan_kept_under_caps_slows_as_its_instructions_are_throttled() -> None:
    clocks = {1500: (0.10, 300.0), 1200: (0.12, 220.0), 1000: (0.15, 160.0)}
    rows = [(s, kind, mhz, t, t * w) for s in (0, 1) for kind in ("forward", "backward")
            for mhz, (t, w) in clocks.items()]
    profile = planner.InstructionProfile.from_rows(rows)
    plan = planner.max_frequency_plan(profile, 2)

    def evaluate(p: object) -> tuple[float, float]:
        return planner.evaluate(profile, p, 2, 50.0)  # type: ignore[arg-type]

    options = fo.under_caps(plan, rows, 2, evaluate, 100, 300)
    assert [o.limit_w for o in options] == list(range(300, 99, -25))
    top = evaluate(plan)
    at_1200, at_1000 = (evaluate([[(n, f) for n, _ in row] for row in plan]) for f in (1200, 1000))
    assert (options[0].time_s, options[0].power_w) == pytest.approx((top[0], top[1] / top[0] / 2))
    assert options[3].limit_w == 225 and options[3].time_s == pytest.approx(at_1200[0])
    assert options[4].limit_w == 200 and options[4].time_s == pytest.approx(at_1000[0])
    # Under 160 W, its lowest clocks' power: the same energy per iteration, scaled.
    lowest = options[6]
    assert lowest.limit_w == 150 and lowest.power_w * lowest.time_s == pytest.approx(
        options[5].power_w * options[5].time_s)
    assert [o.time_s for o in options] == sorted(o.time_s for o in options)


def test_a_long_frontier_offers_a_few_dozen_points_spread_in_power() -> None:
    frontier = [Point(1.0 + i / 100, 300.0 - i, two_stage(1500)) for i in range(200)]
    view = fo.view(frontier, frontier[10], gpus=1)
    assert view is not None
    kept = fo.offered(view)
    assert len(kept) <= fo.MAX_POINTS and kept == sorted(set(kept))
    assert kept[0] == 10 and kept[-1] == 199  # Its own point and the slowest.
    steps = [view.powers[a] - view.powers[b] for a, b in zip(kept, kept[1:], strict=False)]
    assert max(steps) < 2 * (view.powers[10] - view.powers[199]) / (fo.MAX_POINTS - 1)
    assert [o.key for o in fo.options(view, 1, 1000)][:len(kept)] == kept
    short = fo.view(PIPE, PIPE[0], 2)
    assert short is not None and fo.offered(short) == [0, 1, 2, 3]  # Short: every point.


def test_a_frontier_is_calibrated_by_the_draw_measured_at_its_own_point() -> None:
    view = fo.view(PIPE, PIPE[0], gpus=2, rows=ROWS)
    assert view is not None
    assert fo.own_ratio(view, 336.0) == pytest.approx(1.2)  # 280 W planned
    assert fo.own_ratio(view, 30.0) is None  # Idle GPUs: nothing learnt.
    scaled = fo.calibrated(view, 1.2)
    assert scaled.powers == pytest.approx([p * 1.2 for p in view.powers])
    assert scaled.peaks == pytest.approx([p * 1.2 for p in view.peaks if p is not None])
    assert (scaled.times, scaled.chosen) == (view.times, view.chosen)
    assert fo.calibrated(view, 1.0) is view


def test_the_loop_learns_the_ratio_at_the_jobs_own_point_and_keeps_it_under_a_budget() -> None:
    loop = BudgetLoop(link=None, book=None, cluster=cluster(), jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    job = views()[0]  # Its own point: 280 W per GPU planned; the cluster samples 280 W.
    for key in job.gpus:
        loop.cluster.sample(*key, 336.0)
    (seen,) = [j for j in loop.calibrate([job]) if j.job_id == "perseus"]
    assert loop.ratios == {"perseus": pytest.approx(1.2)}
    assert seen.frontier is not None and seen.frontier.powers[0] == pytest.approx(336.0)
    loop.points = {"perseus": (2, 150.0)}  # Told a budget's point: its draw says nothing new.
    for key in job.gpus:
        loop.cluster.sample(*key, 200.0)
    loop.calibrate([job])
    assert loop.ratios == {"perseus": pytest.approx(1.2)}
    loop.points = {"perseus": (0, 280.0)}  # Its own point under a budget: capped, perhaps
    for _ in range(enforce.SETTLE_ROUNDS + 2):  # throttled: its samples say nothing new.
        loop.calibrate([job])
    assert loop.ratios == {"perseus": pytest.approx(1.2)}
    loop.points = {}  # No budget: its own point, uncapped.
    for _ in range(enforce.SETTLE_ROUNDS):  # (The samples still show the caps it left.)
        loop.calibrate([job])
    assert loop.ratios == {"perseus": pytest.approx(1.2)}
    loop.calibrate([job])  # Drawing 200 W: the ratio moves a fifth.
    assert loop.ratios["perseus"] == pytest.approx(0.8 * 1.2 + 0.2 * 200 / 280)
    loop.calibrate([])  # The job gone: its ratio too.
    assert loop.ratios == {}


def test_a_replica_not_owning_the_budgets_holds_its_governed_pipeline_jobs_at_their_own_point(
) -> None:
    jobs = views()
    loop = BudgetLoop(link=None, book=None, cluster=cluster(), jobs=lambda: jobs,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    grid = Budget(budget_id="grid", cap_w=900.0)
    assert jobs[0].frontier is not None
    held = loop.held_here([grid], jobs)  # The owner caps them: kept on their plan, held.
    assert held == {"perseus": (jobs[0].frontier.chosen, float("inf"))}
    assert loop.held_here([], jobs) == {}  # No budget: nothing held.
    loop.points = {"perseus": (2, 150.0)}  # Told while this replica owned the budgets:
    assert loop.held_here([grid], jobs) == {"perseus": (2, 150.0)}  # kept, not back to its own.
    job, _ = serving_job()
    view = budget_point.frontier_of(job)
    assert view is not None
    budget_point.serve(job, held["perseus"])
    assert job.straggling.holding() and job.straggling.budget is None


def test_a_takeover_numbers_its_schedules_above_the_budget_points_installed_before() -> None:
    """Budget points are installed as schedule versions the replayed rounds do not make: a new
    owner numbers above the last version installed (trainers take only a higher one), not
    from what its replay reached."""
    job, _ = serving_job()
    view = budget_point.frontier_of(job)
    assert view is not None and job.version is not None
    budget_point.serve(job, (2, view.powers[2]))
    budget_point.serve(job, (3, view.powers[3]))  # The cap tightened: another point.
    installed = job.version
    state = json.loads(json.dumps(job.persisted()))  # (What the state bucket holds.)
    new = make_job(2, resume=state)
    (install,) = [a for a in new.start() if isinstance(a, InstallSchedules)]
    assert install.version > installed
    actions = budget_point.serve(new, (3, view.powers[3]))  # The budget loop tells it again.
    (again,) = [a for a in actions if isinstance(a, InstallSchedules)]
    assert again.version == install.version + 1 and clocks(new) == clocks(job)
