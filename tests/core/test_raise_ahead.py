"""`RaiseAhead`: forecast of the next instruction's begin and the lead a raise is issued with."""

from __future__ import annotations

import pytest

from zeus_agent.agent.core.raise_ahead import EARLY_KEPT, MIN_SAMPLES, RaiseAhead
from zeus_agent.agent.core.schedule import ScheduleCursor

MS = 1_000_000


def test_nothing_is_forecast_before_a_gap_was_seen() -> None:
    r = RaiseAhead()
    assert r.raise_at(0, 0) is None
    r.on_instruction(0, 0)
    assert r.raise_at(0, 0) is None  # The next one has not begun yet.


def test_the_next_begin_is_forecast_from_the_shortest_recent_gap_at_that_position() -> None:
    r = RaiseAhead(min_lead_ns=1 * MS, max_lead_ns=5 * MS)
    t = 0
    for gaps in ([50, 30], [48, 31], [52, 29]):  # positions 0 and 1 of three iterations
        for position, gap in enumerate(gaps):
            r.on_instruction(position, t * MS)
            t += gap
    r.on_instruction(0, t * MS)  # the fourth iteration begins: the third's last gap is known
    assert r.forecast(0, 1000 * MS) == 1048 * MS  # min of 50, 48, 52
    assert r.forecast(1, 1000 * MS) == 1029 * MS  # the wrap to the next iteration's first
    assert r.raise_at(0, 1000 * MS) == 1043 * MS  # max_lead_ns before calibration


def test_only_the_last_gaps_count() -> None:
    r = RaiseAhead()
    t = 0
    for gap in (10, 40, 40, 40):  # one position, a short gap long ago
        r.on_instruction(0, t * MS)
        t += gap
    r.on_instruction(0, t * MS)
    assert r.forecast(0, 0) == 40 * MS


def test_the_lead_is_a_high_quantile_of_the_latencies_plus_slack_clamped() -> None:
    r = RaiseAhead(min_lead_ns=1 * MS, max_lead_ns=10 * MS, quantile=0.9, slack_ns=MS)
    assert r.calibrate([2 * MS] * (MIN_SAMPLES - 1)) == 10 * MS  # too few: the longest lead
    latencies = [1 * MS] * 90 + [3 * MS] * 10
    assert r.calibrate(latencies) == 4 * MS  # p90 = 3 ms, + 1 ms slack
    assert r.calibrate([50 * MS] * 20) == 10 * MS  # capped
    assert r.calibrate([0] * 20) == 1 * MS  # at least the shortest lead
    r.clear()
    assert r.lead_ns == 1 * MS  # a new schedule keeps the calibration


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        RaiseAhead(min_lead_ns=2, max_lead_ns=1)


def test_clear_forgets_the_positions() -> None:
    r = RaiseAhead()
    r.on_instruction(0, 0)
    r.on_instruction(1, 10 * MS)
    r.clear()
    assert r.forecast(0, 0) is None
    r.on_instruction(1, 20 * MS)  # no gap from before the clear
    assert r.forecast(0, 0) is None and r.forecast(1, 0) is None


def test_the_cursor_shows_the_next_pair_without_taking_it() -> None:
    c = ScheduleCursor()
    assert c.next_pair() is None
    c.install(0, [("forward", 1200), ("backward", 1700)])
    assert c.next_pair() == ("forward", 1200)
    c.on_instruction_begin("forward")
    assert c.next_pair() == ("backward", 1700)
    assert c.position == 1  # nothing consumed
    c.on_instruction_begin("other")  # a mismatch is still the event's to report
    assert c.next_pair() == ("forward", 1200)  # used up: the next iteration's first
    assert c.on_step_end() is None
    assert c.next_pair() == ("forward", 1200)


def test_the_lead_grows_by_how_early_instructions_came_against_their_forecast() -> None:
    r = RaiseAhead(min_lead_ns=1 * MS, max_lead_ns=10 * MS, slack_ns=1 * MS)
    latencies = [1 * MS] * MIN_SAMPLES
    t = 0
    for _ in range(4):  # one position, a steady 50 ms: on time, nothing early
        r.on_instruction(0, t)
        t += 50 * MS
    assert r.calibrate(latencies) == 2 * MS  # latency p99 + slack
    r.on_instruction(0, t - 1_300_000)  # 1.3 ms before its forecast (the shortest gap)
    assert r.calibrate(latencies) == 3_300_000
    t -= 1_300_000
    for _ in range(EARLY_KEPT):  # steady again: the early one falls out of the last EARLY_KEPT
        t += 50 * MS
        r.on_instruction(0, t)
    assert r.forecast(0, t) == t + 50 * MS
    assert r.calibrate(latencies) == 2 * MS
