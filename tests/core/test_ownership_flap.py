"""Ownership does not flap between live replicas (issue 39 item 4): the pure rules.

Defect (`bench/idle_jobs.py --pin-cpu 0 --ownership-lease-s 3`, both replicas on one core, 4,000
idle jobs; and `cluster_scale.py` at 100,000 GPUs): a saturated replica renewed its thousands of
leases a few at a time, some landed after their end, and the other replica took those jobs at
once (31,430 `taken_over` statuses for 4,000 jobs in 5 minutes); a job taken from a replica
that was only slow was later handed back to it. Now an expired lease is held while its owner
renews others or announces itself, and a job taken over stays while the live replicas do.
"""

from __future__ import annotations

from coordinator.state import OwnershipBook
from coordinator.state.assignment import Roster

L = 3.0


def books() -> tuple[OwnershipBook, OwnershipBook]:
    """Replica a (slow owner) and b (the other), as b sees a's leases."""
    return OwnershipBook("a", L, "ia"), OwnershipBook("b", L, "ib")


def test_an_expired_lease_is_held_while_its_owner_renews_others() -> None:
    a, b = books()
    b.observe("j1", a.value("job1", 10.0), 1)  # until 13
    b.observe("j2", a.value("job2", 11.5), 2)  # until 14.5: a renewed j2 later
    assert b.claimable(["j1"], 13.5) == []  # j1 ended, but a renews: its renewal is late
    assert b.held_until(b.leases["j1"]) == 14.5
    assert b.claimable(["j1"], 14.5) == [("j1", 1)]  # a renewed nothing for a lease: gone
    b.observe("j1", a.value("job1", 14.0), 3)  # (Or its late renewal lands first.)
    assert b.claimable(["j1", "j2"], 16.9) == []  # until 17: a renews, so both are held
    assert b.claimable(["j1", "j2"], 17.0) == [("j1", 3), ("j2", 2)]


def test_an_expired_lease_is_held_a_lease_longer_while_its_owner_announces() -> None:
    a, b = books()
    b.observe("j", a.value("job", 10.0), 1)  # until 13
    alive = {("a", "ia")}

    def announcing(name: str, incarnation: str) -> bool:
        return (name, incarnation) in alive

    assert b.claimable(["j"], 15.9, alive=announcing) == []
    assert b.claimable(["j"], 16.0, alive=announcing) == [("j", 1)]  # Bounded: a lease more.
    alive.clear()  # It stopped announcing (it died): taken when its lease ended.
    assert b.claimable(["j"], 13.0, alive=announcing) == [("j", 1)]
    alive.add(("a", "another process"))  # A restarted a is not the process that held it.
    assert b.claimable(["j"], 13.0, alive=announcing) == [("j", 1)]


def test_a_preferred_replica_waits_for_the_held_lease_and_others_a_lease_more() -> None:
    a, b = books()
    b.observe("j", a.value("job", 10.0), 1)  # until 13
    b.observe("k", a.value("job2", 12.0), 2)  # until 15

    def prefer_b(h: str) -> str:
        return "b"

    def prefer_a(h: str) -> str:
        return "a"

    assert b.claimable(["j"], 14.0, prefer_b) == []
    assert b.claimable(["j"], 15.0, prefer_b) == [("j", 1)]
    c = OwnershipBook("c", L, "ic")
    c.observe("j", a.value("job", 10.0), 1)
    c.observe("k", a.value("job2", 12.0), 2)
    assert c.claimable(["j"], 17.9, prefer_a) == []  # Unowned from 15, not from 13.
    assert c.claimable(["j"], 18.0, prefer_a) == [("j", 1)]


def test_own_leases_and_given_up_ones_are_not_held() -> None:
    a, b = books()
    a.observe("j", a.value("job", 10.0), 1)
    a.observe("k", a.value("job2", 12.0), 2)
    assert a.claimable(["j"], 13.0) == [("j", 1)]  # Its own lapsed lease: taken back at once.
    b.observe("k", a.value("job2", 12.0), 2)
    b.observe("j", a.value("job", 12.5, release=True), 3)  # Given up: nothing holds it.
    assert b.claimable(["j"], 12.6, alive=lambda n, i: True) == [("j", 3)]


