"""`Replicas`: the ownership loop, GPU lease renewals and idle jobs.

The ownership loop renews this replica's leases (`Leases`), takes over jobs whose owner stopped
renewing (it died) and starts their optimisers from the recorded progress; a stopping replica
gives its jobs up at once. The GPU leases the agents hold for a job are renewed here too
(`renew_gpu_leases`), and idle jobs are collected (`collect_idle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.optimizer import JobOptimizer
from coordinator.service.driver import JobDriver
from coordinator.service.failures import JobFailures
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.owned import OwnedStreams
from coordinator.service.progress import ProgressWriter
from coordinator.service.starter import OptimiserStarter
from coordinator.service.streams import Streams
from coordinator.service.table import JobTable
from coordinator.state import records
from coordinator.state.jetstream import StateUnavailableError
from coordinator.state.ownership import Lease
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.formats import reads_headers
from zeus_agent.wire.messages import LeaseRenewal

__all__ = ["Replicas"]

LOG = logging.getLogger(__name__)

RELEASES_IN_FLIGHT = 64
"""Job leases given up at once at shutdown (JetStream KV updates in flight)."""
LEASE_WRITES_IN_FLIGHT = 64
"""Ownership leases renewed or taken at once. One at a time, a replicated KV update each (1.4 ms
on a 3-server cluster here, more under load), 3,000 leases took longer than the lease's safe
window: leases lapsed, the other replica took the jobs, and 6,000 idle jobs on 2 replicas
changed owner 37,476 times in 6 minutes (each takeover restarting a job's idle clock, so 684 of
them were never removed). 64 in flight: 0.2 ms a lease."""
DELETES_IN_FLIGHT = 16
"""Idle jobs removed at once (each is several JetStream requests)."""
HANDOVERS_PER_ROUND = 64
"""Jobs handed over to their preferred replica per ownership round (twice a second)."""


class Replicas:
    """The loops that keep this replica's jobs owned, their GPU leases renewed, idle jobs out."""

    def __init__(self, *, settings: CoordinatorSettings, clock: Callable[[], float],
                 jobs: JobTable, link: Link, leases: Leases, starter: OptimiserStarter,
                 streams: Streams, owned: OwnedStreams, progress: ProgressWriter,
                 failures: JobFailures,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.settings = settings
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.starter = starter
        self.streams = streams
        self.owned = owned
        self.progress = progress
        self.failures = failures
        self.spawn = spawn
        self._renewed_at = 0.0
        """When this replica last renewed its leases (wall clock)."""
        self._unproven: set[str] = set()
        """Other incarnations of this replica's name seen holding live leases (warned once)."""

    async def ownership(self) -> None:
        """Renew this replica's leases, take over jobs whose owner is gone."""
        book, leases = self.leases.book, self.leases
        leases.hold_seat()
        if self.link.state is None or not self.link.connected:
            return
        now = time.time()
        due = now - self._renewed_at >= book.lease_s / 3
        if due:
            self._renewed_at = now
            leases.roster.forget_stale(time.monotonic())
            book.forget_renewals(now)
        gate = asyncio.Semaphore(LEASE_WRITES_IN_FLIGHT)

        async def gated(write: Callable[[], Awaitable[Any]]) -> None:
            async with gate:  # (The write made here: one cancelled while waiting is never made.)
                await write()

        await asyncio.gather(*(gated(functools.partial(leases.renew, job_hash, lease, now))
                               for job_hash, lease in (book.renewals() if due else [])))
        self.drop_other_incarnations(now)
        known = {records.job_hash(r.job_id): r.job_id for r in self.jobs.recorded()}
        await asyncio.gather(*(gated(take) for take in self.takes(known)))
        await self.hand_over(time.time())
        await self.owned.reconcile(known[h] for h, lease in book.renewals()
                                   if lease.until > time.time() and h in known)
        for job_hash in book.mine(time.time()):
            driver = self.jobs.by_hash(job_hash)
            if driver is not None and driver.record is not None:
                self.starter.maybe_start(driver)
        self.reapply_pending_lapses()
        self.catch_up_fenced()
        await self.progress.record_unsaved()

    def takes(self, known: dict[str, str]) -> list[Callable[[], Awaitable[Any]]]:
        """The lease writes that take the jobs this replica should take now (`claimable`).

        A job taken here though another replica is preferred for it (it went unowned for a
        lease) marks that replica unresponsive: it is handed nothing for a while, and the job
        stays here while the live replicas stay the same (`OwnershipBook.keep`). Not a lease of
        this process's own taken back (its renewals ran late): the preferred replica rightly
        left it alone (`OwnershipBook.held_until`). One it gave up to that replica is.
        """
        book, leases = self.leases.book, self.leases
        out: list[Callable[[], Awaitable[Any]]] = []
        for job_hash, revision in book.claimable(list(known), time.time(), leases.prefer,
                                                 leases.alive):
            held = book.leases.get(job_hash)
            to = leases.prefer(job_hash)
            if (to is not None and to != book.me
                    and not (held and (book.predecessor(held)
                                       or book.is_mine(held) and held.until > 0))):
                leases.unresponsive(to)
                book.keep(job_hash, tuple(leases.live()))
            why = ("it had no owner" if held is None else
                   f"replica {to} did not take it (it went unowned for a lease)"
                   if held.until == 0 and to not in (None, book.me) else
                   f"replica {held.owner} handed it over (the replicas share the jobs out)"
                   if held.until == 0 and held.owner in leases.live() else
                   f"replica {held.owner} stopped and gave it up" if held.until == 0 else
                   "its lease ran out here before JetStream took the renewal"
                   if book.is_mine(held) else
                   f"replica {held.owner} restarted: its previous process (incarnation "
                   f"{held.incarnation}) is gone" if book.predecessor(held) else
                   f"replica {held.owner} stopped renewing its lease (it died or lost NATS)")
            # A lease of this replica's own, taken back, keeps the job's idle clock: its
            # events were followed here all along.
            out.append(functools.partial(
                leases.take, known[job_hash], revision, why,
                restart_idle=held is None or not book.is_mine(held)))
        return out

    async def hand_over(self, now: float) -> None:
        """Give up the jobs another settled replica is preferred for (it takes them at once).

        At most `HANDOVERS_PER_ROUND` a round: a replica joining a busy cluster gets its share
        over a few rounds, each job restarting there from its recorded progress. A job whose
        latest progress is not recorded, or busy (its lock held: a plan), waits for a later
        round; once given up it is no longer driven here, so no progress is lost between.
        """
        leases, book, state = self.leases, self.leases.book, self.link.state
        if state is None or not leases.warm():
            return
        moving = [(driver, lease, to)
                  for h, lease, to in book.handovers(now, leases.prefer, leases.may_hand_to,
                                                     tuple(leases.live()))
                  if (driver := self.jobs.by_hash(h)) is not None][:HANDOVERS_PER_ROUND]
        if not moving:
            return
        await self.progress.record_unsaved()  # (The next owner starts from it.)

        async def give(driver: JobDriver, lease: Lease, to: str) -> None:
            if driver.unsaved is not None or driver.lock.locked():
                return  # Tried again next round.
            async with driver.lock:  # (Free: taken at once. No input is fed meanwhile.)
                value = book.value(lease.job_id, time.time(), release=True)
                try:
                    revision = await state.take(driver.hash, value, lease.revision)
                except StateUnavailableError:
                    revision = None
                if revision is None:  # Not answered: it may have landed (its taker drives it).
                    book.gave_up(driver.hash)
                else:
                    book.observe(driver.hash, value, revision)
                driver.release(f"handed over to replica {to}, which the replicas' rendezvous "
                               "hashing prefers for it")
            await self.owned.drop(lease.job_id)

        await asyncio.gather(*(give(*m) for m in moving))

    def drop_other_incarnations(self, now: float) -> None:
        """Jobs another process under this replica's name holds are not driven here.

        Either this process's earlier incarnation, not proven gone (waited out), or a second
        process started under the same name (a misconfiguration: warned once per process).
        """
        book = self.leases.book
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
                    self.leases.seat.path.parent)
            driver = self.jobs.get(lease.job_id)
            if driver is not None:
                driver.release(f"another process of replica {lease.owner} (incarnation "
                               f"{lease.incarnation or 'unknown'}) holds it")

    def reapply_pending_lapses(self) -> None:
        """Set again the lapsed settings kept while this replica's own lease had lapsed."""
        book = self.leases.book
        for driver in self.jobs.drivers():
            if not driver.pending_lapses:
                continue
            lease = book.leases.get(driver.hash)
            job = driver.optimiser
            if lease is None or not book.is_mine(lease) or job is None:
                # Another replica drives it now, or it has no optimiser here any more.
                driver.drop_pending_lapses()
            elif self.leases.owns(driver.job_id):
                for rank, restored in driver.take_pending_lapses():
                    # A task: the job's lock may be held for long (a plan), and this loop
                    # renews every job's lease.
                    self.spawn(self.streams.reapply_locked(driver, job, rank, sorted(restored)))

    def catch_up_fenced(self) -> None:
        """Carry out the actions fenced while this replica's own lease was lapsing (tasks)."""
        book = self.leases.book
        for driver in self.jobs.drivers():
            if not driver.fenced:
                continue
            lease = book.leases.get(driver.hash)
            if (lease is not None and not book.is_mine(lease)) or driver.optimiser is None:
                driver.take_fenced()  # Another replica drives it now: it sets everything again.
                # (No lease seen, a gap in the watch: kept until the lease is known again.)
            elif self.leases.owns(driver.job_id):
                self.spawn(self._catch_up(driver, driver.optimiser))

    async def _catch_up(self, driver: JobDriver, job: JobOptimizer) -> None:
        """`ActionExecutor.catch_up` under the job's lock (a task: a plan may hold it long)."""
        try:
            async with driver.lock:
                if driver.optimiser is job:  # (Not one released meanwhile.)
                    await self.streams.actions.catch_up(driver)
        except Exception:  # A task of the service: one job's failure must not stop it.
            LOG.exception("job %s: carrying out its fenced actions failed", driver.job_id)

    async def give_up_jobs(self) -> None:
        """At shutdown: record what is unsaved, then give the leases up.

        Another replica then takes the jobs at once, from their latest progress. This
        replica's lock is let go only once every lease is given up (else at exit).
        """
        state, book = self.link.state, self.leases.book
        if state is None or not self.link.connected:
            return
        with contextlib.suppress(Exception):  # The others share its jobs out among themselves.
            await self.leases.announce(leaving=True)
        timeout_s = self.settings.shutdown_timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.progress.record_unsaved(stopping=True), timeout_s)
        gate = asyncio.Semaphore(RELEASES_IN_FLIGHT)
        held = book.renewals()
        given_up = 0

        async def release(job_hash: str, lease: Lease) -> None:
            nonlocal given_up
            value = book.value(lease.job_id, time.time(), release=True)
            async with gate:
                with contextlib.suppress(Exception):
                    revision = await asyncio.wait_for(
                        state.take(job_hash, value, lease.revision), 2)
                    if revision is not None:
                        book.observe(job_hash, value, revision)  # Not acted on any more.
                        given_up += 1

        # Side by side and bounded: one at a time, thousands of jobs took minutes to give up
        # (a lease not given up in time simply runs out, and another replica takes it then).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(release(h, lease) for h, lease in held)), timeout_s)
        if given_up == len(held):
            self.leases.seat.release()

    async def renew_gpu_leases(self) -> None:
        """Renew the GPU leases of the active jobs this replica drives (agents hold them)."""
        s = self.settings
        now = self.clock()
        for driver in self.jobs.drivers():
            if driver.quiet(now, s.lease_idle_s) or not self.leases.owns(driver.job_id):
                continue
            if driver.failed or self.failures.is_quarantined(driver.job_id):
                continue  # Set aside: its GPUs go back to their defaults when the leases lapse.
            renewal = LeaseRenewal(holder=driver.job_id, lease_s=s.lease_s)
            # (The header: this replica reads columns, so its agents may send them.)
            await self.link.nc.publish(subjects.lease_renewal(driver.job_id, s.prefix),
                                       codec.encode(renewal), headers=reads_headers())

    async def collect_idle(self) -> None:
        """Remove the owned jobs idle for longer than `max_job_idle_time`.

        A rank registration is activity: its arrival restarts the job's idle clock, and a job
        whose ranks are being recorded here is not idle (in a burst, a rank may wait longer
        than the limit for its write).
        """
        now, limit = self.clock(), self.settings.max_job_idle_time
        idle = [d.job_id for d in self.jobs.drivers()
                if d.record is not None and d.quiet(now, limit)
                and not self.jobs.registering(d.job_id) and self.leases.owns(d.job_id)]
        gate = asyncio.Semaphore(DELETES_IN_FLIGHT)

        async def remove(job_id: str) -> None:
            if self.link.state is not None:
                try:
                    async with gate:
                        await self.link.state.delete_job(job_id)
                except StateUnavailableError as e:
                    LOG.warning("job %s: not removed (%s); trying again later", job_id, e)
                    return
            self.jobs.forget(job_id)
            # Its lease is neither renewed nor followed any more, whether or not the purge of
            # the ownership bucket went through (the bucket's entry runs out).
            self.leases.book.forget(records.job_hash(job_id))
            await self.owned.drop(job_id)
            await self.link.status(job_id, "removed",
                                   f"job removed after {limit} s without events or "
                                   "registrations (max_job_idle_time)")

        await asyncio.gather(*(remove(job_id) for job_id in idle))
