"""`OwnershipBook`: what a replica counts as owned, and which process of a replica holds a lease.

Regressions (issue 33, item 5):
* `/healthz`'s `owned` counted every lease bearing the replica's name, expired or not: during a
  partition both replicas reported owning the same job for ~19 s. `mine(now)` now counts only
  the leases the replica may act on (live and outside the fence, on its own clock).
* A lease named its owner by replica name only: a second process under the same name owned
  every job of the first at once (both drove them), and a restart could not tell its dead
  predecessor from a live duplicate. A lease now names the process (name and incarnation); a
  restarted process takes at once only the leases of the incarnations proven gone.
"""

from __future__ import annotations

import json

from coordinator.state import OwnershipBook
from coordinator.state.ownership import decode_lease
from tests.core.ownership_kit import Leases, step


def test_an_owner_cut_off_stops_counting_its_job_before_another_may_take_it() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    a, b = OwnershipBook("a", 9.0, "ia"), OwnershipBook("b", 9.0, "ib")
    step(a, bucket, jobs, 0.0)
    step(b, bucket, jobs, 0.0)
    assert a.mine(0.0) == ["h1"] and b.mine(0.0) == []
    # a is cut off from NATS at t=0: no renewals, its book keeps its last lease (until 9 s).
    counted_by_a = []
    for tenth in range(1, 300):
        t = tenth / 10
        step(b, bucket, jobs, t)
        a_counts, b_counts = "h1" in a.mine(t), "h1" in b.mine(t)
        assert not (a_counts and b_counts), t  # never both
        assert a_counts == a.owns("h1", t)  # what it counts is what it would act on
        if a_counts:
            counted_by_a.append(t)
    assert max(counted_by_a) < 6.0  # until - fence: it stopped counting at 6 s
    assert b.mine(29.9) == ["h1"]
    assert a.leases["h1"].owner == "a"  # (its stale view still names it)


def test_an_expired_lease_is_not_counted_even_before_anyone_takes_it() -> None:
    book = OwnershipBook("a", 9.0, "i1")
    book.observe("h", book.value("j", 100.0), 1)  # until 109, fenced from 106
    assert book.mine(105.9) == ["h"]
    assert book.mine(106.0) == [] and book.mine(200.0) == []
    assert [h for h, _ in book.renewals()] == ["h"]  # still renewed if it can be


def test_a_lease_value_names_the_process_and_old_values_still_read() -> None:
    book = OwnershipBook("a", 9.0, "i1")
    lease = decode_lease(book.value("j", 10.0), 3)
    assert lease is not None and (lease.owner, lease.incarnation, lease.until) == ("a", "i1", 19.0)
    old = decode_lease(json.dumps({"v": 1, "owner": "a", "until": 5.0, "job_id": "j"}).encode(), 4)
    assert old is not None and old.incarnation == ""
    book.observe("h", json.dumps({"v": 1, "owner": "a", "until": 50.0, "job_id": "j"}).encode(), 4)
    assert not book.owns("h", 1.0) and book.mine(1.0) == [] and book.renewals() == []


def test_two_processes_under_one_name_never_both_own_a_job() -> None:
    bucket, jobs = Leases(), {"h1": "job-1", "h2": "job-2"}
    first, second = OwnershipBook("r", 9.0, "i1"), OwnershipBook("r", 9.0, "i2")
    for t in range(0, 60, 3):
        step(first, bucket, jobs, float(t))
        step(second, bucket, jobs, float(t))
        for h in jobs:
            assert first.owns(h, float(t)) and not second.owns(h, float(t))
        assert second.mine(float(t)) == [] and second.renewals() == []
        assert second.owner("h1", float(t)) == "r"  # (requests are forwarded by name)


def test_a_restarted_process_takes_its_predecessors_leases_only_once_proven_gone() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    old = OwnershipBook("r", 9.0, "i1")
    step(old, bucket, jobs, 0.0)  # old dies at t=0 holding the lease until 9 s.
    unproven = OwnershipBook("r", 9.0, "i2")
    step(unproven, bucket, jobs, 1.0)
    assert not unproven.owns("h1", 1.0) and unproven.claimable(["h1"], 8.9) == []
    step(unproven, bucket, jobs, 9.0)  # waited out, like any other replica's
    assert unproven.owns("h1", 9.0)

    bucket = Leases()
    old = OwnershipBook("r", 9.0, "i1")
    step(old, bucket, jobs, 0.0)
    restarted = OwnershipBook("r", 9.0, "i2")
    restarted.proven_gone({"i1", "i2"})  # (its own incarnation is never "gone")
    assert restarted.gone == frozenset({"i1"})
    step(restarted, bucket, jobs, 1.0)
    assert restarted.owns("h1", 1.0) and restarted.mine(1.0) == ["h1"]
    # Had old only been frozen (not proven gone, which the lock rules out), it would lose its
    # renewal once back, and stop acting at once: the lease is not its process's.
    step(old, bucket, jobs, 2.0)
    assert not old.owns("h1", 2.0) and old.mine(2.0) == [] and restarted.owns("h1", 2.0)


def test_only_this_replicas_own_earlier_incarnations_are_taken_early() -> None:
    bucket, jobs = Leases(), {"h1": "job-1"}
    other = OwnershipBook("s", 9.0, "i1")
    step(other, bucket, jobs, 0.0)
    book = OwnershipBook("r", 9.0, "i2")
    book.proven_gone(["i1"])  # same incarnation id, another replica's name: not ours
    step(book, bucket, jobs, 1.0)
    assert not book.owns("h1", 1.0) and book.claimable(["h1"], 8.9) == []
