"""`JobTable`: every job this replica knows, one `JobDriver` each, found one way.

A job is found by its id (`get`), by its key token in the state bucket (`by_hash`), by the subject
token its events name it by (`by_token`) and by a GPU one of its ranks drives (`on_gpu`); all
four lead to the same driver, which holds the job's record. Records come in through the table
(`register`, `know`) and leave through it (`forget`: the driver, its index entries and the
registry's record in one call), so no index can keep a job the table dropped. The registry
(`coordinator.jobs`) stays the core of ranks and quotas; the table is the only one that adds
or removes its jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from coordinator.jobs import JobRecord, JobRegistry
from coordinator.optimizer import JobOptimizer
from coordinator.service.driver import JobDriver
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import GpuBinding, RegisterJob

__all__ = ["JobTable"]

LOG = logging.getLogger(__name__)


class JobTable:
    """The jobs of one replica: their drivers, and the indexes that lead to them.

    Attributes:
        registry: The jobs' records, ranks and quotas (added and removed through the table).
    """

    def __init__(self, registry: JobRegistry) -> None:
        self.registry = registry
        self._registering: set[tuple[str, int]] = set()
        self._registering_jobs: dict[str, int] = {}
        """Job id -> its ranks' handlers recording them here now (`registering`)."""
        self._deferred: dict[tuple[str, int], list[Any]] = {}
        """State entries of ranks being recorded here, applied once their handler is done."""
        self._pending: dict[str, JobRecord | None] = {}
        """Jobs registered here whose record JetStream has not taken yet -> the record the state
        bucket delivered for that id meanwhile (None: none yet)."""
        self._by_id: dict[str, JobDriver] = {}
        self._by_hash: dict[str, JobDriver] = {}
        self._by_token: dict[str, JobDriver] = {}
        self._by_gpu: dict[tuple[str, str], JobDriver] = {}

    # ------------------------------------------------------------------ finding a job
    def get(self, job_id: str) -> JobDriver | None:
        """The job's driver, or None."""
        return self._by_id.get(job_id)

    def driver(self, job_id: str) -> JobDriver:
        """The job's driver (made on first use: its progress or lease may come before it)."""
        driver = self._by_id.get(job_id)
        if driver is None:
            driver = self._by_id[job_id] = JobDriver(job_id)
        return driver

    def by_hash(self, job_hash: str) -> JobDriver | None:
        """The driver of the job whose record has this key token, or None."""
        return self._by_hash.get(job_hash)

    def by_token(self, token: str) -> JobDriver | None:
        """The driver of the job whose record has this subject token, or None."""
        return self._by_token.get(token)

    def on_gpu(self, node: str, gpu: str) -> JobDriver | None:
        """The driver of the job whose rank drives (node token, GPU index token), or None."""
        return self._by_gpu.get((node, gpu))

    def record(self, job_id: str) -> JobRecord | None:
        """The job's record, or None."""
        return self.registry.jobs.get(job_id)

    def require(self, job_id: str) -> JobRecord:
        """The job's record (raises `UnknownJobError`, whose message says what to check)."""
        return self.registry.get(job_id)

    def optimiser(self, job_id: str) -> JobOptimizer | None:
        """The optimiser driving the job here, or None."""
        driver = self._by_id.get(job_id)
        return driver.optimiser if driver is not None else None

    def drivers(self) -> list[JobDriver]:
        """Every driver (a copy: jobs may come and go while the caller awaits)."""
        return list(self._by_id.values())

    def ids(self) -> list[str]:
        """Every known job's id (a copy)."""
        return list(self.registry.jobs)

    def records(self) -> list[JobRecord]:
        """Every known job's record (a copy)."""
        return list(self.registry.jobs.values())

    def recorded(self) -> list[JobRecord]:
        """Every known job's record but those registered here and not yet in the state bucket.

        What the ownership loop may take a lease on: a registration still being written may
        yet lose its id to another replica's job (then dropped here, see `abandon`).
        """
        return [r for j, r in self.registry.jobs.items() if j not in self._pending]

    def optimisers(self) -> dict[str, JobOptimizer]:
        """The optimisers driven here, by job id (readable from any thread)."""
        drivers = dict(self._by_id)  # (One copy under the GIL: `/metrics` reads it too.)
        return {j: o for j, d in drivers.items() if (o := d.optimiser) is not None}

    def __len__(self) -> int:
        """Jobs known (their records)."""
        return len(self.registry.jobs)

    def __contains__(self, job_id: object) -> bool:
        """Whether the job's record is known."""
        return job_id in self.registry.jobs

    # ------------------------------------------------------------------ ranks being recorded
    def registering_rank(self, job_id: str, rank: int,
                         apply: Callable[[Any], None]) -> _Registering:
        """While this replica's handler records `rank`: it, not the state watch, starts the job.

        The rank's own entry may come through the watch before the handler has taken the
        write's acknowledgement (both arrive together): `defer` keeps it, and it is applied
        (`apply`) once the handler is done, by then mostly a rank known here (not decoded
        again); not if the job was forgotten meanwhile (its removal came after the entry).
        A context manager (a class: one per registered rank, and a generator's cost as much).
        """
        return _Registering(self, (job_id, rank), apply)

    def _registered(self, key: tuple[str, int], apply: Callable[[Any], None]) -> None:
        """The handler recording `key` is done: its deferred entries are applied."""
        self._registering.discard(key)
        left = self._registering_jobs.get(key[0], 0) - 1
        if left > 0:
            self._registering_jobs[key[0]] = left
        else:
            self._registering_jobs.pop(key[0], None)
        for entry in self._deferred.pop(key, ()):
            if key[0] not in self._by_id:
                continue
            try:
                apply(entry)
            except Exception:  # noqa: BLE001 - one bad entry must not fail the request
                LOG.exception("could not apply state entry %s", getattr(entry, "key", "?"))

    def defer(self, job_id: str, rank: int, entry: Any) -> bool:
        """Keep a state entry of `rank` until its handler here is done; False: none is."""
        key = (job_id, rank)
        if key not in self._registering:
            return False
        self._deferred.setdefault(key, []).append(entry)
        return True

    def registering(self, job_id: str) -> bool:
        """Whether a handler of this replica is recording a rank of the job (it is not idle)."""
        return job_id in self._registering_jobs

    def is_registering(self, job_id: str, rank: int) -> bool:
        """Whether a handler of this replica is recording the rank right now."""
        return (job_id, rank) in self._registering

    # ------------------------------------------------------------------ learning, forgetting
    def register(self, request: RegisterJob, now_s: float, node: str, wall: datetime,
                 join_token: str) -> JobRecord:
        """Register a new job here, pending until `confirm` (`abandon` or `refuse` undo it)."""
        record = self.registry.register_job(request, now_s, node, wall, join_token=join_token)
        self._pending[record.job_id] = None
        self._attach(record)
        return record

    def confirm(self, job_id: str) -> None:
        """The state bucket took the job registered here: it is a job like any other."""
        self._pending.pop(job_id, None)

    def abandon(self, job_id: str) -> None:
        """Undo `register` (its record was not written), keeping what the bucket holds.

        If the bucket delivered a record for that id meanwhile (another replica's job, which
        `know` could not add while this registration held the id), it is known now: dropping
        it with this registration left a job no replica but its owner knew.
        """
        landed = self._pending.pop(job_id, None)
        self.forget(job_id)
        if landed is not None:
            self.know(landed)

    def refuse(self, job_id: str) -> None:
        """`abandon` a registration whose id the state bucket holds for another job.

        Its id is never offered again here (`JobRegistry.refuse_id`), however far this view lags.
        """
        self.abandon(job_id)
        self.registry.refuse_id(job_id)

    def know(self, record: JobRecord) -> JobRecord:
        """Know a job registered elsewhere (the state bucket); a known record is kept as is."""
        if record.job_id in self._pending:  # Kept for `abandon`, the registration still runs.
            self._pending[record.job_id] = record
        self.registry.apply_job(record)
        kept = self.registry.jobs[record.job_id]
        self._attach(kept)
        return kept

    def _attach(self, record: JobRecord) -> None:
        driver = self.driver(record.job_id)
        driver.know(record)
        self._by_hash[driver.hash] = driver
        self._by_token[driver.token] = driver

    def bind_gpu(self, driver: JobDriver, gpu: GpuBinding) -> None:
        """Note that a rank of the job drives `gpu` (its stream messages name it by tokens)."""
        key = (subjects.token(gpu.node), subjects.token(gpu.gpu_index))
        self._by_gpu[key] = driver
        driver.bind_gpu(key)

    def forget(self, job_id: str) -> None:
        """Drop the job: no longer driven, its driver, its index entries, its record."""
        self._pending.pop(job_id, None)
        driver = self._by_id.pop(job_id, None)
        if driver is not None:
            driver.release("removed")
            for index, key in ((self._by_hash, driver.hash), (self._by_token, driver.token)):
                if index.get(key) is driver:
                    del index[key]
            for gpu in driver.gpus:
                if self._by_gpu.get(gpu) is driver:
                    del self._by_gpu[gpu]
        self.registry.drop_job(job_id)


class _Registering:
    """`JobTable.registering_rank`'s context manager."""

    __slots__ = ("apply", "key", "table")

    def __init__(self, table: JobTable, key: tuple[str, int],
                 apply: Callable[[Any], None]) -> None:
        self.table, self.key, self.apply = table, key, apply

    def __enter__(self) -> None:
        table = self.table
        table._registering.add(self.key)  # noqa: SLF001 - the table's own helper
        jobs = table._registering_jobs  # noqa: SLF001
        jobs[self.key[0]] = jobs.get(self.key[0], 0) + 1

    def __exit__(self, *_: object) -> None:
        self.table._registered(self.key, self.apply)  # noqa: SLF001
