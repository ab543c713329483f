"""`OwnershipBook`: which coordinator replica drives which job (pure; leases in KV).

Every job has one owner: the replica that commands its GPUs, renews their leases, runs its
optimiser and writes its progress. Ownership is a lease in the ownership bucket (key: the job's
hash, value: owner name and incarnation, wall-clock expiry), taken and renewed by
compare-and-set on the key's revision, so two replicas can never both win it.

Rules (times are wall-clock seconds, shared by hosts kept in step by NTP):
* **Who takes a job** nobody holds (no lease, or one that expired or was given up): its
  preferred replica, by rendezvous hashing over the live replicas
  (`coordinator.state.assignment`); any replica once the job has gone unowned for `lease_s`
  (its preferred replica cannot take it, or none is known yet). Without a roster (`prefer`
  None: the budgets' lease), any replica.
* **Handing over.** An owner gives up (`until` = 0) a job whose preferred replica is another
  one, settled in the roster, which then takes it at once: when a replica joins, about 1/N of
  the jobs move to it; when it leaves, only its jobs move.
* An owner renews its leases every `lease_s / 3`, each to now + `lease_s`.
* **Fencing.** An owner acts on a job only until `until - fence_s` (`fence_s` = `lease_s / 3`),
  and another replica only takes it after `until`: between the two, nobody commands its
  GPUs, so a takeover never sends double commands (as long as clocks differ by less than
  `fence_s`). An owner whose renewal failed (another replica has the lease) drops the job.
* A replica that stops gives its jobs up (`until` = 0), so another takes them at once.
* **Incarnations.** A lease is held by one process: the replica's name and its incarnation (a
  random id per process start). A process restarted under the same name does not own its
  predecessor's leases: it takes them at once only from the incarnations proven gone
  (`proven_gone`: the shell's per-replica lock, `coordinator.service.replicas`), and waits out
  any other like a lease of another replica. Two processes started under one name (a
  misconfiguration) thus never both drive a job.
* **Counting.** `mine(now)` counts only the leases this replica may act on now (live and
  outside the fence, on this replica's clock): a replica cut off from NATS stops counting a
  job before another may take it.

The shell (`coordinator.state.jetstream`, `coordinator.service`) feeds the bucket's entries in
(`observe`, `forget`) and does the compare-and-set writes this book decides on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Lease:
    """An ownership lease as read from the bucket."""

    owner: str
    until: float
    revision: int
    job_id: str
    incarnation: str = ""
    """The owning process's incarnation ("": a lease written before incarnations)."""