def test_a_job_taken_over_stays_while_the_live_replicas_stay() -> None:
    a, b = books()
    b.observe("j", b.value("job", 20.0), 5)  # b took it over (a let it go unowned)
    b.keep("j", ("a", "b"))
    assert b.handovers(20.5, lambda h: "a", lambda n: True, ("a", "b")) == []
    assert b.handovers(21.0, lambda h: "a", lambda n: True, ("a", "b")) == []
    # A replica joined (or one left): the job moves as any job does, once.
    moves = b.handovers(21.5, lambda h: "a", lambda n: True, ("a", "b", "c"))
    assert [(h, to) for h, _, to in moves] == [("j", "a")]
    assert [h for h, _, _ in b.handovers(21.6, lambda h: "a", lambda n: True, ("a", "b"))] \
        == ["j"]  # (Kept once: the change of assignment ended it.)


def test_keep_ends_when_another_replica_holds_the_job_or_it_is_forgotten() -> None:
    a, b = books()
    b.observe("j", b.value("job", 20.0), 5)
    b.keep("j", ("a", "b"))
    b.observe("j", a.value("job", 21.0), 6)  # a holds it now
    b.observe("j", b.value("job", 30.0), 7)  # b takes it again, not kept this time
    assert [h for h, _, _ in b.handovers(30.5, lambda h: "a", lambda n: True, ("a", "b"))] \
        == ["j"]
    b.keep("j", ("a", "b"))
    b.forget("j")
    b.observe("j", b.value("job", 40.0), 8)
    assert [h for h, _, _ in b.handovers(40.5, lambda h: "a", lambda n: True, ("a", "b"))] \
        == ["j"]


def test_renewals_of_owners_gone_long_are_forgotten() -> None:
    a, b = books()
    b.observe("j", a.value("job", 10.0), 1)  # until 13
    b.forget_renewals(13.0 + 10 * L)
    assert b.held_until(b.leases["j"]) == 13.0
    b.forget_renewals(13.1 + 10 * L)
    b.observe("k", a.value("job2", 5.0), 2)  # (An old entry: until 8.)
    assert b.held_until(b.leases["j"]) == 13.0


def test_the_roster_says_which_process_of_a_replica_is_alive() -> None:
    roster = Roster("b", ttl_s=L, settle_s=0.0)
    roster.heard("a", "ia", 100.0, period_s=1.0)
    assert roster.alive("a", "ia", 102.9)
    assert not roster.alive("a", "ia", 103.0)
    assert not roster.alive("a", "other", 101.0)
    assert not roster.alive("c", "ic", 101.0)


def test_an_owner_whose_clock_stepped_back_is_held_by_its_latest_renewal() -> None:
    """Defect (review31): a dead owner's jobs were held until the latest end it ever wrote.

    An owner whose clock ran a minute ahead for one round (then stepped back by NTP) wrote one
    lease ending a minute late; renewed afterwards on the right clock, that lease ended on time,
    but the other replicas counted the owner as renewing until the far end it wrote once: had
    it died, every job of it would have waited a minute, not its last lease.
    """
    a, b = books()
    b.observe("j1", a.value("job1", 10.0), 1)  # until 13
    b.observe("j2", a.value("job2", 70.0), 2)  # Its clock a minute ahead: until 73.
    b.observe("j2", a.value("job2", 11.0), 3)  # Stepped back, renewed: until 14.
    b.observe("j1", a.value("job1", 11.0), 4)  # until 14; then a dies.
    assert b.held_until(b.leases["j1"]) == 14.0
    assert b.claimable(["j1", "j2"], 14.0) == [("j1", 4), ("j2", 3)]
