"""Review of the job spread: the ownership book after a handover (pure).

Defect this proves (it fails on the code it was written against): a lease this replica gave up
(`until` = 0, a handover to the job's preferred replica) is still listed by `renewals()`, so the
ownership loop renews it on its next due round: the replica takes the job back silently (no
`on_taken`, no status), which resets the job's unowned clock (`observe` of a held lease), and
the ownership round then hands it over again. Where the preferred replica does not take it, the
fallback (`lease_s` unowned) never comes: nobody ever drives the job.
"""

from __future__ import annotations

from coordinator.state.ownership import OwnershipBook

LEASE_S = 3.0


def test_a_lease_given_up_in_a_handover_is_not_renewed() -> None:
    book = OwnershipBook("r1", LEASE_S, incarnation="i1")
    h = "a" * 32
    book.observe(h, book.value("job", 100.0), 1)
    assert [k for k, _ in book.renewals()] == [h]
    assert [k for k, _, _ in book.handovers(100.5, lambda _: "r2", lambda _: True)] == [h]
    book.observe(h, book.value("job", 100.5, release=True), 2)  # Given up to r2.
    assert book.mine(100.6) == []
    assert [k for k, _ in book.renewals()] == [], (
        "the lease given up to r2 is renewed (taken back) on the next due round")


def test_the_fallback_comes_a_lease_after_a_handover_the_preferred_replica_did_not_take() -> None:
    """What the ownership loop does each round, on r1's book: renew what `renewals()` lists
    (every lease_s / 3), take what `claimable` lists, hand over what `handovers` lists. The
    preferred replica r2 never takes the job: a lease after r1 gave it up, r1 takes it for good
    (the fallback) instead of giving it up again and again."""
    book = OwnershipBook("r1", LEASE_S, incarnation="i1")
    h, revision, now = "b" * 32, 0, 100.0
    book.observe(h, book.value("job", now), revision := revision + 1)
    book.observe(h, book.value("job", now, release=True), revision := revision + 1)
    given_up_at = now
    renewed_at = now
    unowned_for = 0.0
    while now < given_up_at + 3 * LEASE_S:
        now += 0.5
        if now - renewed_at >= LEASE_S / 3:
            renewed_at = now
            for key, lease in book.renewals():
                book.observe(key, book.value(lease.job_id, now), revision := revision + 1)
        book.claimable([h], now, lambda _: "r2")
        for key, lease, _ in book.handovers(now, lambda _: "r2", lambda _: True):
            book.observe(key, book.value(lease.job_id, now, release=True),
                         revision := revision + 1)
        unowned_for = now - book._unowned.get(h, now)
        if unowned_for >= LEASE_S:
            break
    assert unowned_for >= LEASE_S, (
        f"the job's unowned clock never reached a lease ({unowned_for:g} s): r1 renews the "
        "lease it gave up, which restarts the clock, so the fallback never takes the job")