class OwnershipBook:
    """Ownership leases of all jobs as last seen, and the decisions they imply."""

    def __init__(self, me: str, lease_s: float, incarnation: str = "") -> None:
        if not lease_s > 0:
            raise ValueError(f"the ownership lease must be > 0 s, got {lease_s}")
        self.me = me
        self.incarnation = incarnation
        """This process's incarnation, in every lease it writes."""
        self.lease_s = lease_s
        self.fence_s = lease_s / 3
        self.leases: dict[str, Lease] = {}
        """Job hash -> its lease (revision: the key's revision in the bucket)."""
        self.gone: frozenset[str] = frozenset()
        """Earlier incarnations of this replica proven gone: their leases are taken at once."""
        self._unowned: dict[str, float] = {}
        """Job hash -> since when (wall clock) nobody held it, as far as `claimable` saw."""

    def proven_gone(self, incarnations: frozenset[str] | set[str] | list[str]) -> None:
        """These earlier incarnations of this replica are proven gone (never this one)."""
        self.gone = self.gone | (frozenset(incarnations) - {self.incarnation})

    def is_mine(self, lease: Lease) -> bool:
        """Whether the lease was written by this process (this name and this incarnation)."""
        return lease.owner == self.me and lease.incarnation == self.incarnation

    def predecessor(self, lease: Lease) -> bool:
        """Whether the lease is an earlier incarnation's of this replica, proven gone."""
        return (lease.owner == self.me and lease.incarnation != self.incarnation
                and lease.incarnation in self.gone)

    # ------------------------------------------------------------------ what the bucket says
    def observe(self, job_hash: str, raw: bytes, revision: int) -> Lease | None:
        """Take an entry of the ownership bucket; returns the lease (None if unreadable)."""
        lease = decode_lease(raw, revision)
        current = self.leases.get(job_hash)
        if lease is None or (current is not None and current.revision > revision):
            return None  # A stale update (a watch behind our own write).
        self.leases[job_hash] = lease
        if lease.until > 0:  # Held again: unowned (if it lapses) from its new end.
            self._unowned.pop(job_hash, None)
        return lease

    def forget(self, job_hash: str) -> None:
        """The job's lease was deleted (the job is gone)."""
        self.leases.pop(job_hash, None)
        self._unowned.pop(job_hash, None)

    # ------------------------------------------------------------------ decisions
    def owns(self, job_hash: str, now: float) -> bool:
        """Whether this replica may act on the job now (fenced before the lease ends)."""
        lease = self.leases.get(job_hash)
        return lease is not None and self.is_mine(lease) and now < lease.until - self.fence_s

    def owner(self, job_hash: str, now: float) -> str | None:
        """The replica holding a live lease on the job, if any."""
        lease = self.leases.get(job_hash)
        return lease.owner if lease is not None and now < lease.until else None

    def claimable(self, job_hashes: list[str], now: float,
                  prefer: Callable[[str], str | None] | None = None) -> list[tuple[str, int]]:
        """Jobs to take now: (hash, revision to compare with; 0: no lease yet).

        `prefer`: a job's preferred replica (rendezvous over the live ones; None: not known
        yet); a job another replica is (or may be) preferred for is taken here only once it has
        gone unowned for `lease_s`.
        """
        out = []
        for h in job_hashes:
            lease = self.leases.get(h)
            revision = lease.revision if lease is not None else 0
            if lease is not None and self.predecessor(lease):
                out.append((h, revision))
                continue
            if lease is not None and now < lease.until:
                self._unowned.pop(h, None)
                continue
            since = self._unowned.setdefault(
                h, now if lease is None or lease.until <= 0 else min(now, lease.until))
            if prefer is None or prefer(h) == self.me or now - since >= self.lease_s:
                out.append((h, revision))
        return out

    def handovers(self, now: float, prefer: Callable[[str], str | None],
                  settled: Callable[[str], bool]) -> list[tuple[str, Lease, str]]:
        """This replica's jobs another, settled, replica is preferred for: (hash, lease, to)."""
        out = []
        for h in self.mine(now):
            to = prefer(h)
            if to is not None and to != self.me and settled(to):
                out.append((h, self.leases[h], to))
        return out

    def renewals(self) -> list[tuple[str, Lease]]:
        """This process's leases, to renew (all of them, every `lease_s / 3`).

        Not those it gave up (`until` 0): a renewal would silently take the job back.
        """
        return [(h, lease) for h, lease in self.leases.items()
                if self.is_mine(lease) and lease.until > 0]

    def mine(self, now: float) -> list[str]:
        """Hashes of the jobs this replica drives at `now`: its lease is live and unfenced.

        A lease this process still holds in the bucket but past `until - fence_s` on this
        replica's clock is not counted (another replica may take it once `until` is past: a
        replica cut off from NATS would otherwise go on counting a job another one drives).

        Safe from another thread (`/healthz` and `/metrics` call it on the status server's):
        the leases are copied in one C call, which the event loop cannot interleave, before
        any Python code runs per lease.
        """
        return [h for h, lease in list(self.leases.items())
                if self.is_mine(lease) and now < lease.until - self.fence_s]

    def value(self, job_id: str, now: float, release: bool = False) -> bytes:
        """The value this replica writes to take or renew a job's lease (or give it up)."""
        until = 0.0 if release else now + self.lease_s
        return json.dumps({"v": 1, "owner": self.me, "inc": self.incarnation, "until": until,
                           "job_id": job_id}).encode()


def decode_lease(raw: bytes, revision: int) -> Lease | None:
    """A lease from its bucket value, or None if unreadable."""
    try:
        data: Any = json.loads(raw)
        return Lease(str(data["owner"]), float(data["until"]), int(revision), str(data["job_id"]),
                     str(data.get("inc", "")))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
