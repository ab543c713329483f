"""Rendezvous hashing of jobs over replicas, the roster, and the ownership book's use of them."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from coordinator.state.assignment import Roster, preferred, score
from coordinator.state.ownership import OwnershipBook

JOBS = [f"job{i:05d}" for i in range(6000)]


def test_scores_are_stable_across_processes_and_python_versions() -> None:
    # blake2b of "replica\0job", 8 bytes big-endian: fixed, so every replica agrees.
    assert score("r1", "abc") == int.from_bytes(
        __import__("hashlib").blake2b(b"r1\x00abc", digest_size=8).digest(), "big")
    assert preferred("abc", []) is None
    assert preferred("abc", ["only"]) == "only"
    assert preferred("abc", ["r1", "r2", "r3"]) == preferred("abc", ["r3", "r1", "r2"])


def test_jobs_spread_evenly_over_the_replicas() -> None:
    for n in (2, 4, 8):
        names = [f"r{i}" for i in range(n)]
        counts = Counter(preferred(j, names) for j in JOBS)
        assert set(counts) == set(names)
        # Binomial: each within 5 standard deviations of len/n.
        sd = math.sqrt(len(JOBS) * (1 / n) * (1 - 1 / n))
        assert all(abs(c - len(JOBS) / n) < 5 * sd for c in counts.values()), counts


def test_a_joining_replica_takes_only_its_share_and_a_leaving_one_gives_only_its_own() -> None:
    before = {j: preferred(j, ["r0", "r1", "r2"]) for j in JOBS}
    joined = {j: preferred(j, ["r0", "r1", "r2", "r3"]) for j in JOBS}
    moved = [j for j in JOBS if before[j] != joined[j]]
    assert all(joined[j] == "r3" for j in moved)  # Never between two replicas that stay.
    assert abs(len(moved) - len(JOBS) / 4) < 5 * math.sqrt(len(JOBS) * 0.25 * 0.75)
    left = {j: preferred(j, ["r0", "r2"]) for j in JOBS}
    assert all(left[j] == before[j] for j in JOBS if before[j] != "r1")


def test_the_roster_lists_live_replicas_and_settles_only_after_an_unbroken_run() -> None:
    roster = Roster("me", ttl_s=3.0, settle_s=6.0)
    assert roster.live(0.0) == ["me"] and roster.settled("me", 0.0)
    for t in (0.0, 1.0, 2.0, 3.0):
        roster.heard("b", "inc1", t)
    assert roster.live(3.5) == ["b", "me"]
    assert not roster.settled("b", 5.9)
    for t in (4.0, 5.0, 6.0):
        roster.heard("b", "inc1", t)
    assert roster.settled("b", 6.0)
    # Silent for a ttl: not live; heard again: its run starts again.
    assert roster.live(9.0) == ["me"] and not roster.settled("b", 9.0)
    roster.heard("b", "inc1", 10.0)
    assert roster.live(10.0) == ["b", "me"] and not roster.settled("b", 15.0)
    # A new incarnation (a restart) starts afresh too; leaving removes only that incarnation.
    roster.heard("b", "inc2", 16.0)
    assert not roster.settled("b", 21.0)
    roster.left("b", "inc1")
    assert roster.live(16.5) == ["b", "me"]
    roster.left("b", "inc2")
    assert roster.live(16.5) == ["me"]
    roster.heard("c", "x", 20.0)
    roster.forget_stale(100.0)
    assert roster.live(100.0) == ["me"] and not roster.settled("c", 100.0)
    never = Roster("me", ttl_s=3.0, settle_s=math.inf)
    for t in range(100):
        never.heard("b", "i", float(t))
    assert not never.settled("b", 99.0)
    with pytest.raises(ValueError, match="ttl_s > 0"):
        Roster("me", ttl_s=0.0, settle_s=1.0)


def _prefer(owner_of: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda h: owner_of.get(h)


def test_a_job_nobody_holds_is_taken_by_its_preferred_replica_else_after_a_lease() -> None:
    book = OwnershipBook("me", lease_s=3.0, incarnation="i")
    prefer = _prefer({"mine": "me", "theirs": "other"})
    assert book.claimable(["mine", "theirs"], 100.0, prefer) == [("mine", 0)]
    # Still nobody's after a lease: its preferred replica cannot take it; this one does.
    assert book.claimable(["mine", "theirs"], 102.9, prefer) == [("mine", 0)]
    assert book.claimable(["mine", "theirs"], 103.0, prefer) == [("mine", 0), ("theirs", 0)]
    # Without a roster (prefer None) every job nobody holds is taken, as before.
    assert OwnershipBook("me", 3.0, "i").claimable(["a", "b"], 0.0) == [("a", 0), ("b", 0)]
    # Not warm (prefer answers None): another replica may be preferred, so only the fallback.
    cold = OwnershipBook("me", 3.0, "i")
    assert cold.claimable(["a"], 0.0, lambda h: None) == []
    assert cold.claimable(["a"], 3.0, lambda h: None) == [("a", 0)]


def test_an_expired_lease_counts_as_unowned_from_its_end_and_a_live_one_resets_it() -> None:
    book = OwnershipBook("me", lease_s=3.0, incarnation="i")
    other = OwnershipBook("other", lease_s=3.0, incarnation="o")
    book.observe("h", other.value("job", 10.0), 5)  # until 13
    prefer = _prefer({"h": "other"})
    assert book.claimable(["h"], 12.0, prefer) == []  # Live.
    assert book.claimable(["h"], 15.9, prefer) == []  # Expired at 13: not a lease yet.
    assert book.claimable(["h"], 16.0, prefer) == [("h", 5)]
    book.observe("h", other.value("job", 20.0), 6)  # Renewed: the count starts again.
    assert book.claimable(["h"], 23.5, prefer) == []
    assert book.claimable(["h"], 26.0, prefer) == [("h", 6)]
    # A lease given up (until 0) counts from when this replica first saw it unowned.
    prefer = _prefer({"h": "other", "g": "other"})
    book.observe("g", other.value("job2", 30.0), 1)
    book.observe("g", other.value("job2", 31.0, release=True), 2)
    assert book.claimable(["g"], 40.0, prefer) == []
    assert book.claimable(["g"], 43.0, prefer) == [("g", 2)]
    book.forget("g")
    assert book.claimable(["g"], 50.0, prefer) == []  # Forgotten: counted afresh.


def test_an_owner_hands_over_only_jobs_a_settled_other_replica_is_preferred_for() -> None:
    book = OwnershipBook("me", lease_s=3.0, incarnation="i")
    for h in ("keep", "move", "unsettled"):
        book.observe(h, book.value(f"job-{h}", 10.0), 1)
    prefer = _prefer({"keep": "me", "move": "b", "unsettled": "c"})
    moves = book.handovers(10.5, prefer, lambda name: name == "b")
    assert [(h, lease.job_id, to) for h, lease, to in moves] == [("move", "job-move", "b")]
    # Fenced leases are not this replica's to hand over.
    assert book.handovers(12.5, prefer, lambda name: True) == []
    # A lease given up is neither handed over again nor renewed (that would take it back).
    book.observe("move", book.value("job-move", 10.6, release=True), 2)
    assert [h for h, _ in book.renewals()] == ["keep", "unsettled"]
    assert [h for h, _, _ in book.handovers(10.7, prefer, lambda name: True)] == ["unsettled"]
