"""SIGKILL of a group spares its resource trackers even when a member is slow to die.

A member killed is still listed in /proc until the kernel has torn it down: on 2026-12-07 a
member holding 1 GiB was listed through all 20 looks of `_sigkill_group_sparing_trackers`
(30-50 ms), which then SIGKILLed the whole group, trackers included, and its semaphores leaked
(500 MiB: 13 looks). Here /proc is faked: the member stays listed for 30 looks.
"""

from __future__ import annotations

import signal

import pytest

from zeus_demo.cluster import processes

LEADER, TRACKER, UNKILLABLE = 100, 101, 102


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    sent: list[tuple[str, int, int]] = []
    looks = [0]

    def members(pgid: int) -> list[int]:
        looks[0] += 1
        return [LEADER, TRACKER, UNKILLABLE] if looks[0] <= 30 else [TRACKER, UNKILLABLE]

    def kill(pid: int, sig: int) -> None:
        sent.append(("kill", pid, sig))
        if pid == UNKILLABLE and sig == signal.SIGKILL:
            raise PermissionError

    monkeypatch.setattr(processes, "_group_members", members)
    monkeypatch.setattr(processes, "_is_resource_tracker", lambda pid: pid == TRACKER)
    monkeypatch.setattr(processes.os, "kill", kill)
    monkeypatch.setattr(processes.os, "killpg", lambda g, sig: sent.append(("killpg", g, sig)))
    return sent


def test_a_member_slow_to_die_does_not_get_the_trackers_killed(
        group: list[tuple[str, int, int]]) -> None:
    processes._sigkill_group_sparing_trackers(LEADER)  # noqa: SLF001
    assert ("kill", LEADER, signal.SIGKILL) in group
    assert ("kill", TRACKER, signal.SIGKILL) not in group
    assert ("killpg", LEADER, signal.SIGKILL) not in group, group


def test_nothing_of_the_group_is_left_stopped(group: list[tuple[str, int, int]]) -> None:
    """The trackers, and a member no SIGKILL reached (another user's), are continued."""
    processes._sigkill_group_sparing_trackers(LEADER)  # noqa: SLF001
    assert group[0] == ("killpg", LEADER, signal.SIGSTOP)
    assert group[-1] == ("killpg", LEADER, signal.SIGCONT), group
