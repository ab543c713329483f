"""`JobDriver`'s methods: what the service's modules call instead of writing its fields.

The once-only ones (a status or a warning said once) and the progress kept until JetStream has
it are where a slip would show only under a stream leader election or a stalled replica.
"""

from __future__ import annotations

from coordinator.service.driver import JobDriver


def test_a_start_blocks_another_until_it_ends() -> None:
    driver = JobDriver("job")
    driver.begin_start()
    assert driver.starting
    driver.start_ended()
    assert not driver.starting


def test_waiting_for_agents_is_said_once_and_moves_the_retry() -> None:
    driver = JobDriver("job")
    assert driver.wait_for_agents(10.0) is True
    assert driver.wait_for_agents(20.0) is False
    assert driver.retry_at == 20.0 and not driver.may_start(15.0)


def test_progress_is_kept_until_saved_unless_newer_came_meanwhile() -> None:
    driver = JobDriver("job")
    driver.remember_progress({})
    assert driver.recorded is None  # (Nothing recorded: started afresh.)
    driver.keep_unsaved("windows", {"n": 1})
    first = driver.unsaved
    assert first is not None
    assert driver.not_saved() is True and driver.not_saved() is False  # Warned once.
    driver.keep_unsaved("windows", {"n": 2})
    driver.saved(first)
    assert driver.unsaved == ("windows", {"n": 2}) and not driver.unsaved_warned
    latest = driver.unsaved
    assert latest is not None
    driver.saved(latest)
    assert driver.unsaved is None
    assert driver.not_saved() is True  # A later failure is said again.


def test_observe_only_and_late_renewals_are_rationed() -> None:
    driver = JobDriver("job")
    assert driver.first_observe_only("n1", 0) is True
    assert driver.first_observe_only("n1", 0) is False
    assert driver.first_observe_only("n1", 1) is True
    assert driver.try_late_renewal(100.0, 5.0) is True
    assert driver.try_late_renewal(104.0, 5.0) is False
    assert driver.try_late_renewal(105.0, 5.0) is True


def test_lapsed_settings_are_kept_then_taken_once() -> None:
    driver = JobDriver("job")
    driver.keep_lapsed(0, ["power_limit"])
    driver.keep_lapsed(0, ["schedule"])
    driver.keep_lapsed(1, [])
    assert driver.take_pending_lapses() == [(0, {"power_limit", "schedule"}), (1, set())]
    assert driver.take_pending_lapses() == []
    driver.reapplied(0, [1.0], 2.0)
    assert driver.recent_reapplies(0, 3.0, 10.0) == [1.0, 2.0]
    driver.throttled(0, [2.0])
    assert driver.lapse_reapplies[0] == [2.0]
