"""`Leases`: this replica's ownership leases on the jobs, which say which jobs it drives.

Each job is driven by one owner (`OwnershipBook`: a lease in the `-owners` bucket, taken by
compare-and-set). `owns` says whether this replica drives a job now; `owns_now` is the fence
every action and GPU command passes (a late lease is renewed first); `take` and `renew` write
the leases. The ownership loop that calls them is `Replicas`.

A process restarted under the same replica name takes its predecessor's leases at once when
it can prove that process is gone (`ReplicaSeat`), and waits them out otherwise.

The replicas share the jobs out by rendezvous hashing over those live (`Roster`): each
announces itself (`announce`, `ReplicaAlive`), and `prefer` says which replica should drive a
job. The roster is *warm* once this replica has listened for a second (the others answer a
new replica at once; again after a reconnection); before, it does not know the others: it
takes at once the jobs registered through it and its own predecessor's, others only once they
have gone unowned for a lease.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from coordinator.service.link import Link
from coordinator.service.table import JobTable
from coordinator.state import OwnershipBook, records
from coordinator.state.assignment import Roster, preferred
from coordinator.state.ownership import Lease
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.replicas import ReplicaAlive

__all__ = ["SEAT_HISTORY", "Leases", "ReplicaSeat"]

LOG = logging.getLogger(__name__)

SEAT_HISTORY = 16
"""Incarnations a replica's lock file remembers (older ones' leases are waited out)."""
PREFERRED_KEPT = 100_000
"""Jobs' preferred replicas remembered at most (forgotten all at once past it: jobs end)."""
WARM_S = 1.0
"""Seconds a replica listens after its first announcement before it trusts its roster: the
others answer a new replica at once (`on_alive`), so a round trip is what it needs; at most
`WARM_PERIODS` announcement periods (their own loop, `announce`, hears the rest)."""
WARM_PERIODS = 1.5
BACKOFF_LEASES = 10
"""Leases a replica is handed no job after one it was preferred for went unowned."""


