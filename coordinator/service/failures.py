"""`JobFailures`: a failure while starting or driving one job stays in that job.

Whatever an optimiser raises while it starts, takes a job over, replays recorded progress or
takes an input (any `Exception`: `MemoryError` and `RecursionError` included), the job ends
here: it is no longer driven, its status says why (`failed`), its GPUs are set back to their
defaults, and it is quarantined: a note in the state bucket (`v.quar.<h>`, see
`coordinator.state.records`) that every replica, and every replica started later, reads before
it starts the job, so a job that cannot be driven is never retried in a loop. A record of the
bucket that cannot be loaded is quarantined the same way. The rest of the replica keeps serving.

Operators list and drop (or release) quarantined jobs with `zeus-coordinator quarantine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.service.commands import GpuCommands
from coordinator.service.link import Link
from coordinator.service.table import JobTable
from coordinator.state import records
from coordinator.state.jetstream import StateUnavailableError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    ClearScheduleCmd,
    CommandEnvelope,
    ResetPowerLimitCmd,
)
from zeus_agent.wire.text import bounded

__all__ = ["JobFailures"]

LOG = logging.getLogger(__name__)

RESET_COMMANDS = (codec.encode(CommandEnvelope(cmd=ResetPowerLimitCmd())),
                  codec.encode(CommandEnvelope(cmd=ClearScheduleCmd())))
"""What a failed job's GPUs are sent: their default power limit, their clocks unlocked."""


def describe(error: BaseException) -> str:
    """A failure in one line for a job's status (bounded: it may echo what a peer sent)."""
    text = bounded(str(error), 500)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class JobFailures:
    """Ends the jobs that fail (their GPUs reset through `commands`), quarantines them.

    Attributes:
        quarantined: Job key token -> its quarantine note (what the state bucket holds).
        failed: Jobs this replica ended since it started.
    """

    def __init__(self, *, settings: CoordinatorSettings, jobs: JobTable, link: Link,
                 commands: GpuCommands,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.settings = settings
        self.jobs = jobs
        self.link = link
        self.commands = commands
        self.spawn = spawn
        self.quarantined: dict[str, dict[str, Any]] = {}
        self.failed = 0
        self._writing: set[str] = set()

    def note_quarantine(self, job_hash: str, note: dict[str, Any]) -> None:
        """The bucket holds a quarantine note for the job (any replica's)."""
        self.quarantined[job_hash] = note

    def release_quarantine(self, job_hash: str) -> None:
        """The job's note is gone (an operator released or dropped it)."""
        self.quarantined.pop(job_hash, None)

    def is_quarantined(self, job_id: str) -> bool:
        """Whether the job is set aside (as this replica's view of the bucket says)."""
        return records.job_hash(job_id) in self.quarantined

    async def still_quarantined(self, job_id: str) -> bool:
        """Whether the bucket holds a quarantine note for the job now (not the watch's view).

        A replica that starts reads its view from the bucket in the order it was written: a
        job's ranks come before its note, so the note is read itself before a job starts.
        Unreadable: the job is not started now (a later ownership round tries again).
        """
        h = records.job_hash(job_id)
        state = self.link.state
        if h in self.quarantined or state is None:
            return h in self.quarantined
        try:
            note = await state.get_quarantine(h)
        except StateUnavailableError as e:
            LOG.warning("job %s: not started yet, its quarantine cannot be read (%s)", job_id, e)
            return True
        if note is not None:
            self.quarantined[h] = note
        return note is not None

    def contained(self, job_id: str, doing: str) -> _Contained:
        """`async with`: any exception the body raises ends the job (`fail`), not the replica."""
        return _Contained(self, job_id, doing)

    async def fail(self, job_id: str, why: str) -> None:
        """End a job this replica drives: no longer driven, `failed`, GPUs reset, quarantined."""
        self.failed += 1
        driver = self.jobs.get(job_id)
        if driver is not None:
            driver.end(why)
        record = self.jobs.record(job_id)
        reset = ""
        if record is not None:
            with contextlib.suppress(Exception):  # (A reset that fails: the leases lapse.)
                reset = await self._reset_gpus(record)
        await self.link.status(job_id, "failed",
                               f"{why}; the job is no longer optimised{reset}; it is "
                               "quarantined (zeus-coordinator quarantine list; drop it, or "
                               "release it to try again once the cause is fixed)")
        await self.quarantine(records.job_key(job_id), why, job_id)

    async def _reset_gpus(self, record: Any) -> str:
        """Set the job's GPUs back to their defaults (if this replica drives it): a phrase."""
        prefix = self.settings.prefix
        requests = [(subjects.gpu_command(g.node, g.gpu_index, prefix), cmd)
                    for g in record.gpus() for cmd in RESET_COMMANDS]
        replies = await self.commands.command(record, "setting the GPUs back to their defaults",
                                              requests)
        if replies is None:
            return ""
        failed = sum(1 for r in replies if isinstance(r, str) or not r.ok)
        if failed:
            return (f"; {failed} of {len(requests)} reset(s) not taken (their leases lapse "
                    "within lease_s)")
        return f"; its {len(record.gpus())} GPU(s) are back at their defaults"

    def bad_record(self, key: str, error: records.RecordError) -> None:
        """A record of the bucket cannot be loaded: quarantine its job (in the background).

        Not a record of a newer layout (a newer replica's, during an upgrade), nor a job's
        progress (the job starts afresh without it: `OptimiserStarter`), nor a note itself.
        """
        h = records.hash_of_key(key)
        if (h is None or isinstance(error, records.NewerRecordError)
                or key.startswith(("v.prog.", "v.quar.")) or h in self.quarantined
                or h in self._writing):
            return
        known = self.jobs.by_hash(h)
        self.spawn(self.quarantine(key, f"record {key} cannot be loaded: {error}",
                                   known.job_id if known is not None else None))

    async def quarantine(self, key: str, why: str, job_id: str | None) -> None:
        """Write the quarantine note of the job `key` belongs to (once; any replica may)."""
        h, replica = records.hash_of_key(key), self.settings.replica_name
        if h is None:
            return
        note = {"job_id": job_id, "key": key, "reason": why,
                "replica": replica, "at": time.time()}
        self.quarantined.setdefault(h, note)
        state = self.link.state
        if state is None or h in self._writing:
            return
        self._writing.add(h)
        try:
            value = records.encode_quarantine(
                job_id, key, why, replica, time.time(),
                records.layout_of(self.jobs.record(job_id) if job_id is not None else None))
            if await state.quarantine(h, value):
                # (A warning: what was wrong is the job's or its records'; a bug in this
                # replica was logged with its traceback where it was caught.)
                LOG.warning("job %s quarantined: %s", job_id or h, bounded(why, 500))
        except StateUnavailableError as e:
            LOG.warning("job %s: its quarantine not recorded (%s): this replica keeps it "
                        "aside until it restarts", job_id or h, e)
        finally:
            self._writing.discard(h)


class _Contained:
    """`JobFailures.contained`: a class, not a generator (it wraps every input of a job)."""

    __slots__ = ("doing", "failures", "job_id")

    def __init__(self, failures: JobFailures, job_id: str, doing: str) -> None:
        self.failures, self.job_id, self.doing = failures, job_id, doing

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> bool:
        """Swallow an `Exception` (not a cancellation) once the job is failed for it."""
        if e is None or not isinstance(e, Exception) or isinstance(e, asyncio.CancelledError):
            return False
        LOG.error("job %s: %s failed", self.job_id, self.doing, exc_info=(type(e), e, tb))
        await self.failures.fail(self.job_id, f"{self.doing} failed ({describe(e)})")
        return True
