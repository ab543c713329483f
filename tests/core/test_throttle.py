"""`Throttle`: a flood is reported as a few occurrences, and none is lost from the count."""

from __future__ import annotations

import pytest

from zeus_agent.agent.core import Throttle


def test_the_first_burst_goes_through_then_the_rest_is_held_and_counted() -> None:
    t = Throttle(per_s=2.0, burst=3)
    assert [t.hit(10.0) for _ in range(3)] == [0, 0, 0]
    assert [t.hit(10.0) for _ in range(997)] == [None] * 997
    assert (t.seen, t.held) == (1000, 997)
    # Half a second later one token is back: the next one says how many were held before it.
    assert t.hit(10.5) == 997
    assert (t.seen, t.held) == (1001, 0)
    assert t.hit(10.5) is None


def test_at_most_burst_plus_rate_reports_over_a_flood() -> None:
    t = Throttle(per_s=2.0, burst=3)
    reported, accounted = 0, 0
    for i in range(20_000):  # 20,000 occurrences over 1.5 s
        held = t.hit(i * 1.5 / 20_000)
        if held is not None:
            reported += 1
            accounted += 1 + held
    assert reported <= 3 + 3  # The burst, then 2 per second.
    assert accounted + t.held == t.seen == 20_000


def test_flush_reports_what_a_finished_flood_held_back_once_allowed() -> None:
    t = Throttle(per_s=2.0, burst=1)
    assert t.hit(0.0) == 0
    assert t.hit(0.125) is None and t.hit(0.25) is None
    assert t.flush(0.375) == 0  # No token yet: the summary waits.
    assert t.wait_s(0.375) == 0.125
    assert t.flush(0.5) == 2
    assert (t.held, t.flush(5.0)) == (0, 0)  # Nothing held: nothing to say, no token spent.
    assert t.hit(5.0) == 0


def test_a_clock_going_back_gives_no_tokens() -> None:
    t = Throttle(per_s=1.0, burst=1)
    assert t.hit(100.0) == 0
    assert t.hit(50.0) is None
    assert t.hit(100.5) is None
    assert t.hit(101.0) == 2


@pytest.mark.parametrize(("per_s", "burst"), [(0.0, 1), (float("nan"), 1), (1.0, 0)])
def test_bad_parameters_are_refused(per_s: float, burst: int) -> None:
    with pytest.raises(ValueError):
        Throttle(per_s, burst)
