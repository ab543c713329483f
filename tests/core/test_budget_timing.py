"""A Perseus job's throttled options measured: the step times its ranks report under a
budget's caps, over those at its own point, and its GPUs' draw replace the model's time and
power for the cap it served, and scale the deeper caps' alike (`coordinator.budget.timing`,
`frontier_options`)."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.frontier_options import Served
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import MIN_STEPS, RELATIVE_RANGE, Timing
from coordinator.pipeline import budget_point
from tests.core.straggler_kit import Trainer, make_job

SETTLE = 3


def served(key: int, relative: float, power: float | None) -> Served:
    """A measure as `rounded` gives it."""
    return Served(key, relative, power)


def rounded(measures: tuple[Served, ...]) -> tuple[Served, ...]:
    """Measures with their time and draw rounded (float sums in another order differ)."""
    return tuple(Served(m.key, round(m.relative_time, 9),
                        None if m.power_w is None else round(m.power_w, 9)) for m in measures)


def steps(first: int, times: list[float], watts: float | None = 110.0
          ) -> list[tuple[int, float, float | None]]:
    """Steps numbered from `first`, each drawing `watts` (None: no energy measured)."""
    return [(first + i, t, None if watts is None else t * watts) for i, t in enumerate(times)]


def test_a_throttled_cap_is_measured_once_settled_from_the_steps_run_after() -> None:
    timing = Timing(SETTLE)
    history = steps(1, [1.0] * 10)
    for _ in range(SETTLE):  # The steps reported while settling still ran the old option.
        timing.observe("job", -125, 1.0, history)
    assert timing.measured("job") == ()
    history += steps(11, [1.9, 2.1])
    timing.observe("job", -125, 1.0, history)
    assert timing.measured("job") == ()  # Fewer than MIN_STEPS after the mark.
    history += steps(13, [2.0] * (MIN_STEPS - 2))
    timing.observe("job", -125, 1.0, history)
    assert rounded(timing.measured("job")) == (served(-125, 2.0, 110.0),)
    # Measured again: smoothed with what was known.
    timing.observe("job", -125, 1.0, history + steps(100, [3.0] * 50, 130.0))
    drawn_since = (6 * 110.0 + 150 * 130.0) / 156  # Every step since the settling, by energy.
    both = round((110.0 + drawn_since) / 2, 9)
    assert rounded(timing.measured("job")) == (served(-125, 2.5, both),)


def test_only_options_other_than_its_own_with_a_known_own_time_are_measured() -> None:
    timing = Timing(SETTLE)
    slow = steps(1, [5.0] * 20, None)
    for key, own in ((None, 1.0), (-150, None), (-150, 0.0)):
        for _ in range(SETTLE + 2):
            timing.observe("job", key, own, slow)
    assert timing.measured("job") == ()
    # A change of option starts the settling again; the measure is clamped to its range.
    for _ in range(SETTLE):
        timing.observe("job", -100, 0.1, slow)
    timing.observe("job", -100, 0.1, slow + steps(21, [5.0] * MIN_STEPS, None))
    # (No energy measured: the model's draw stands.)
    assert timing.measured("job") == (Served(-100, RELATIVE_RANGE[1], None),)
    timing.forget({"other"})
    assert timing.measured("job") == ()


# One job on 2 GPUs, its chosen point 1.0 s; the slowest point 1.6 s at 160 W per GPU.
VIEW = fo.FrontierView(times=(1.0, 1.6), powers=(250.0, 160.0), peaks=(280.0, 170.0),
                       chosen=0)


def throttled(view: fo.FrontierView) -> dict[int, float]:
    return {-o.key: o.time_s for o in fo.options(view, 100, 300) if o.key < 0}


def drawn(view: fo.FrontierView) -> dict[int, float]:
    return {-o.key: o.power_w for o in fo.options(view, 100, 300) if o.key < 0}


def test_a_measured_cap_counts_at_its_time_and_deeper_caps_scale_alike() -> None:
    model = throttled(VIEW)
    assert sorted(model) == [100, 125, 150]
    assert model[125] == pytest.approx(1.6 * 160 / 125)  # Same energy, at the cap.
    assert drawn(VIEW) == {150: 150.0, 125: 125.0, 100: 100.0}  # Counted at the cap.
    measured = fo.calibrated(VIEW, 1.0, (Served(-125, 2.4, 100.0),))
    timed = throttled(measured)
    assert timed[150] == model[150]  # Above every measured cap: the model.
    assert timed[125] == pytest.approx(2.4)  # 2.4 x the chosen point's 1.0 s.
    assert timed[100] == pytest.approx(model[100] * 2.4 / model[125])
    # It drew 100 W under its 125 W cap: counted at that, and 100 W's at 80 W.
    assert drawn(measured) == {150: 150.0, 125: pytest.approx(100.0), 100: pytest.approx(80.0)}
    # A draw over the cap counts at the cap; the frontier's own points keep their options.
    assert drawn(fo.calibrated(VIEW, 1.0, (Served(-125, 2.4, 140.0),)))[125] == 125.0
    assert [o for o in fo.options(VIEW, 100, 300) if o.key >= 0] == [
        o for o in fo.options(measured, 100, 300) if o.key >= 0]


def test_a_deeper_cap_never_counts_faster_than_a_shallower_one() -> None:
    # 150 W measured slow, 100 W measured as the model: 100 W still counts at least 150 W's.
    timed = throttled(fo.calibrated(VIEW, 1.0, (Served(-150, 3.0, None),
                                                 Served(-100, 1.0, None))))
    assert timed[150] == pytest.approx(3.0)
    assert timed[125] == pytest.approx(throttled(VIEW)[125] * 3.0 / throttled(VIEW)[150])
    assert timed[100] >= timed[125] >= timed[150]
    # A measured cap the options do not have (another GPU range) is left out.
    assert throttled(fo.calibrated(VIEW, 1.0, (Served(-90, 9.0, 10.0),))) == throttled(VIEW)


def test_a_serving_job_keeps_its_step_times_and_those_of_its_own_point() -> None:
    job = make_job(2)
    trainer = Trainer(job)
    trainer.iterate(n=3)  # Discovery, one profiling window, then the chosen point served.
    assert job.phase == "serving"
    trainer.iterate(n=3)
    handling = job.straggling
    assert handling.own_step_s() == pytest.approx(1.05)  # Each step: 1 s + the all-reduce.
    assert handling.own_draw_w() == pytest.approx(10.0 / 1.05)  # 10 J a step, every rank.
    timed = handling.steps_timed
    view = budget_point.frontier_of(job)
    assert view is not None
    budget_point.serve(job, (-100, 100.0))  # A throttled option: the slowest point, capped.
    trainer.iterate({0: 2.0, 1: 2.0}, n=3)
    assert handling.steps_timed == timed + 3 * len(job.rank_infos)
    assert [(t, e) for _, t, e in handling.step_times][-3:] == [(pytest.approx(2.05), 10.0)] * 3
    assert handling.own_step_s() == pytest.approx(1.05)  # Held: not its own point's.


def test_the_loop_times_the_throttled_option_it_told_and_the_next_allocation_sees_it() -> None:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    loop = BudgetLoop(link=None, book=None, cluster=cluster, jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    job = enforce.JobView("perseus", (("n", 0), ("n", 1)), frontier=VIEW, own_step_s=1.0)
    loop.points = {"perseus": (-125, 125.0)}
    for gpu in job.gpus:  # (Its power samples say more; the draw is the energy's.)
        cluster.sample(*gpu, 150.0)
    history: list[tuple[int, float, float | None]] = []
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):  # One rank's step a round (of 2).
        history.append((n + 1, 2.4, 2.4 * 105.0))
        (seen,) = loop.calibrate([dataclasses.replace(job, step_times=tuple(history))])
    assert rounded(loop.timing.measured("perseus")) == (served(-125, 2.4, 105.0),)
    assert seen.frontier is not None and throttled(seen.frontier)[125] == pytest.approx(2.4)
    assert drawn(seen.frontier)[125] == pytest.approx(105.0)
    # A straggler moving the job: its times are not the cap's alone; nothing more is learnt.
    for _ in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):
        history.append((len(history) + 1, 9.0, 9.0 * 105.0))
        loop.calibrate([dataclasses.replace(job, step_times=tuple(history), own_point=False)])
    assert rounded(loop.timing.measured("perseus")) == (served(-125, 2.4, 105.0),)
    loop.calibrate([])  # The job gone: what was measured of it too.
    assert loop.timing.measured("perseus") == ()


def test_a_frontier_point_served_counts_at_its_measured_time_and_draw() -> None:
    # Point 1 (the slowest, 1.6 s planned) ran 2.0 s, drawing 130 W per GPU.
    measured = fo.calibrated(VIEW, 1.0, (Served(1, 2.0, 130.0),))
    model = {o.key: o for o in fo.options(VIEW, 100, 300)}
    timed = {o.key: o for o in fo.options(measured, 100, 300)}
    assert (timed[1].time_s, timed[1].power_w) == pytest.approx((2.0, 130.0))
    assert timed[0] == model[0]  # Its own point: the plan's.
    # The throttled options run its plan under caps: never faster than it as measured.
    assert model[-150].time_s < 2.0 and timed[-150].time_s == pytest.approx(2.0)
    assert [timed[k].power_w for k in (-150, -125, -100)] == [150.0, 125.0, 100.0]


def test_the_draw_at_its_own_point_from_its_energies_calibrates_its_frontier() -> None:
    """Learnt from the ranks' energies while nothing held the job: not from samples taken
    while a budget's caps may throttle it at its own point."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for gpu in range(2):
        cluster.sample("n", gpu, 150.0)  # Throttled by a budget at its own point.
    loop = BudgetLoop(link=None, book=None, cluster=cluster, jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    loop.points = {"perseus": (0, 250.0)}
    job = enforce.JobView("perseus", (("n", 0), ("n", 1)), frontier=VIEW, own_draw_w=275.0)
    for _ in range(enforce.SETTLE_ROUNDS + 2):
        (seen,) = loop.calibrate([job])
    assert loop.ratios == {"perseus": pytest.approx(1.1)}  # 275 W over the planned 250 W.
    assert seen.frontier is not None and seen.frontier.powers[0] == pytest.approx(275.0)
    # Without its energies (a replica that took it over under the budget): no ratio from
    # samples under the caps (0.6 here, its points' limits set too low), the plan's own.
    loop.ratios = {}
    for _ in range(enforce.SETTLE_ROUNDS + 2):
        (seen,) = loop.calibrate([dataclasses.replace(job, own_draw_w=None)])
    assert loop.ratios == {} and seen.frontier == VIEW
    loop.points = {}  # No budget any more: its samples at its own point are its draw.
    for _ in range(enforce.SETTLE_ROUNDS + 1):
        loop.calibrate([dataclasses.replace(job, own_draw_w=None)])
    assert loop.ratios == {"perseus": pytest.approx(0.6)}


def test_what_was_measured_of_a_frontier_goes_when_the_job_plans_another() -> None:
    timing = Timing(SETTLE)
    history = steps(1, [2.0] * 20)
    for _ in range(SETTLE):
        timing.observe("job", 3, 1.0, history, frontier="first")
    history += steps(21, [2.0] * MIN_STEPS)
    timing.observe("job", 3, 1.0, history, frontier="first")
    assert [m.key for m in timing.measured("job")] == [3]
    timing.observe("job", 3, 1.0, history, frontier="first")  # The same frontier: kept.
    assert [m.key for m in timing.measured("job")] == [3]
    timing.observe("job", 3, 1.0, history, frontier="second")  # Point 3 is another point now.
    assert timing.measured("job") == ()


def test_points_not_measured_take_the_nearest_measured_points_error() -> None:
    """The model's error at a point (clock changes it does not see) is its neighbours' too:
    without it the allocator would move the job from one optimistic point to the next."""
    view = fo.FrontierView(times=(1.0, 1.1, 1.2, 1.3, 1.4),
                           powers=(250.0, 230.0, 210.0, 190.0, 170.0),
                           peaks=(280.0, 260.0, 240.0, 220.0, 200.0), chosen=1)
    measured = fo.calibrated(view, 1.0, (Served(3, 1.3 * 1.5 / 1.1, 152.0),))
    model = {o.key: o for o in fo.options(view, 100, 300)}
    timed = {o.key: o for o in fo.options(measured, 100, 300)}
    assert timed[3].time_s == pytest.approx(1.3 * 1.5) and timed[3].power_w == 152.0
    for key in (2, 4):  # 1.5x the model's time, 0.8x its draw, as point 3 measured.
        assert timed[key].time_s == pytest.approx(model[key].time_s * 1.5)
        assert timed[key].power_w == pytest.approx(model[key].power_w * 0.8)
    assert timed[1] == model[1]  # Its own point: the plan's.
    assert 0 not in timed  # (Faster than its own: never offered.)
