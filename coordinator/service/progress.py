"""`ProgressWriter`: the jobs' progress, written beside them and read back before a takeover.

An optimiser's progress (`SaveProgress`) is written beside the job, not in its way
(`save_progress`): writes of one job are serialised, each writes the latest progress, and what
JetStream cannot take now (a stream leader election) is written again on every ownership round
(`record_unsaved`) and before the replica gives its leases up. A job is resumed only from what
the bucket holds now (`read_progress`), not from the watched view, which may lag.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.table import JobTable
from coordinator.state import RecordError, records
from coordinator.state.jetstream import StateUnavailableError

__all__ = ["ProgressWriter"]

LOG = logging.getLogger(__name__)


class ProgressWriter:
    """Writes and reads the jobs' progress in the state bucket (`JobDriver.unsaved`)."""

    def __init__(self, jobs: JobTable, link: Link, leases: Leases,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.spawn = spawn

    async def read_progress(self, job_id: str) -> bool:
        """Read the job's recorded progress from JetStream itself before resuming it.

        The watched view can lag behind the bucket after a stream leader election; a replica
        that resumed from it would redo what the previous owner recorded, or worse, command
        the limits of an older step of the search. So a job is resumed only from what the
        bucket holds now: False if it cannot be read (the job is started on a later round).
        """
        state = self.link.state
        if state is None:
            return True
        try:
            recorded = await state.get_progress(job_id)
        except StateUnavailableError as e:
            LOG.warning("job %s: not resumed yet, its progress cannot be read (%s)", job_id, e)
            return False
        except RecordError as e:
            LOG.warning("job %s: its recorded progress is unreadable (%s); starting afresh",
                        job_id, e)
            recorded = None
        driver = self.jobs.get(job_id)
        if driver is not None:  # (None: the job was removed meanwhile.)
            driver.remember_progress(recorded)
        return True

    def save_progress(self, job_id: str, kind: str, state: Any) -> None:
        """Record an optimiser's progress (`SaveProgress`), so a replica taking over resumes it.

        The write runs beside the job, not in its way: callers hold the job's lock, and a
        write waits out a stream leader election (seconds) during which the job's windows
        must go on. Writes stay in order (`write_progress`) and are flushed at shutdown.
        """
        driver = self.jobs.get(job_id)
        if self.link.state is not None and driver is not None:
            driver.keep_unsaved(kind, state)
            self.spawn(self.write_progress(job_id))

    async def record(self, job_id: str, kind: str, state: Any) -> None:
        """Write a job's progress now, or keep it to write again later.

        Only the latest progress matters: it is what `JobDriver.unsaved` holds until JetStream
        has it, written again on every ownership round if JetStream cannot take it now. Writes
        of one job are serialised and each writes the latest progress, so a slow write of older
        progress (retried through a leader election) never lands after a newer one.
        """
        driver = self.jobs.get(job_id)
        if self.link.state is None or driver is None:
            return
        driver.keep_unsaved(kind, state)
        await self.write_progress(job_id)

    async def write_progress(self, job_id: str, stopping: bool = False) -> None:
        """Write the job's latest unsaved progress (in order; fenced unless `stopping`)."""
        driver = self.jobs.get(job_id)
        if driver is None:
            return
        async with driver.progress_lock:
            latest, state = driver.unsaved, self.link.state
            if latest is None or state is None:
                return  # A write that waited for the lock wrote it already.
            if not stopping and not self.leases.owns(job_id):
                # Fenced (its lease could not be renewed): written once it is renewed, dropped
                # once another replica holds the job (`record_unsaved`).
                return
            try:
                await state.put_progress(job_id, *latest,
                                         version=records.layout_of(driver.record))
            except StateUnavailableError as e:
                if driver.not_saved():
                    LOG.warning("job %s: progress not recorded yet (%s); writing it again until "
                                "JetStream takes it", job_id, e)
                return
            driver.saved(latest)

    async def record_unsaved(self, stopping: bool = False) -> None:
        """Write again the progress JetStream could not take (a stream leader election).

        `stopping`: before this replica gives its leases up, its latest progress is written
        even if it could not renew a lease meanwhile, as long as no other replica holds it.
        """
        book = self.leases.book
        for driver in [d for d in self.jobs.drivers() if d.unsaved is not None]:
            holder = book.owner(driver.hash, time.time())
            if holder is not None and holder != book.me:
                driver.drop_unsaved()  # Not ours to write any more.
            elif stopping or self.leases.owns(driver.job_id):
                await self.write_progress(driver.job_id, stopping)
