"""`DurableState`: this replica's view of the JetStream state bucket.

Jobs, ranks, GPU bindings and each optimiser's progress live in a JetStream KV bucket
(`coordinator.state`), one key per fact; a registration is acknowledged once JetStream has it
(so nothing acknowledged is lost), and a write that fails is undone and refused (`unavailable`),
so a retry never makes a second job. An existing `state_dir/jobs.json` (earlier versions) is
imported once and renamed.

Every replica follows the bucket (`on_entry`: jobs, ranks, recorded progress; `on_owner_entry`:
the ownership leases), so all share one view of the jobs, kept in its `JobTable`. The jobs'
progress is written by `ProgressWriter`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from coordinator.jobs import JobRegistry
from coordinator.service.failures import JobFailures
from coordinator.service.gpus import GpuDirectory
from coordinator.service.link import Link
from coordinator.service.starter import OptimiserStarter
from coordinator.service.table import JobTable
from coordinator.state import OwnershipBook, RecordError, records
from coordinator.state.jetstream import StateUnavailableError

__all__ = ["DurableState"]

LOG = logging.getLogger(__name__)


class DurableState:
    """Follows the state bucket (jobs, ranks, progress, quarantine notes, ownership leases)."""

    def __init__(self, *, state_dir: Path, clock: Callable[[], float], jobs: JobTable,
                 link: Link, book: OwnershipBook, gpus: GpuDirectory, failures: JobFailures,
                 starter: OptimiserStarter,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.state_dir = state_dir
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.book = book
        self.gpus = gpus
        self.failures = failures
        self.starter = starter
        self.spawn = spawn
        self.on_new_job: Callable[[str], None] | None = None
        """Called with the id of a job this replica learns of from the bucket (registered
        through another replica, or before this one started): it may be this one's to drive."""

    async def import_jobs_json(self) -> None:
        """Import `state_dir/jobs.json` (the file store of earlier versions) once."""
        path, state = self.state_dir / "jobs.json", self.link.state
        if not path.exists() or state is None:
            return
        try:
            data = json.loads(path.read_text())
            imported = JobRegistry.restore(data, self.clock())
            windows = {job_id: w for job_id, w in data.get("power_limit_windows", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            aside = path.with_suffix(f".corrupt-{int(time.time())}")
            os.replace(path, aside)
            LOG.error("could not import %s (%s); moved it to %s", path, e, aside)
            return
        for record in imported.jobs.values():
            if await state.create_job(record):
                for rank in record.ranks.values():
                    await state.create_rank(record.job_id, rank, node_ranks=True)
                if record.job_id in windows:
                    await state.put_progress(record.job_id, "windows", windows[record.job_id])
        done = path.with_suffix(f".imported-{int(time.time())}")
        os.replace(path, done)
        LOG.info("imported %d job(s) from %s into JetStream (the file is now %s)",
                 len(imported.jobs), path, done.name)

    async def on_entry(self, entry: Any) -> None:
        """Keep this replica's view in step with the state bucket (any replica's writes)."""
        self.apply(entry)

    def apply(self, entry: Any) -> None:
        """`on_entry`'s work (nothing awaited: also called when a deferred entry is due)."""
        jobs = self.jobs
        deleted = entry.operation in ("DEL", "PURGE")
        if not deleted and entry.key.count(".") == 3 and entry.key.startswith("v.rank."):
            # Rank keys are only ever created: one this replica knows (it registered the rank
            # itself) is not decoded again, which halves the work of a big registration.
            _, _, job_hash, rank = entry.key.split(".", 3)
            known = jobs.by_hash(job_hash)
            record = known.record if known is not None else None
            held = record.ranks.get(int(rank)) if record is not None and rank.isdigit() else None
            if known is not None and held is not None:
                jobs.bind_gpu(known, held.gpu)
                return
            if known is not None and rank.isdigit() and jobs.defer(known.job_id, int(rank), entry):
                return  # Its handler here is recording it: applied once it is done.
        if not deleted and entry.key.startswith("v.ranks.") and self._own_node(entry):
            return
        try:
            change = records.decode(entry.key, entry.value, deleted, self.clock())
        except RecordError as e:
            self.link.drop("bad_state_entry", entry.key, e)
            self.failures.bad_record(entry.key, e)
            return
        if change.kind == "quar":
            self._on_quarantine(change)
            return
        if change.kind == "job":
            if change.deleted:
                gone = jobs.by_hash(change.job_hash)
                if gone is not None:
                    jobs.forget(gone.job_id)
                return
            assert change.job is not None
            new = change.job.job_id not in jobs
            jobs.know(change.job)
            if new and self.on_new_job is not None:
                self.on_new_job(change.job.job_id)
        elif change.kind == "rank" and change.deleted:  # A registration undone (a lost race).
            undone = jobs.by_hash(change.job_hash)
            rank = entry.key.rsplit(".", 1)[-1]
            if undone is not None and rank.isdigit():
                jobs.registry.unregister_rank(undone.job_id, int(rank))
        elif change.kind == "rank" and change.rank is not None and change.job_id is not None:
            self._apply_rank(entry.key, change)
        elif change.kind == "ranks" and change.job_id is not None:  # (Deleted: the job is.)
            if self._defer_node(change, entry):
                return
            for one in change.ranks:
                self._apply_rank(entry.key, one)
        elif change.kind == "prog" and change.job_id is not None and change.progress:
            driver = jobs.driver(change.job_id)
            if driver.optimiser is None:  # Our own writes change nothing here.
                driver.remember_progress(change.progress)

    def _own_node(self, entry: Any) -> bool:
        """Whether `entry` is a node entry this replica wrote, its ranks known here: done.

        As a rank entry this replica wrote is not decoded again (`apply`), nor is a node
        entry: its ranks' GPUs are bound. One whose ranks a handler here is still recording is
        kept until it is done (`JobTable.defer`), then applied again.
        """
        state = self.link.state
        known = state.own_entries.get(entry.key) if state is not None else None
        if state is None or known is None:
            return False
        job_id, ranks = known
        jobs = self.jobs
        for rank in reversed(ranks):  # (The handlers end in rank order: kept once, mostly.)
            if jobs.defer(job_id, rank.info.rank, entry):
                return True
        del state.own_entries[entry.key]
        record = jobs.record(job_id)
        if record is None or any(record.ranks.get(r.info.rank) != r for r in ranks):
            return False  # (Decoded and applied as another replica's.)
        driver = jobs.driver(job_id)
        for rank in ranks:
            jobs.bind_gpu(driver, rank.gpu)
        return True

    def _defer_node(self, change: records.Change, entry: Any) -> bool:
        """Keep a node entry some of whose ranks a handler here is recording (`defer`)."""
        jobs = self.jobs
        assert change.job_id is not None
        for one in reversed(change.ranks):  # (As `_own_node`.)
            assert one.rank is not None
            if jobs.defer(change.job_id, one.rank.info.rank, entry):
                return True
        return False

    def _apply_rank(self, key: str, change: records.Change) -> None:
        """One rank's entry (alone, or one of a node entry's)."""
        jobs = self.jobs
        assert change.rank is not None and change.job_id is not None
        job = jobs.record(change.job_id)
        if job is not None and change.rank.info.rank >= job.job.world_size:
            error = RecordError(f"{key}: rank {change.rank.info.rank} is beyond the "
                                f"job's world of {job.job.world_size}")
            self.link.drop("bad_state_entry", key, error)
            self.failures.bad_record(key, error)
            return
        gpu, driver = change.rank.gpu, jobs.driver(change.job_id)
        jobs.bind_gpu(driver, gpu)
        if change.limits is not None:  # The owner need not ask that GPU's agent again.
            self.gpus.remember((gpu.node, gpu.gpu_index), change.limits,
                               change.energy_period_ms, change.period_recorded)
        if (jobs.registry.apply_rank(change.job_id, change.rank, self.clock())
                and not jobs.is_registering(change.job_id, change.rank.info.rank)):
            self.starter.maybe_start(driver)  # (Once every rank is in.)

    def _on_quarantine(self, change: records.Change) -> None:
        """A job set aside (by any replica), or released by an operator (tried again)."""
        failures = self.failures
        if not change.deleted:
            note = change.quarantine or {}
            failures.note_quarantine(change.job_hash, note)
            driver = self.jobs.by_hash(change.job_hash)
            if driver is not None and driver.optimiser is not None:
                # Driven here (another replica, or a record, set it aside): end it as a failure
                # does, its GPUs back at their defaults and its status saying why.
                self.spawn(failures.fail(
                    driver.job_id, f"quarantined by replica {note.get('replica') or '?'}: "
                    f"{note.get('reason') or 'no reason recorded'}"))
            return
        failures.release_quarantine(change.job_hash)
        driver = self.jobs.by_hash(change.job_hash)
        if driver is not None and driver.record is not None:
            driver.clear_failure()
            self.starter.maybe_start(driver)

    async def on_owner_entry(self, entry: Any) -> None:
        """Follow the ownership leases; a job another replica took is dropped here."""
        book = self.book
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            book.forget(entry.key)
            return
        lease = book.observe(entry.key, entry.value, entry.revision)
        if lease is not None and lease.owner != book.me:
            driver = self.jobs.get(lease.job_id)
            if driver is not None:
                driver.release(f"replica {lease.owner} took it over")

    async def known_job(self, job_id: str) -> None:
        """Make sure this replica knows a job registered through another (its view may lag)."""
        state = self.link.state
        if job_id in self.jobs or state is None:
            return
        with contextlib.suppress(StateUnavailableError, RecordError):
            record = await state.get_job(job_id)
            if record is not None:
                self.jobs.know(record)
