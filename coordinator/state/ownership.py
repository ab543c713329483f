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
* **An owner renewing, however slowly, keeps its jobs.** A lease that expired is still held
  while its owner (that process) holds another live lease (it renewed something lately: a
  saturated event loop renews thousands of leases a few at a time), and for one more
  `lease_s` while the owner is live in the roster (`alive`: it announces itself, and its late
  renewal is on its way). Taken over, such leases flapped: the late renewal found the job
  gone, and the rendezvous hashing later handed it back. An owner that died stops announcing
  and renewing at once, so its jobs are taken as before, when its last lease ends; one that
  announces but cannot write its leases loses them `lease_s` after they end.
* **A job taken over stays** (`keep`): one a replica took though another is preferred for it
  (that one let it go unowned for a lease) is not handed back while the assignment it was
  taken under (the live replicas) is the same; when a replica joins or leaves, it moves as
  any job does.
* **Handing over.** An owner gives up (`until` = 0) a job whose preferred replica is another
  one, settled in the roster, which then takes it at once: when a replica joins, about 1/N of
  the jobs move to it; when it leaves, only its jobs move.
* An owner renews its leases every `lease_s / 3`, each to now + `lease_s`.
* **Fencing.** An owner acts on a job only until `until - fence_s` (`fence_s` = `lease_s / 3`),
  and another replica only takes it after `until`: between the two, nobody commands its
  GPUs, so a takeover never sends double commands (as long as clocks differ by less than
  `fence_s`). An owner whose renewal failed (another replica has the lease) drops the job.
* A replica that stops gives its jobs up (`until` = 0), so another takes them at once. A
  give-up not answered (it may have landed) is taken as given (`gave_up`): never driven here
  while its taker drives it.
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
from dataclasses import dataclass, replace
from typing import Any

Alive = Callable[[str, str], bool]
"""(replica, incarnation) -> whether that process is live in the roster (announcing itself)."""


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
        self._renewed: dict[tuple[str, str], tuple[int, float]] = {}
        """(owner, incarnation) -> its latest lease write seen (revision, `until`): until then it
        is renewing, and holds its leases that expired too (`held_until`). The latest write,
        not the latest end: an end written while its clock ran ahead is not held once it has
        renewed on the right clock."""
        self._kept: dict[str, tuple[str, ...]] = {}
        """Job hash -> the assignment (live replicas) it was taken over under (`keep`)."""

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
            who = (lease.owner, lease.incarnation)
            if revision > self._renewed.get(who, (0, 0.0))[0]:
                self._renewed[who] = (revision, lease.until)
        if not self.is_mine(lease):
            self._kept.pop(job_hash, None)
        return lease

    def forget(self, job_hash: str) -> None:
        """The job's lease was deleted (the job is gone)."""
        self.leases.pop(job_hash, None)
        self._unowned.pop(job_hash, None)
        self._kept.pop(job_hash, None)

    def gave_up(self, job_hash: str) -> None:
        """This process wrote its give-up of the job and was told nothing: act as if it landed.

        A write not answered (a timeout) may have landed, and then the job's preferred replica
        takes it at once: acting on it meanwhile would be a second driver. If it did not land,
        the lease is not renewed and runs out: the job is taken as a lapsed one (here too).
        """
        lease = self.leases.get(job_hash)
        if lease is not None and self.is_mine(lease) and lease.until > 0:
            self.leases[job_hash] = replace(lease, until=0.0)

    def keep(self, job_hash: str, assignment: tuple[str, ...]) -> None:
        """This replica took the job over though another is preferred: keep it under `assignment`.

        `handovers` leaves it here while the live replicas are `assignment`.
        """
        self._kept[job_hash] = assignment

    def held_until(self, lease: Lease, alive: Alive | None = None) -> float:
        """Until when the lease holds the job: its end, or later while its owner renews.

        An expired lease of another process that renewed some lease since (its latest write
        ends later) is held until that one ends, and `lease_s` more while its owner is live in
        the roster (`alive(owner, incarnation)`). A lease given up (`until` 0) holds nothing;
        this process's own leases hold to their end.
        """
        if lease.until <= 0 or self.is_mine(lease):
            return lease.until
        end = max(lease.until, self._renewed.get((lease.owner, lease.incarnation), (0, 0.0))[1])
        if alive is not None and alive(lease.owner, lease.incarnation):
            return end + self.lease_s
        return end

    def forget_renewals(self, now: float) -> None:
        """Drop the owners whose every lease ended long ago (bounded on a churning cluster)."""
        for who in [w for w, (_, until) in self._renewed.items()
                    if now - until > 10 * self.lease_s]:
            del self._renewed[who]

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
                  prefer: Callable[[str], str | None] | None = None,
                  alive: Alive | None = None) -> list[tuple[str, int]]:
        """Jobs to take now: (hash, revision to compare with; 0: no lease yet).

        `prefer`: a job's preferred replica (rendezvous over the live ones; None: not known
        yet); a job another replica is (or may be) preferred for is taken here only once it has
        gone unowned for `lease_s`. `alive`: whether a replica's process is live in the roster
        (its expired leases are held a lease longer: `held_until`).
        """
        out = []
        for h in job_hashes:
            lease = self.leases.get(h)
            revision = lease.revision if lease is not None else 0
            if lease is not None and self.predecessor(lease):
                out.append((h, revision))
                continue
            held = self.held_until(lease, alive) if lease is not None else 0.0
            if now < held:
                self._unowned.pop(h, None)
                continue
            since = self._unowned.setdefault(h, now if held <= 0 else min(now, held))
            if prefer is None or prefer(h) == self.me or now - since >= self.lease_s:
                out.append((h, revision))
        return out

    def handovers(self, now: float, prefer: Callable[[str], str | None],
                  settled: Callable[[str], bool],
                  assignment: tuple[str, ...] | None = None) -> list[tuple[str, Lease, str]]:
        """This replica's jobs another, settled, replica is preferred for: (hash, lease, to).

        Not those taken over under `assignment` (the live replicas now: `keep`).
        """
        out = []
        for h in self.mine(now):
            kept = self._kept.get(h)
            if kept is not None:
                if kept == assignment:
                    continue
                del self._kept[h]  # The assignment changed: it moves as any job does.
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
