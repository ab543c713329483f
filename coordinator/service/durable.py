"""`DurableState`: this replica's view of the JetStream state bucket, and its progress writes.

Jobs, ranks, GPU bindings and each optimiser's progress live in a JetStream KV bucket
(`coordinator.state`), one key per fact; a registration is acknowledged once JetStream has it
(so nothing acknowledged is lost), and a write that fails is undone and refused (`unavailable`),
so a retry never makes a second job. An existing `state_dir/jobs.json` (earlier versions) is
imported once and renamed.

Every replica follows the bucket (`on_entry`: jobs, ranks, recorded progress; `on_owner_entry`:
the ownership leases), so all share one view of the jobs. A job's progress is written beside
the job, not in its way (`save_progress`): writes of one job are serialised, each writes the
latest progress, and what JetStream cannot take now (a stream leader election) is written again
on every ownership round (`record_unsaved`) and before the replica gives its leases up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from coordinator.jobs import JobRegistry
from coordinator.state import RecordError, records
from coordinator.state.jetstream import StateUnavailableError

if TYPE_CHECKING:
    from coordinator.service import CoordinatorService

__all__ = ["DurableState"]

LOG = logging.getLogger(__name__)


class DurableState:
    """Follows the state bucket and writes the jobs' progress for the service `svc`."""

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc

    # ------------------------------------------------------------------ following the bucket
    async def import_jobs_json(self) -> None:
        """Import `state_dir/jobs.json` (the file store of earlier versions) once."""
        svc = self.svc
        path = svc.state_dir / "jobs.json"
        if not path.exists() or svc.state is None:
            return
        try:
            data = json.loads(path.read_text())
            imported = JobRegistry.restore(data, svc.clock())
            windows = {job_id: w for job_id, w in data.get("power_limit_windows", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            aside = path.with_suffix(f".corrupt-{int(time.time())}")
            os.replace(path, aside)
            LOG.error("could not import %s (%s); moved it to %s", path, e, aside)
            return
        for record in imported.jobs.values():
            if await svc.state.create_job(record):
                for rank in record.ranks.values():
                    await svc.state.create_rank(record.job_id, rank)
                if record.job_id in windows:
                    await svc.state.put_progress(record.job_id, "windows",
                                                 windows[record.job_id])
        done = path.with_suffix(f".imported-{int(time.time())}")
        os.replace(path, done)
        LOG.info("imported %d job(s) from %s into JetStream (the file is now %s)",
                 len(imported.jobs), path, done.name)

    async def on_entry(self, entry: Any) -> None:
        """Keep this replica's view in step with the state bucket (any replica's writes)."""
        svc = self.svc
        deleted = entry.operation in ("DEL", "PURGE")
        if not deleted and entry.key.count(".") == 3 and entry.key.startswith("v.rank."):
            # Rank keys are only ever created: one this replica knows (it registered the rank
            # itself) is not decoded again, which halves the work of a big registration.
            _, _, job_hash, rank = entry.key.split(".", 3)
            known = svc.jobs.by_hash(job_hash)
            record = known.record if known is not None else None
            held = record.ranks.get(int(rank)) if record is not None and rank.isdigit() else None
            if known is not None and held is not None:
                svc.jobs.bind_gpu(known, held.gpu)
                return
        try:
            change = records.decode(entry.key, entry.value, deleted, svc.clock())
        except RecordError as e:
            svc.drop("bad_state_entry", entry.key, e)
            svc.failures.bad_record(entry.key, e)
            return
        if change.kind == "quar":
            self._on_quarantine(change)
            return
        if change.kind == "job":
            if change.deleted:
                gone = svc.jobs.by_hash(change.job_hash)
                if gone is not None:
                    svc.jobs.forget(gone.job_id)
                return
            assert change.job is not None
            svc.jobs.know(change.job)
        elif change.kind == "rank" and change.deleted:  # A registration undone (a lost race).
            undone = svc.jobs.by_hash(change.job_hash)
            rank = entry.key.rsplit(".", 1)[-1]
            if undone is not None and rank.isdigit():
                svc.registry.unregister_rank(undone.job_id, int(rank))
        elif change.kind == "rank" and change.rank is not None and change.job_id is not None:
            job = svc.jobs.record(change.job_id)
            if job is not None and change.rank.info.rank >= job.job.world_size:
                error = RecordError(f"{entry.key}: rank {change.rank.info.rank} is beyond the "
                                    f"job's world of {job.job.world_size}")
                svc.drop("bad_state_entry", entry.key, error)
                svc.failures.bad_record(entry.key, error)
                return
            gpu, driver = change.rank.gpu, svc.jobs.driver(change.job_id)
            svc.jobs.bind_gpu(driver, gpu)
            if change.limits is not None:  # The owner need not ask that GPU's agent again.
                svc.gpus.limits.setdefault((gpu.node, gpu.gpu_index), change.limits)
            if (svc.registry.apply_rank(change.job_id, change.rank, svc.clock())
                    and (change.job_id, change.rank.info.rank) not in svc.jobs.registering):
                svc.starter.maybe_start(driver)  # (Once every rank is in.)
        elif change.kind == "prog" and change.job_id is not None and change.progress:
            driver = svc.jobs.driver(change.job_id)
            if driver.optimiser is None:  # Our own writes change nothing here.
                driver.recorded = change.progress

    def _on_quarantine(self, change: records.Change) -> None:
        """A job set aside (by any replica), or released by an operator (tried again)."""
        svc = self.svc
        if not change.deleted:
            note = change.quarantine or {}
            svc.failures.quarantined[change.job_hash] = note
            driver = svc.jobs.by_hash(change.job_hash)
            if driver is not None and driver.optimiser is not None:
                # Driven here (another replica, or a record, set it aside): end it as a failure
                # does, its GPUs back at their defaults and its status saying why.
                svc.spawn(svc.failures.fail(
                    driver.job_id, f"quarantined by replica {note.get('replica') or '?'}: "
                    f"{note.get('reason') or 'no reason recorded'}"))
            return
        svc.failures.quarantined.pop(change.job_hash, None)
        driver = svc.jobs.by_hash(change.job_hash)
        if driver is not None and driver.record is not None:
            driver.failed = None
            svc.starter.maybe_start(driver)

    async def on_owner_entry(self, entry: Any) -> None:
        """Follow the ownership leases; a job another replica took is dropped here."""
        book = self.svc.book
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            book.forget(entry.key)
            return
        lease = book.observe(entry.key, entry.value, entry.revision)
        if lease is not None and lease.owner != book.me:
            driver = self.svc.jobs.get(lease.job_id)
            if driver is not None:
                driver.release(f"replica {lease.owner} took it over")

    async def known_job(self, job_id: str) -> None:
        """Make sure this replica knows a job registered through another (its view may lag)."""
        svc = self.svc
        if job_id in svc.jobs or svc.state is None:
            return
        with contextlib.suppress(StateUnavailableError, RecordError):
            record = await svc.state.get_job(job_id)
            if record is not None:
                svc.jobs.know(record)

    async def read_progress(self, job_id: str) -> bool:
        """Read the job's recorded progress from JetStream itself before resuming it.

        The watched view can lag behind the bucket after a stream leader election; a replica
        that resumed from it would redo what the previous owner recorded, or worse, command
        the limits of an older step of the search. So a job is resumed only from what the
        bucket holds now: False if it cannot be read (the job is started on a later round).
        """
        svc = self.svc
        if svc.state is None:
            return True
        try:
            recorded = await svc.state.get_progress(job_id)
        except StateUnavailableError as e:
            LOG.warning("job %s: not resumed yet, its progress cannot be read (%s)", job_id, e)
            return False
        except RecordError as e:
            LOG.warning("job %s: its recorded progress is unreadable (%s); starting afresh",
                        job_id, e)
            recorded = None
        driver = svc.jobs.get(job_id)
        if driver is not None:  # (None: the job was removed meanwhile.)
            driver.recorded = recorded or None
        return True

    # ------------------------------------------------------------------ progress writes
    def save_progress(self, job_id: str, kind: str, state: Any) -> None:
        """Record an optimiser's progress (`SaveProgress`), so a replica taking over resumes it.

        The write runs beside the job, not in its way: callers hold the job's lock, and a
        write waits out a stream leader election (seconds) during which the job's windows
        must go on. Writes stay in order (`write_progress`) and are flushed at shutdown.
        """
        driver = self.svc.jobs.get(job_id)
        if self.svc.state is not None and driver is not None:
            driver.unsaved = (kind, state)
            self.svc.spawn(self.write_progress(job_id))

    async def record(self, job_id: str, kind: str, state: Any) -> None:
        """Write a job's progress now, or keep it to write again later.

        Only the latest progress matters: it is what `JobDriver.unsaved` holds until JetStream
        has it, written again on every ownership round if JetStream cannot take it now. Writes
        of one job are serialised and each writes the latest progress, so a slow write of older
        progress (retried through a leader election) never lands after a newer one.
        """
        driver = self.svc.jobs.get(job_id)
        if self.svc.state is None or driver is None:
            return
        driver.unsaved = (kind, state)
        await self.write_progress(job_id)

    async def write_progress(self, job_id: str, stopping: bool = False) -> None:
        """Write the job's latest unsaved progress (in order; fenced unless `stopping`)."""
        svc = self.svc
        driver = svc.jobs.get(job_id)
        if driver is None:
            return
        async with driver.progress_lock:
            latest = driver.unsaved
            if latest is None or svc.state is None:
                return  # A write that waited for the lock wrote it already.
            if not stopping and not svc.owns(job_id):
                # Fenced (its lease could not be renewed): written once it is renewed, dropped
                # once another replica holds the job (`record_unsaved`).
                return
            try:
                await svc.state.put_progress(job_id, *latest)
            except StateUnavailableError as e:
                if not driver.unsaved_warned:
                    driver.unsaved_warned = True
                    LOG.warning("job %s: progress not recorded yet (%s); writing it again until "
                                "JetStream takes it", job_id, e)
                return
            svc.writes += 1
            driver.unsaved_warned = False
            if driver.unsaved is latest:
                driver.unsaved = None

    async def record_unsaved(self, stopping: bool = False) -> None:
        """Write again the progress JetStream could not take (a stream leader election).

        `stopping`: before this replica gives its leases up, its latest progress is written
        even if it could not renew a lease meanwhile, as long as no other replica holds it.
        """
        svc = self.svc
        for driver in [d for d in svc.jobs.drivers() if d.unsaved is not None]:
            holder = svc.book.owner(driver.hash, time.time())
            if holder is not None and holder != svc.book.me:
                driver.unsaved = None  # Not ours to write any more.
            elif stopping or svc.owns(driver.job_id):
                await self.write_progress(driver.job_id, stopping)
