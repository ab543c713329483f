"""`Replicas`: which replica drives which job, and the leases that say so.

Each job is driven by one owner (`OwnershipBook`: a lease in the `-owners` bucket, taken by
compare-and-set). The ownership loop renews this replica's leases, takes over jobs whose owner
stopped renewing (it died) and starts their optimisers from the recorded progress; a stopping
replica gives its jobs up at once. The GPU leases the agents hold for a job are renewed here
too (`renew_gpu_leases`), and idle jobs are collected (`collect_idle`).

A process restarted under the same replica name takes its predecessor's leases at once when
it can prove that process is gone (`ReplicaSeat`), and waits them out otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from coordinator.state import records
from coordinator.state.jetstream import StateUnavailableError
from coordinator.state.ownership import Lease
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import LeaseRenewal

if TYPE_CHECKING:
    from coordinator.service import CoordinatorService

__all__ = ["Replicas"]

LOG = logging.getLogger(__name__)

RELEASES_IN_FLIGHT = 64
"""Job leases given up at once at shutdown (JetStream KV updates in flight)."""

SEAT_HISTORY = 16
"""Incarnations a replica's lock file remembers (older ones' leases are waited out)."""


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


class Replicas:
    """Ownership of the jobs for the service `svc`."""

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc
        self._renewed_at = 0.0
        """When this replica last renewed its leases (wall clock)."""
        svc.book.incarnation = secrets.token_hex(8)  # Before this process writes any lease.
        self.seat = ReplicaSeat(svc.state_dir, svc.book.me, svc.book.incarnation)
        self._unproven: set[str] = set()
        """Other incarnations of this replica's name seen holding live leases (warned once)."""

    def hold_seat(self) -> None:
        """Take this replica's lock if it is free; learn which earlier processes are gone."""
        before = self.seat.hold()
        if before is None:
            return
        self.svc.book.proven_gone(before)
        if before:
            LOG.info("replica %s (incarnation %s): its earlier processes (%s) are gone; their "
                     "jobs are taken at once", self.svc.book.me, self.svc.book.incarnation,
                     ", ".join(before))

    def owns(self, job_id: str) -> bool:
        """Whether this replica drives the job now."""
        return self.svc.book.owns(records.job_hash(job_id), time.time())

    async def ownership(self) -> None:
        """Renew this replica's leases, take over jobs whose owner is gone."""
        svc = self.svc
        book = svc.book
        self.hold_seat()
        if svc.state is None or svc.nc is None or not svc.nc.is_connected:
            return
        now = time.time()
        due = now - self._renewed_at >= book.lease_s / 3
        if due:
            self._renewed_at = now
        for job_hash, lease in book.renewals() if due else []:
            await self.renew(job_hash, lease, now)
        self.drop_other_incarnations(now)
        known = {records.job_hash(r.job_id): r.job_id for r in svc.jobs.records()}
        for job_hash, revision in book.claimable(list(known), time.time()):
            held = book.leases.get(job_hash)
            why = ("it had no owner" if held is None else
                   f"replica {held.owner} stopped and gave it up" if held.until == 0 else
                   "its lease ran out here before JetStream took the renewal"
                   if book.is_mine(held) else
                   f"replica {held.owner} restarted: its previous process (incarnation "
                   f"{held.incarnation}) is gone" if book.predecessor(held) else
                   f"replica {held.owner} stopped renewing its lease (it died or lost NATS)")
            await self.take(known[job_hash], revision, why)
        for job_hash in book.mine(time.time()):
            driver = svc.jobs.by_hash(job_hash)
            if driver is not None and driver.record is not None:
                svc.starter.maybe_start(driver)
        self.reapply_pending_lapses()
        await svc.durable.record_unsaved()

    def drop_other_incarnations(self, now: float) -> None:
        """Jobs another process under this replica's name holds are not driven here.

        Either this process's earlier incarnation, not proven gone (waited out), or a second
        process started under the same name (a misconfiguration: warned once per process).
        """
        svc = self.svc
        book = svc.book
        for lease in list(book.leases.values()):
            if (lease.owner != book.me or book.is_mine(lease) or book.predecessor(lease)
                    or now >= lease.until):
                continue
            if lease.incarnation not in self._unproven:
                self._unproven.add(lease.incarnation)
                LOG.warning(
                    "replica %s (incarnation %s): another process under this name (incarnation "
                    "%s) holds job leases, and nothing proves it gone (its lock in %s is held "
                    "or is another host's): waiting its leases out; replica names must be "
                    "unique", book.me, book.incarnation, lease.incarnation or "unknown",
                    self.seat.path.parent)
            driver = svc.jobs.get(lease.job_id)
            if driver is not None:
                driver.release(f"another process of replica {lease.owner} (incarnation "
                               f"{lease.incarnation or 'unknown'}) holds it")

    def reapply_pending_lapses(self) -> None:
        """Set again the lapsed settings kept while this replica's own lease had lapsed."""
        svc = self.svc
        for driver in svc.jobs.drivers():
            if not driver.pending_lapses:
                continue
            lease = svc.book.leases.get(driver.hash)
            job = driver.optimiser
            if lease is None or not svc.book.is_mine(lease) or job is None:
                # Another replica drives it now, or it has no optimiser here any more.
                driver.pending_lapses.clear()
            elif self.owns(driver.job_id):
                for rank, restored in list(driver.pending_lapses.items()):
                    del driver.pending_lapses[rank]
                    # A task: the job's lock may be held for long (a plan), and this loop
                    # renews every job's lease.
                    svc.spawn(svc.streams.reapply_locked(driver, job, rank, sorted(restored)))

    async def renew(self, job_hash: str, lease: Lease, now: float) -> None:
        """Renew one of this replica's ownership leases (compare-and-set on its revision).

        A failed renewal drops the job only once another replica holds it: JetStream may just
        have been slow (an election), and a lease that ran out meanwhile is taken again by the
        ownership loop with the job still driven here, not restarted from its progress.
        """
        svc = self.svc
        assert svc.state is not None
        value = svc.book.value(lease.job_id, now)
        revision = await svc.state.take(job_hash, value, lease.revision)
        if revision is not None:
            svc.book.observe(job_hash, value, revision)
            return
        await self.read_lease(job_hash)
        held = svc.book.leases.get(job_hash)
        driver = svc.jobs.get(lease.job_id)
        if held is not None and not svc.book.is_mine(held) and driver is not None:
            driver.release(f"replica {held.owner} took it over")

    async def read_lease(self, job_hash: str) -> None:
        """After a compare-and-set failed: learn the lease's current revision from the bucket.

        The watch may lag or stall (its server restarting): waiting for it, a replica would
        try again and again on a stale revision and never take a job given up to it.
        """
        assert self.svc.state is not None
        current = await self.svc.state.read_lease(job_hash)
        if current is not None:
            self.svc.book.observe(job_hash, *current)

    async def owns_now(self, job_id: str) -> bool:
        """Whether this replica may act on the job, renewing its lease first if that is late.

        The ownership loop renews every lease on time unless the event loop was busy (a burst of
        huge iterations on a loaded host): a lease still held but inside its fence is renewed
        here rather than fencing the job's actions. One another replica holds is never taken.
        """
        if self.owns(job_id):
            return True
        svc = self.svc
        job_hash = records.job_hash(job_id)
        lease = svc.book.leases.get(job_hash)
        now = time.time()
        if (lease is None or not svc.book.is_mine(lease) or now >= lease.until
                or svc.state is None or svc.nc is None or not svc.nc.is_connected):
            return False
        driver = svc.jobs.driver(job_id)  # (Only for a job whose lease is this replica's.)
        if now - driver.late_renewal < svc.book.fence_s / 2:
            return False  # (At most one try per half fence: JetStream may be what is slow.)
        driver.late_renewal = now
        try:  # Bounded: the job's lock is held, and JetStream may be slow (an election).
            await asyncio.wait_for(self.renew(job_hash, lease, now), svc.book.fence_s / 2)
        except TimeoutError:
            return False
        return self.owns(job_id)

    async def take(self, job_id: str, revision: int, why: str) -> bool:
        """Take a job's lease (compare-and-set on `revision`); True if this replica has it."""
        svc = self.svc
        assert svc.state is not None
        self.hold_seat()  # (A registration may come before the first ownership round.)
        value = svc.book.value(job_id, time.time())
        new = await svc.state.take(records.job_hash(job_id), value, revision)
        if new is None:
            await self.read_lease(records.job_hash(job_id))
            return False
        svc.book.observe(records.job_hash(job_id), value, new)
        svc.registry.touch(job_id, svc.clock())  # Its idle clock starts with its new owner.
        if revision:
            LOG.info("job %s: taken over by replica %s (%s)", job_id, svc.book.me, why)
            await svc.status(job_id, "taken_over",
                             f"coordinator replica {svc.book.me} drives the job now ({why})")
        return True

    async def give_up_jobs(self) -> None:
        """At shutdown: record what is unsaved, then give the leases up.

        Another replica then takes the jobs at once, from their latest progress. This
        replica's lock is let go only once every lease is given up (else at exit).
        """
        svc = self.svc
        if svc.state is None or svc.nc is None or not svc.nc.is_connected:
            return
        timeout_s = svc.settings.shutdown_timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(svc.durable.record_unsaved(stopping=True), timeout_s)
        state, gate = svc.state, asyncio.Semaphore(RELEASES_IN_FLIGHT)
        held = svc.book.renewals()
        given_up = 0

        async def release(job_hash: str, lease: Lease) -> None:
            nonlocal given_up
            value = svc.book.value(lease.job_id, time.time(), release=True)
            async with gate:
                with contextlib.suppress(Exception):
                    revision = await asyncio.wait_for(
                        state.take(job_hash, value, lease.revision), 2)
                    if revision is not None:
                        svc.book.observe(job_hash, value, revision)  # Not acted on any more.
                        given_up += 1

        # Side by side and bounded: one at a time, thousands of jobs took minutes to give up
        # (a lease not given up in time simply runs out, and another replica takes it then).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(release(h, lease) for h, lease in held)), timeout_s)
        if given_up == len(held):
            self.seat.release()

    async def renew_gpu_leases(self) -> None:
        """Renew the GPU leases of the active jobs this replica drives (agents hold them)."""
        svc = self.svc
        s = svc.settings
        now = svc.clock()
        for driver in svc.jobs.drivers():
            if driver.quiet(now, s.lease_idle_s) or not self.owns(driver.job_id):
                continue
            if driver.failed or svc.failures.is_quarantined(driver.job_id):
                continue  # Set aside: its GPUs go back to their defaults when the leases lapse.
            renewal = LeaseRenewal(holder=driver.job_id, lease_s=s.lease_s)
            await svc.nc.publish(subjects.lease_renewal(driver.job_id, s.prefix),
                                 codec.encode(renewal))

    async def collect_idle(self) -> None:
        """Remove the owned jobs idle for longer than `max_job_idle_time`."""
        svc = self.svc
        now, limit = svc.clock(), svc.settings.max_job_idle_time
        idle = [d.job_id for d in svc.jobs.drivers()
                if d.record is not None and d.quiet(now, limit) and self.owns(d.job_id)]
        for job_id in idle:
            if svc.state is not None:
                try:
                    await svc.state.delete_job(job_id)
                except StateUnavailableError as e:
                    LOG.warning("job %s: not removed (%s); trying again later", job_id, e)
                    continue
            svc.jobs.forget(job_id)
            await svc.status(job_id, "removed",
                             f"job removed after {limit} s without events or registrations "
                             "(max_job_idle_time)")
