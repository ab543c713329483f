"""`BoundaryForecast`: the last iteration's clock changes, replayed from the current step."""

from __future__ import annotations

from zeus_agent.agent.core.boundaries import BoundaryForecast
from zeus_agent.agent.core.counter_phase import avoid_boundaries

MS = 1_000_000


def iteration(f: BoundaryForecast, begin_ms: int, changes_ms: list[int]) -> None:
    f.on_step_begin(begin_ms * MS)
    for c in changes_ms:
        f.on_clock_change((begin_ms + c) * MS)


def test_nothing_is_due_before_one_iteration_was_seen() -> None:
    f = BoundaryForecast(guard_ns=0)
    assert f.due(0, 10**9) == []
    iteration(f, 0, [10, 40])
    assert f.due(0, 10**9) == []  # The first iteration is not complete yet.


def test_the_last_iterations_changes_are_replayed_from_this_step_and_the_next() -> None:
    f = BoundaryForecast(guard_ns=0)
    iteration(f, 0, [10, 40])
    iteration(f, 100, [12, 41])  # Offsets of this iteration are used from the next one on.
    f.on_step_begin(200 * MS)
    assert f.due(200 * MS, 250 * MS) == [212 * MS, 241 * MS, 312 * MS, 341 * MS]
    assert f.due(220 * MS, 30 * MS) == [241 * MS]  # Only the horizon, only the future.


def test_iterations_gone_by_without_a_step_event_are_skipped() -> None:
    f = BoundaryForecast(guard_ns=0)
    iteration(f, 0, [10])
    f.on_step_begin(100 * MS)
    assert f.due(450 * MS, 100 * MS) == [510 * MS]  # Steps at 400 and 500 not seen yet.


def test_clear_forgets_the_schedule() -> None:
    f = BoundaryForecast(guard_ns=0)
    iteration(f, 0, [10])
    f.on_step_begin(100 * MS)
    f.clear()
    assert f.due(100 * MS, 10**9) == []


def test_each_change_is_guarded_while_it_is_being_issued() -> None:
    f = BoundaryForecast(guard_ns=5 * MS)
    iteration(f, 0, [50])
    f.on_step_begin(100 * MS)
    due = f.due(100 * MS, 100 * MS)
    assert due == [150 * MS, 155 * MS]
    # A read may not start in [change - cost, change + guard]: not even just after the
    # forecast instant, while the agent is issuing the change (its event is on its way).
    start, collides = avoid_boundaries(150 * MS + 1, due, 24 * MS, 100 * MS, 200 * MS)
    assert not collides and (start < 150 * MS - 24 * MS or start > 155 * MS)


def test_a_read_is_moved_off_a_forecast_change() -> None:
    """What the counter reader does with the forecast: no read whose span holds a change."""
    f = BoundaryForecast(guard_ns=0)
    iteration(f, 0, [50])
    f.on_step_begin(100 * MS)
    due = f.due(140 * MS, 250 * MS)
    assert due == [150 * MS, 250 * MS]
    # A read due at 140 ms costing up to 24 ms would hold the driver when the clock changes
    # at 150 ms: it waits until just after it (within the 40 ms it may be postponed).
    start, collides = avoid_boundaries(140 * MS, due, 24 * MS, 139 * MS, 180 * MS)
    assert not collides and start == 150 * MS + 1
    assert all(not start <= b <= start + 24 * MS for b in due)


def test_a_raise_issued_ahead_is_guarded_from_its_lead_on() -> None:
    f = BoundaryForecast(guard_ns=5 * MS)
    f.raise_lead(3 * MS)
    iteration(f, 0, [50])
    f.on_step_begin(100 * MS)
    assert f.due(100 * MS, 100 * MS) == [147 * MS, 150 * MS, 155 * MS]
