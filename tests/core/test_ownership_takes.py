"""`Replicas.takes`: which replica a take over blames, and which jobs it keeps (review31).

Defect: a replica taking back its own lapsed lease of a job another replica is preferred for
(its renewals ran late for a lease: a saturated loop) marked that replica unresponsive and kept
the job: yet the preferred replica had rightly left alone a lease its live owner was renewing
(`OwnershipBook.held_until`), and was then handed no job for `BACKOFF_LEASES` leases.
"""

from __future__ import annotations

from typing import Any

from coordinator.service.replicas import Replicas
from coordinator.state import OwnershipBook, records

L = 3.0


class FakeLeases:
    """What `Replicas.takes` asks of `Leases`, over a real book."""

    def __init__(self, book: OwnershipBook, preferred: str) -> None:
        self.book = book
        self.preferred = preferred
        self.blamed: list[str] = []

    def prefer(self, job_hash: str) -> str:
        return self.preferred

    def alive(self, name: str, incarnation: str) -> bool:
        return True

    def live(self) -> list[str]:
        return sorted({self.book.me, self.preferred})

    def unresponsive(self, name: str) -> None:
        self.blamed.append(name)

    async def take(self, *args: Any, **kw: Any) -> bool:
        return True


def replicas(leases: FakeLeases) -> Replicas:
    return Replicas(settings=None, clock=lambda: 0.0, jobs=None, link=None,  # type: ignore[arg-type]
                    leases=leases, starter=None, streams=None, owned=None,  # type: ignore[arg-type]
                    progress=None, failures=None, spawn=lambda c: None)  # type: ignore[arg-type]


def test_its_own_lapsed_lease_taken_back_blames_nobody_and_is_not_kept(monkeypatch: Any) -> None:
    a = OwnershipBook("a", L, "ia")
    h = records.job_hash("job")
    a.observe(h, a.value("job", 10.0), 4)  # until 13: its renewals ran late after that.
    leases = FakeLeases(a, "c")
    monkeypatch.setattr("coordinator.service.replicas.time.time", lambda: 16.1)
    takes = replicas(leases).takes({h: "job"})
    assert len(takes) == 1  # Unowned for a lease: it takes it back.
    assert leases.blamed == []
    assert [m for m, _, _ in a.handovers(16.2, leases.prefer, lambda n: True, ("a", "c"))] \
        == []  # (Not its lease yet: the take is only planned.)
    a.observe(h, a.value("job", 16.1), 5)
    assert [m for m, _, _ in a.handovers(16.2, leases.prefer, lambda n: True, ("a", "c"))] \
        == [h]  # Not kept: handed to c, as before its renewals ran late.


def test_a_lease_of_another_taken_over_blames_the_preferred_and_is_kept(
        monkeypatch: Any) -> None:
    a, b = OwnershipBook("a", L, "ia"), OwnershipBook("b", L, "ib")
    h = records.job_hash("job")
    a.observe(h, b.value("job", 10.0, release=True), 4)  # b gave it up; c never took it.
    leases = FakeLeases(a, "c")
    monkeypatch.setattr("coordinator.service.replicas.time.time", lambda: 10.0)
    assert replicas(leases).takes({h: "job"}) == []
    monkeypatch.setattr("coordinator.service.replicas.time.time", lambda: 13.1)
    assert len(replicas(leases).takes({h: "job"})) == 1
    assert leases.blamed == ["c"]
    a.observe(h, a.value("job", 13.1), 5)
    assert a.handovers(13.2, leases.prefer, lambda n: True, ("a", "c")) == []


def test_its_own_give_up_not_taken_blames_the_preferred_and_is_kept(monkeypatch: Any) -> None:
    a = OwnershipBook("a", L, "ia")
    h = records.job_hash("job")
    a.observe(h, a.value("job", 10.0, release=True), 4)  # Handed to c, which never took it.
    leases = FakeLeases(a, "c")
    monkeypatch.setattr("coordinator.service.replicas.time.time", lambda: 10.0)
    assert replicas(leases).takes({h: "job"}) == []
    monkeypatch.setattr("coordinator.service.replicas.time.time", lambda: 13.1)
    assert len(replicas(leases).takes({h: "job"})) == 1
    assert leases.blamed == ["c"]  # (Else handed to it again and again, undriven meanwhile.)
    a.observe(h, a.value("job", 13.1), 5)
    assert a.handovers(13.2, leases.prefer, lambda n: True, ("a", "c")) == []
