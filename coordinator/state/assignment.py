"""Which replica should drive each job: rendezvous hashing over the live replicas (pure).

Jobs spread over the replicas by highest-random-weight (rendezvous) hashing: every replica
scores every (replica, job) pair with the same hash, and a job's preferred owner is the live
replica with the highest score. Every replica computes the same answer from the same roster,
with no coordination; the jobs spread evenly (each replica prefers about 1/N of them); and when
a replica joins or leaves, only the jobs it wins or held change preference (about 1/N of them),
never a job between two replicas that both stay.

The roster is who announced itself lately (`ReplicaAlive`, every `lease_s / 3`): a replica is
live while its last announcement is younger than three of its announcement periods, and
*settled* once it has been live without a gap for `settle_s`, so a replica that flickers (a
loaded host, a lost packet) is never handed jobs until it is steady. Leases still decide who
drives a job (`OwnershipBook`): this only says who should take a job nobody holds, and which
held jobs their owner hands over.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Roster", "preferred", "score"]


def score(replica: str, job_hash: str) -> int:
    """The rendezvous weight of a (replica, job) pair: the same on every host and Python."""
    digest = hashlib.blake2b(f"{replica}\x00{job_hash}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred(job_hash: str, replicas: Iterable[str]) -> str | None:
    """The replica that should drive the job: the highest score (ties: the greater name)."""
    best: tuple[int, str] | None = None
    for name in replicas:
        key = (score(name, job_hash), name)
        if best is None or key > best:
            best = key
    return best[1] if best is not None else None


@dataclass
class _Seen:
    incarnation: str
    since: float
    """When its current unbroken run of announcements began."""
    last: float
    ttl_s: float
    """How long it stays live after an announcement (`TTL_PERIODS` of its own period)."""


TTL_PERIODS = 3.0
"""A replica is live until this many of its own announcement periods pass without one."""


class Roster:
    """The replicas heard from lately (times: this host's monotonic clock, seconds).

    A replica is live for `TTL_PERIODS` of the period *it* announces (replicas may run with
    different leases), or `ttl_s` when it announced none.
    """

    def __init__(self, me: str, ttl_s: float, settle_s: float) -> None:
        if not ttl_s > 0 or settle_s < 0:
            raise ValueError(f"the roster needs ttl_s > 0 and settle_s >= 0, got {ttl_s}, "
                             f"{settle_s}")
        self.me = me
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self._seen: dict[str, _Seen] = {}

    def heard(self, name: str, incarnation: str, now: float,
              period_s: float | None = None) -> bool:
        """A replica announced itself; True if it starts a new run.

        New, restarted, or back after a gap: the others answer it at once, so it learns them
        without waiting a period.
        """
        ttl = TTL_PERIODS * period_s if period_s else self.ttl_s
        seen = self._seen.get(name)
        if seen is None or seen.incarnation != incarnation or now - seen.last >= seen.ttl_s:
            self._seen[name] = _Seen(incarnation, now, now, ttl)
            return True
        seen.last, seen.ttl_s = now, ttl
        return False

    def left(self, name: str, incarnation: str) -> None:
        """A replica said it is stopping: not live from now (unless a newer process speaks)."""
        seen = self._seen.get(name)
        if seen is not None and seen.incarnation == incarnation:
            del self._seen[name]

    def live(self, now: float) -> list[str]:
        """The replicas to share jobs among now: this one, and those heard within `ttl_s`.

        Safe from another thread (`/healthz`): the roster is copied in one C call first.
        """
        names = {n for n, s in list(self._seen.items()) if now - s.last < s.ttl_s}
        return sorted(names | {self.me})

    def alive(self, name: str, incarnation: str, now: float) -> bool:
        """Whether that process of `name` (its incarnation) was heard from within its TTL."""
        seen = self._seen.get(name)
        return (seen is not None and seen.incarnation == incarnation
                and now - seen.last < seen.ttl_s)

    def settled(self, name: str, now: float) -> bool:
        """Whether `name` has been live, without a gap, for `settle_s` (this one always is)."""
        if name == self.me:
            return True
        seen = self._seen.get(name)
        return (seen is not None and now - seen.last < seen.ttl_s
                and now - seen.since >= self.settle_s)

    def forget_stale(self, now: float) -> None:
        """Drop replicas silent for long (a bounded roster on a cluster that churns)."""
        for name in [n for n, s in self._seen.items() if now - s.last >= 10 * s.ttl_s]:
            del self._seen[name]
