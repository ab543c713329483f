"""`LimitHistory`: the power limit in force at an event's time, not at the time it is measured."""

from __future__ import annotations

import pytest

from zeus_agent.agent.core import LimitHistory


def test_a_change_after_an_event_is_not_the_limit_it_ran_at() -> None:
    """The defect: the next window's limit, set between an event and its measurement, was
    stamped on the event's mark (the coordinator then redid the window: 'ran at [next] W')."""
    h = LimitHistory()
    h.record(1_000, 300)
    event_t = 5_000
    h.record(6_000, 250)  # the command lands before the event is measured
    assert h.current == 250
    assert h.at(event_t) == 300
    assert h.at(6_000) == 250  # from the change on
    assert h.at(10**12) == 250


def test_nothing_known_before_the_first_change() -> None:
    h = LimitHistory()
    assert h.current is None and h.at(0) is None
    h.record(100, 300)
    assert h.at(99) is None and h.at(100) == 300


def test_unchanged_limits_are_not_recorded() -> None:
    h = LimitHistory(capacity=2)
    h.record(1, 300)
    for t in range(2, 100):
        h.record(t, 300)  # every describe() reads the limit again
    h.record(100, 200)
    assert len(h) == 2
    assert h.at(50) == 300 and h.at(100) == 200


def test_a_change_recorded_late_takes_the_newest_time() -> None:
    h = LimitHistory()
    h.record(100, 300)
    h.record(200, 250)
    h.record(150, 200)  # overlapping commands: the later one counts from the newest time
    assert h.at(199) == 300 and h.at(200) == 200 and h.current == 200


def test_oldest_changes_are_forgotten() -> None:
    h = LimitHistory(capacity=3)
    for i, watts in enumerate((300, 250, 200, 150, 100)):
        h.record(i * 10, watts)
    assert len(h) == 3
    assert h.at(19) is None  # its change was forgotten: unknown, never a wrong limit
    assert [h.at(t) for t in (20, 30, 45)] == [200, 150, 100]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LimitHistory(capacity=0)


def test_unknown_limit_can_be_recorded() -> None:
    h = LimitHistory()
    h.record(1, 300)
    h.record(2, None)
    assert h.at(1) == 300 and h.at(2) is None and h.current is None
