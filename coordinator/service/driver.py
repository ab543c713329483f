"""`JobDriver`: everything one replica holds about one job, in one place.

The service keeps one driver per job it knows, in its `JobTable` (`table`), which finds it by id,
by state-key hash, by subject token and by the GPUs its ranks drive; forgetting a job is one
call there, so no per-job entry can outlive the job. A driver holds the job's record (once
known), the optimiser while this replica drives the job (`optimiser`, None otherwise), the lock
that keeps the job's inputs in order, the progress its owner recorded and what is not recorded
yet, and what the shell remembers of its GPUs: when each rank's schedule was sent, the lapse
throttle, the settings to set again once this replica's own lease is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.jobs import JobRecord
from coordinator.optimizer import (
    Action,
    ApplyPowerLimit,
    AskSelector,
    ClearSchedules,
    InstallSchedules,
    JobOptimizer,
    KeepFile,
    StatusUpdate,
)
from coordinator.state import records
from zeus_agent.wire import subjects

__all__ = ["JobDriver"]

LOG = logging.getLogger(__name__)

MAX_FENCED = 64
"""Fenced actions a driver keeps: beyond it the oldest statuses and dump files are dropped.
Commands are caught up as the job stands, and a selector's question awaits only the latest,
so one of each kind is kept (the latest), never dropped for statuses."""
SUPERSEDED: tuple[tuple[type, ...], ...] = (
    (ApplyPowerLimit,), (InstallSchedules, ClearSchedules), (AskSelector,))
"""Kinds of fenced actions of which only the latest counts (`JobDriver.fence`)."""


@dataclass(eq=False, slots=True)
class JobDriver:
    """One job's state in this replica.

    The service reads its fields, and changes them only through its methods, whose names say
    what happened to the job.

    Attributes:
        job_id: The job.
        hash: Its key token in the state bucket (`records.job_hash`).
        token: Its id as a subject token (`subjects.token`): its events' subjects name it so.
        record: The job's record (None: known only by its progress, ranks or lease so far).
        gpus: (node token, GPU index token) of the GPUs its ranks drive, as the table indexes
            them (a GPU taken by a later job is that job's).
        optimiser: The optimiser driving it here (None: not driven by this replica).
        lock: Serialises the job's inputs (events, marks, measurements, ticks, notices).
        starting: Its optimiser is being started.
        recorded: The progress its owner recorded (what this replica resumes from if it takes
            the job over); dropped once an optimiser took it in.
        unsaved: (kind, state) of progress JetStream has not taken yet (written again later).
        unsaved_warned: Said once that the progress is not recorded yet.
        progress_lock: Keeps the job's progress writes in order.
        installed_at: Rank -> when its schedule was last sent (coordinator clock).
        lapse_reapplies: Rank -> when its lapsed settings were set again (the lapse throttle).
        pending_lapses: Rank -> settings its agent restored while this replica's own lease on
            the job had lapsed: set again once the lease is taken back.
        fenced: Actions not carried out while this replica's lease on the job was lapsing
            (commands, questions, statuses, files: `fence`): carried out as the job stands
            once the lease is this replica's again (`ActionExecutor.catch_up`), dropped if
            another replica takes the job over or the optimiser is released (it sets
            everything again).
        observe_only_said: (node token, GPU) said to be observe-only (once each).
        late_renewal: When an action last renewed this replica's late lease (wall clock).
        failed: Why the job failed here (`JobFailures.fail`): it is never started again.
        retry_at: Not started again before this time (coordinator clock): its GPUs' agents did
            not answer (`OptimiserStarter`).
        waiting_said: Said once that the job waits for its GPUs' agents.
    """

    job_id: str
    hash: str = field(init=False)
    token: str = field(init=False)
    record: JobRecord | None = None
    gpus: set[tuple[str, str]] = field(default_factory=set)
    optimiser: JobOptimizer | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    starting: bool = False
    recorded: dict[str, Any] | None = None
    unsaved: tuple[str, Any] | None = None
    unsaved_warned: bool = False
    progress_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    installed_at: dict[int, float] = field(default_factory=dict)
    lapse_reapplies: dict[int, list[float]] = field(default_factory=dict)
    pending_lapses: dict[int, set[str]] = field(default_factory=dict)
    fenced: list[Action] = field(default_factory=list)
    observe_only_said: set[tuple[str, int]] = field(default_factory=set)
    late_renewal: float = 0.0
    failed: str | None = None
    retry_at: float = 0.0
    waiting_said: bool = False

    def __post_init__(self) -> None:
        self.hash = records.job_hash(self.job_id)
        self.token = subjects.token(self.job_id)

    # ------------------------------------------------------------------ driving
    def begin_start(self) -> None:
        """Its optimiser is being started (`may_start` says no until `start_ended`)."""
        self.starting = True

    def start_ended(self) -> None:
        """The start is over, however it went (it may be started again)."""
        self.starting = False

    def drive(self, job: JobOptimizer) -> None:
        """Drive the job with `job` from now on (this replica owns it)."""
        self.optimiser = job

    def release(self, why: str) -> None:
        """Stop driving the job here (another replica owns it, or it was removed)."""
        self.fenced.clear()  # (Not the next optimiser's: it sets everything again.)
        if self.optimiser is not None:
            self.optimiser = None
            LOG.info("job %s: no longer driven by this replica (%s)", self.job_id, why)

    def end(self, why: str) -> None:
        """The job failed here: no longer driven, never started again (`JobFailures.fail`)."""
        self.optimiser = None
        self.fenced.clear()
        self.failed = why

    def clear_failure(self) -> None:
        """An operator released the job from quarantine: it may be started again."""
        self.failed = None

    def wait_for_agents(self, retry_at: float) -> bool:
        """Not started again before `retry_at`: its GPUs' agents did not answer.

        True the first time only, so the job says once that it waits.
        """
        self.retry_at = retry_at
        if self.waiting_said:
            return False
        self.waiting_said = True
        return True

    def may_start(self, now: float) -> bool:
        """Whether an optimiser may be started for the job now (owner and quarantine aside)."""
        return (self.record is not None and self.record.complete and self.optimiser is None
                and not self.starting and self.failed is None and now >= self.retry_at)

    # ------------------------------------------------------------------ its record
    def know(self, record: JobRecord) -> None:
        """The job's record (the table's: it indexes the driver by it)."""
        self.record = record

    def bind_gpu(self, gpu: tuple[str, str]) -> None:
        """A rank of the job drives `gpu` (node token, GPU index token), as the table indexes it."""
        self.gpus.add(gpu)

    def quiet(self, now: float, limit_s: float) -> bool:
        """Whether the job had no input for more than `limit_s` (True if its record is unknown)."""
        return self.record is None or now - self.record.last_active_s > limit_s

    def bound_here(self, rank: int, node: str, gpu: int | None) -> bool:
        """Whether `rank` is bound to a GPU of `node` (a subject token), GPU `gpu` if given."""
        rr = self.record.ranks.get(rank) if self.record is not None else None
        if rr is None or subjects.token(rr.gpu.node) != node:
            return False
        return gpu is None or rr.gpu.gpu_index == gpu

    # ------------------------------------------------------------------ its progress
    def remember_progress(self, progress: dict[str, Any] | None) -> None:
        """The progress its owner recorded: what this replica resumes from if it takes over."""
        self.recorded = progress or None

    def forget_progress(self) -> None:
        """Taken in by the optimiser (or read again before the next start)."""
        self.recorded = None

    def keep_unsaved(self, kind: str, state: Any) -> None:
        """The latest progress, kept until JetStream has it (only the latest matters)."""
        self.unsaved = (kind, state)

    def not_saved(self) -> bool:
        """JetStream could not take the progress (kept); True the first time, to say so once."""
        if self.unsaved_warned:
            return False
        self.unsaved_warned = True
        return True

    def saved(self, latest: tuple[str, Any]) -> None:
        """JetStream has `latest`: dropped unless newer progress came meanwhile."""
        self.unsaved_warned = False
        if self.unsaved is latest:
            self.unsaved = None

    def drop_unsaved(self) -> None:
        """Not ours to write any more (another replica holds the job)."""
        self.unsaved = None

    # ------------------------------------------------------------------ its GPUs
    def schedule_sent(self, rank: int, now: float) -> None:
        """The rank's schedule was sent now (a heartbeat older than that may lack it)."""
        self.installed_at[rank] = now

    def first_observe_only(self, node: str, gpu: int) -> bool:
        """Whether (node token, GPU) is newly observe-only: True once each, to say it once."""
        if (node, gpu) in self.observe_only_said:
            return False
        self.observe_only_said.add((node, gpu))
        return True

    def try_late_renewal(self, now: float, min_gap_s: float) -> bool:
        """Whether to renew its late lease now: at most once per `min_gap_s` (noted as tried)."""
        if now - self.late_renewal < min_gap_s:
            return False
        self.late_renewal = now
        return True

    # ------------------------------------------------------------------ the lapse throttle
    def recent_reapplies(self, rank: int, now: float, window_s: float) -> list[float]:
        """When the rank's lapsed settings were set again within the last `window_s`."""
        return [t for t in self.lapse_reapplies.get(rank, []) if now - t < window_s]

    def reapplied(self, rank: int, recent: list[float], now: float) -> None:
        """The rank's lapsed settings are set again now (`recent`: the earlier ones counted)."""
        self.lapse_reapplies[rank] = [*recent, now]

    def throttled(self, rank: int, recent: list[float]) -> None:
        """The rank's lapsed settings stay lapsed: only `recent` (in the window) is counted."""
        self.lapse_reapplies[rank] = recent

    def keep_lapsed(self, rank: int, settings: Iterable[str]) -> None:
        """Settings of the rank to set again once this replica's own lease is back."""
        self.pending_lapses.setdefault(rank, set()).update(settings)

    def take_pending_lapses(self) -> list[tuple[int, set[str]]]:
        """The kept lapsed settings, by rank, now no longer kept (they are set again)."""
        taken = list(self.pending_lapses.items())
        self.pending_lapses.clear()
        return taken

    def drop_pending_lapses(self) -> None:
        """Another replica drives the job now, or no optimiser here does: nothing to set again."""
        self.pending_lapses.clear()

    def fence(self, actions: Iterable[Action]) -> None:
        """Keep actions this replica did not carry out (its lease was lapsing).

        Of a limit, the schedules and a question, the latest (`SUPERSEDED`); past
        `MAX_FENCED`, the oldest statuses and files are dropped, never a command or question
        (a dropped limit was never caught up: the GPUs waited for the job's next one).
        """
        for action in actions:
            kind = next((k for k in SUPERSEDED if isinstance(action, k)), None)
            if kind is not None:
                self.fenced = [a for a in self.fenced if not isinstance(a, kind)]
            self.fenced.append(action)
        excess = len(self.fenced) - MAX_FENCED
        if excess > 0:
            kept = []
            for a in self.fenced:
                if excess > 0 and isinstance(a, StatusUpdate | KeepFile):
                    excess -= 1
                    continue
                kept.append(a)
            self.fenced = kept

    def take_fenced(self) -> list[Action]:
        """The fenced actions, now no longer kept (they are caught up, or dropped)."""
        taken, self.fenced = self.fenced, []
        return taken

    def forget_lapses_on(self, node: str) -> None:
        """End the lapse throttle of the ranks on `node` (a subject token): its agent restarted."""
        if not self.lapse_reapplies:
            return
        ranks = self.record.ranks if self.record is not None else {}
        for r in list(self.lapse_reapplies):
            if r in ranks and subjects.token(ranks[r].gpu.node) == node:
                del self.lapse_reapplies[r]
