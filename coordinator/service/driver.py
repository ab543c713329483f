"""`JobDriver`: everything one replica holds about one job, in one place.

The service keeps one driver per job it knows (`CoordinatorService.drivers`); forgetting a job
is dropping its driver, so no per-job map can outlive the job. A driver holds the job's
optimiser while this replica drives it (`optimiser`, None otherwise), the lock that keeps the
job's inputs in order, the progress its owner recorded and what is not recorded yet, and what
the shell remembers of its GPUs: when each rank's schedule was sent, the lapse throttle, the
settings to set again once this replica's own lease is back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from coordinator.optimizer import JobOptimizer

__all__ = ["JobDriver"]


@dataclass(eq=False)
class JobDriver:
    """One job's state in this replica.

    Attributes:
        job_id: The job.
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
        observe_only_said: (node token, GPU) said to be observe-only (once each).
        late_renewal: When an action last renewed this replica's late lease (wall clock).
        failed: Why the job failed here (`JobFailures.fail`): it is never started again.
        retry_at: Not started again before this time (coordinator clock): its GPUs' agents did
            not answer (`OptimiserStarter`).
        waiting_said: Said once that the job waits for its GPUs' agents.
    """

    job_id: str
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
    observe_only_said: set[tuple[str, int]] = field(default_factory=set)
    late_renewal: float = 0.0
    failed: str | None = None
    retry_at: float = 0.0
    waiting_said: bool = False
