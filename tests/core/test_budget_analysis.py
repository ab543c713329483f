"""The grid event's time to the cap, judged on the group's power in bins (pure)."""

from __future__ import annotations

from coordinator.budget import allocator as alloc
from zeus_demo.budget import analysis as an

SIGNAL_S = 10.0
CAP_W = 1000.0


def bins(*watts: float) -> list[tuple[float, float]]:
    """Half-second bins from the signal on (each bin's end time, its power)."""
    return [(SIGNAL_S + 0.5 * (i + 1), w) for i, w in enumerate(watts)]


def test_seconds_to_cap_is_strict_and_first_under_says_what_it_hides() -> None:
    power = [(9.5, 1300.0), *bins(1300, 1200, 990, 980, 995, 1001, 990)]
    assert an.seconds_to_cap(power, CAP_W, SIGNAL_S) == 3.5  # After the last bin over.
    assert an.first_under(power, CAP_W, SIGNAL_S) == {
        "seconds_to_first_under": 1.5, "bins_over_after": 1, "max_over_after_w": 1.0}


def test_a_group_never_under_the_cap_has_neither() -> None:
    power = bins(1300, 1200, 1100)
    assert an.seconds_to_cap(power, CAP_W, SIGNAL_S) is None
    assert an.first_under(power, CAP_W, SIGNAL_S)["seconds_to_first_under"] is None


def test_a_group_that_stays_under_has_no_bin_over_after() -> None:
    power = bins(1100, 900, 950)
    assert an.seconds_to_cap(power, CAP_W, SIGNAL_S) == 1.0
    assert an.first_under(power, CAP_W, SIGNAL_S) == {
        "seconds_to_first_under": 1.0, "bins_over_after": 0, "max_over_after_w": 0.0}


def test_sustained_holds_the_cap_over_windows_and_the_strict_figure_does_not() -> None:
    # Under at 1.5 s, then a bin 1 % over every 2.5 s: each 5 s mean stays under.
    tail = [1010.0 if i % 5 == 4 else 990.0 for i in range(31)]
    power = bins(1300, 1200, 990, *tail)
    assert an.seconds_to_cap(power, CAP_W, SIGNAL_S) == 17.0  # (strict: after the last)
    held = an.sustained(power, CAP_W, SIGNAL_S, SIGNAL_S + 16.5, window_s=5.0)
    assert held["seconds_to_cap_sustained"] == 1.5
    assert held["max_over_sustained_w"] == 0.0


def test_a_window_over_the_cap_moves_the_sustained_figure_past_it() -> None:
    power = bins(1300, 990, *([990.0] * 10), *([1020.0] * 10), *([990.0] * 12))
    held = an.sustained(power, CAP_W, SIGNAL_S, SIGNAL_S + 20.0, window_s=5.0)
    # The 10 bins at 1020 W (7-11.5 s) are a 5 s window over; under again after them.
    assert held["seconds_to_cap_sustained"] == 11.5
    assert held["max_over_sustained_w"] == 0.0
    never = an.sustained(bins(1300, *([1010.0] * 20)), CAP_W, SIGNAL_S, SIGNAL_S + 10.5)
    assert never == {"seconds_to_cap_sustained": None, "max_over_sustained_w": None}


def test_the_judge_on_measured_draws_scales_each_jobs_powers_not_its_times() -> None:
    job = alloc.ProfiledJob("a", 2, (alloc.Option(100, 2.0, 90.0, 100),
                                     alloc.Option(200, 1.0, 180.0, 200)), 200, 100)
    assert an.curve_draw(job) == 360.0
    ratio = an.draw_ratio(324.0, an.curve_draw(job))
    assert ratio == 0.9
    assert an.draw_ratio(None, 360.0) == an.draw_ratio(float("nan"), 360.0) == 1.0
    group = an.scaled_group(alloc.Group(400.0, (job,), (), 50.0), {"a": ratio}, idle_w=40.0)
    (scaled,) = group.jobs
    assert [o.power_w for o in scaled.options] == [81.0, 162.0]
    assert [o.time_s for o in scaled.options] == [2.0, 1.0]
    assert group.idle_w == 40.0 and group.cap_w == 400.0
    # The measured draw fits the cap at the job's optimum (324 + 40 W); on the curves it
    # did not (360 + 50 W), so the optimum judged there lost throughput nobody lost.
    assert alloc.allocate(group).by_job["a"].limit_w == 200
    assert alloc.allocate(alloc.Group(400.0, (job,), (), 50.0)).by_job["a"].limit_w == 100


def test_each_jobs_share_of_the_loss_and_the_room_its_owner_planned_under() -> None:
    a = alloc.ProfiledJob("a", 2, (alloc.Option(100, 2.0, 90.0, 100),
                                   alloc.Option(200, 1.0, 180.0, 200)), 200, 100)
    b = alloc.ProfiledJob("b", 1, (alloc.Option(100, 1.25, 90.0, 100),
                                   alloc.Option(200, 1.0, 180.0, 200)), 200, 100)
    group = alloc.Group(500.0, (a, b))
    rows = an.per_job(group, {"a": 100, "b": 200}, {"a": 200, "b": 100}, {"a": 100, "b": 100})
    assert rows == {"a": [100, 200, 100, 0.5, 0.0], "b": [200, 100, 100, 0.0, 0.2]}
    # Its statuses: r1 planned, then r2 took over at 12 s and gave some room back at 14 s.
    statuses = [(10.0, "r1", 900.0), (11.0, "r1", 900.0), (12.0, "r2", 900.0),
                (13.0, "r2", 900.0), (14.0, "r2", 950.0), (15.0, "r2", 960.0)]
    assert an.room_at(statuses, 14.5) == (950.0, "r2", 12.0)
    assert an.room_at(statuses, 11.0) == (900.0, "r1", 10.0)
    assert an.room_at(statuses, 9.0) is None