class ReplicaSeat:
    """A replica's lock file in its state directory: proof that its earlier processes are gone.

    A process holds an exclusive `flock` on `<state-dir>/.replica-<digest of the name>.lock`
    from when it starts serving until it exits, and once it holds it adds its incarnation
    to the incarnations listed in the file. The kernel drops the lock only when its holder
    exits (SIGKILL and a crash included; a frozen process keeps it), and a process that stops
    cleanly lets it go only once it has given every lease up. So a process that gets the lock
    knows that every incarnation listed has exited or holds no live lease: their leases are
    its to take at once.

    Sound where one kernel sees the file: a local filesystem, or a volume one host mounts at a
    time. A state directory on a network filesystem shared by hosts, or copied from a running
    replica, proves nothing (the lock or the list is another host's); the file must be left
    alone while a replica runs.
    """

    def __init__(self, state_dir: Path, name: str, incarnation: str) -> None:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        self.path = state_dir / f".replica-{digest}.lock"
        self.name = name
        self.incarnation = incarnation
        self._file: BinaryIO | None = None
        """The locked file (closed, so unlocked, at exit or when garbage-collected)."""
        self._warned = False

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._file is not None

    def hold(self) -> list[str] | None:
        """Take the lock if it is free: the incarnations that held it before (None: not now).

        Not now: another live process holds it (this name runs twice on this host, or its
        previous process is frozen), or the file cannot be used (logged once).
        """
        if self._file is not None:
            return None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._warn(f"cannot open {self.path}: {e}")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if not isinstance(e, BlockingIOError):
                self._warn(f"cannot lock {self.path}: {e}")
            return None
        try:
            before = self._listed(os.read(fd, 1 << 16))
            listed = [*before, self.incarnation][-SEAT_HISTORY:]
            data = json.dumps({"v": 1, "replica": self.name, "incarnations": listed}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as e:
            os.close(fd)  # (Drops the lock: another try on the next round.)
            self._warn(f"cannot write {self.path}: {e}")
            return None
        self._file = open(fd, "r+b", buffering=0)  # noqa: SIM115 - held until exit
        return before

    def release(self) -> None:
        """Let the lock go (only once this process holds no live lease)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _listed(self, raw: bytes) -> list[str]:
        """The incarnations listed in the file (none if it is new or unreadable)."""
        try:
            data: Any = json.loads(raw)
            if data.get("replica") != self.name:
                return []
            return [str(i) for i in data["incarnations"] if str(i) != self.incarnation]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return []

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            LOG.warning("replica lock: %s; a restart of this replica waits out its earlier "
                        "process's ownership leases", why)


class Leases:
    """This replica's ownership leases: whether it drives a job, taking and renewing them.

    Attributes:
        book: The leases this replica knows of (the `-owners` bucket, as followed).
        seat: This replica's lock file (proof that its earlier processes are gone).
    """

    def __init__(self, book: OwnershipBook, jobs: JobTable, link: Link,
                 clock: Callable[[], float], state_dir: Path,
                 handover_after_s: float = 30.0) -> None:
        self.book = book
        self.jobs = jobs
        self.link = link
        self.clock = clock
        self.seat = ReplicaSeat(state_dir, book.me, book.incarnation)
        self.period_s = book.lease_s / 3
        """How often this replica announces itself (and renews its leases)."""
        self.roster = Roster(book.me, ttl_s=book.lease_s, settle_s=(
            max(handover_after_s, book.lease_s) if handover_after_s > 0 else math.inf))
        """The replicas heard from (times: `time.monotonic()`, never stepped)."""
        self._listening_since: float | None = None
        """When this replica last began listening (first announcement, or a reconnection:
        monotonic); None: not yet."""
        self._preferred_among: tuple[str, ...] = ()
        self._preferred: dict[str, str] = {}
        """Job hash -> its preferred replica among `_preferred_among` (`prefer`)."""
        self._unresponsive: dict[str, float] = {}
        """Replica -> when a job it was preferred for had to be taken by another (monotonic):
        it is handed no job for `BACKOFF_LEASES` leases."""
        self.on_taken: Callable[[str], Awaitable[None]] | None = None
        """Called with a job's id once this replica has taken its lease (it follows its
        streams from then: `coordinator.service.owned`)."""

    def hold_seat(self) -> None:
        """Take this replica's lock if it is free; learn which earlier processes are gone."""
        before = self.seat.hold()
        if before is None:
            return
        self.book.proven_gone(before)
        if before:
            LOG.info("replica %s (incarnation %s): its earlier processes (%s) are gone; their "
                     "jobs are taken at once", self.book.me, self.book.incarnation,
                     ", ".join(before))

    def owns(self, job_id: str) -> bool:
        """Whether this replica drives the job now."""
        return self.book.owns(records.job_hash(job_id), time.time())

    # ------------------------------------------------------------------ the roster
    def warm(self) -> bool:
        """Whether this replica has listened long enough to know the live replicas."""
        since = self._listening_since
        return since is not None and time.monotonic() - since >= min(
            WARM_S, WARM_PERIODS * self.period_s)

    def rewarm(self) -> None:
        """Listen afresh before trusting the roster (after a reconnection).

        Announcements were missed meanwhile.
        """
        if self._listening_since is not None:
            self._listening_since = time.monotonic()

    def live(self) -> list[str]:
        """The live replicas (this one included)."""
        return self.roster.live(time.monotonic())

    def prefer(self, job_hash: str) -> str | None:
        """The live replica that should drive the job (rendezvous hashing; None: not warm).

        Remembered while the live replicas stay the same (every job is asked twice a second).
        """
        if not self.warm():
            return None
        live = tuple(self.live())
        if live != self._preferred_among or len(self._preferred) > PREFERRED_KEPT:
            self._preferred_among, self._preferred = live, {}
        best = self._preferred.get(job_hash)
        if best is None:
            best = self._preferred[job_hash] = preferred(job_hash, live) or self.book.me
        return best

    def alive(self, name: str, incarnation: str) -> bool:
        """Whether that process of replica `name` announces itself (`Roster.alive`)."""
        return self.roster.alive(name, incarnation, time.monotonic())

    def settled(self, name: str) -> bool:
        """Whether a replica has been live, without a gap, for `handover_after_s`."""
        return self.roster.settled(name, time.monotonic())

    def may_hand_to(self, name: str) -> bool:
        """Whether a replica may be handed jobs: settled, and it took the last ones it should."""
        now = time.monotonic()
        since = self._unresponsive.get(name)
        if since is not None and now - since < BACKOFF_LEASES * self.book.lease_s:
            return False
        return self.roster.settled(name, now)

    def unresponsive(self, name: str) -> None:
        """A job `name` was preferred for went unowned for a lease: hand it nothing for a while.

        It may be live but unable to write its leases.
        """
        self._unresponsive[name] = time.monotonic()

    def should_take(self, job_id: str) -> bool:
        """Whether this replica takes a job registered through it at once.

        It does when the preferred replica is this one, or is not known (the roster is not
        warm); else it asks the preferred one to take it (`Endpoints.register_job`).
        """
        to = self.prefer(records.job_hash(job_id))
        return to is None or to == self.book.me

    async def announce(self, leaving: bool = False) -> None:
        """Tell the other replicas this one is live (or stopping: `leaving`)."""
        nc = self.link.nc
        if nc is None:
            return
        if self._listening_since is None and not leaving:
            self._listening_since = time.monotonic()
        alive = ReplicaAlive(replica=self.book.me, incarnation=self.book.incarnation,
                             period_s=self.period_s, leaving=leaving)
        await nc.publish(subjects.replica_alive(self.book.me, self.link.prefix),
                         codec.encode(alive))

    async def on_alive(self, msg: Any) -> None:
        """Another replica announced itself (or that it is leaving).

        A new one is answered at once, so it knows this one without waiting a period.
        """
        try:
            alive = codec.decode(msg.data, ReplicaAlive)
        except PayloadError as e:
            self.link.drop("malformed", msg.subject, e)
            return
        if subjects.token(alive.replica) != msg.subject.split(".")[-2]:
            self.link.drop("wrong_replica", msg.subject, alive.replica)
            return
        if alive.replica == self.book.me:
            return
        if alive.leaving:
            self.roster.left(alive.replica, alive.incarnation)
        elif self.roster.heard(alive.replica, alive.incarnation, time.monotonic(),
                               alive.period_s) and self._listening_since is not None:
            await self.announce()

    async def renew(self, job_hash: str, lease: Lease, now: float) -> None:
        """Renew one of this replica's ownership leases (compare-and-set on its revision).

        A failed renewal drops the job only once another replica holds it: JetStream may just
        have been slow (an election), and a lease that ran out meanwhile is taken again by the
        ownership loop with the job still driven here, not restarted from its progress.
        """
        state, book = self.link.require_state(), self.book
        # Its end counted from now, not from `now` (when the round began): a round of
        # thousands of renewals on a loaded host took longer than a lease, and its last writes
        # landed already expired (the other replica took those jobs).
        value = book.value(lease.job_id, max(now, time.time()))
        revision = await state.take(job_hash, value, lease.revision)
        if revision is not None:
            book.observe(job_hash, value, revision)
            return
        await self.read_lease(job_hash)
        held = book.leases.get(job_hash)
        driver = self.jobs.get(lease.job_id)
        if held is not None and not book.is_mine(held) and driver is not None:
            driver.release(f"replica {held.owner} took it over")

    async def read_lease(self, job_hash: str) -> None:
        """After a compare-and-set failed: learn the lease's current revision from the bucket.

        The watch may lag or stall (its server restarting): waiting for it, a replica would
        try again and again on a stale revision and never take a job given up to it.
        """
        current = await self.link.require_state().read_lease(job_hash)
        if current is not None:
            self.book.observe(job_hash, *current)

    async def owns_now(self, job_id: str) -> bool:
        """Whether this replica may act on the job, renewing its lease first if that is late.

        The ownership loop renews every lease on time unless the event loop was busy (a burst of
        huge iterations on a loaded host): a lease still held but inside its fence is renewed
        here rather than fencing the job's actions. One another replica holds is never taken.
        """
        if self.owns(job_id):
            return True
        book = self.book
        job_hash = records.job_hash(job_id)
        lease = book.leases.get(job_hash)
        now = time.time()
        if (lease is None or not book.is_mine(lease) or now >= lease.until
                or self.link.state is None or not self.link.connected):
            return False
        driver = self.jobs.driver(job_id)  # (Only for a job whose lease is this replica's.)
        if not driver.try_late_renewal(now, book.fence_s / 2):
            return False  # (At most one try per half fence: JetStream may be what is slow.)
        try:  # Bounded: the job's lock is held, and JetStream may be slow (an election).
            await asyncio.wait_for(self.renew(job_hash, lease, now), book.fence_s / 2)
        except TimeoutError:
            return False
        return self.owns(job_id)

    async def take(self, job_id: str, revision: int, why: str, restart_idle: bool = True) -> bool:
        """Take a job's lease (compare-and-set on `revision`); True if this replica has it.

        `restart_idle`: the job's idle clock starts again (this replica skipped its events
        while another drove it); not for a lease of this replica's own taken back, which is no
        change of owner either: logged, but no `taken_over` status (on a loaded host such
        statuses outnumbered the jobs' real moves 2 to 1).
        """
        state, book = self.link.require_state(), self.book
        self.hold_seat()  # (A registration may come before the first ownership round.)
        job_hash = records.job_hash(job_id)
        value = book.value(job_id, time.time())
        new = await state.take(job_hash, value, revision)
        if new is None:
            await self.read_lease(job_hash)
            return False
        book.observe(job_hash, value, new)
        if self.on_taken is not None:
            await self.on_taken(job_id)
        if restart_idle:  # Its idle clock starts with its new owner.
            self.jobs.registry.touch(job_id, self.clock())
        if revision and not restart_idle:
            LOG.info("job %s: its lease taken back by replica %s (%s)", job_id, book.me, why)
        elif revision:
            LOG.info("job %s: taken over by replica %s (%s)", job_id, book.me, why)
            await self.link.status(job_id, "taken_over",
                                   f"coordinator replica {book.me} drives the job now ({why})")
        return True
