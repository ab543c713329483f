"""The grid event's time to the cap, judged on the group's power in bins (pure)."""

from __future__ import annotations

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
