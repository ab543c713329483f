"""Review of the job spread: the roster of live replicas under a clock step (pure).

Defect this proves (it fails on the code it was written against): the roster is kept on the
wall clock (`Leases` passes `time.time()`), although it only ever compares this replica's own
readings (it needs no clock shared between hosts, unlike the leases). When the wall clock
steps back (NTP correcting a fast clock, a VM restored), `Roster.heard` never moves a replica's
last announcement back, so a replica that goes silent right after the step stays live for the
whole size of the step (plus the ttl): its jobs are not taken by the others' preferred
replicas, nor registrations it is preferred for, until the fallback a lease later.
"""

from __future__ import annotations

from coordinator.state.assignment import Roster


def test_a_replica_silent_after_the_clock_stepped_back_stays_live_for_the_whole_step() -> None:
    roster = Roster("me", ttl_s=3.0, settle_s=3.0)
    for t in range(100, 110):
        roster.heard("other", "inc", float(t))
    # The wall clock steps back 60 s; "other" announces twice more, then dies.
    roster.heard("other", "inc", 50.0)
    roster.heard("other", "inc", 51.0)
    silent_for = 10.0  # More than three times the ttl.
    assert roster.live(51.0 + silent_for) == ["me"], (
        f"'other', silent for {silent_for:g} s (ttl 3 s), is still live: its last announcement "
        "is kept at the time before the clock stepped back")
