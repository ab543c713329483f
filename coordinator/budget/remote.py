"""Perseus jobs another replica drives, under the budgets, through the state bucket (shell).

* The replica driving a Perseus job records its frontier while budgets exist
  (`budget_frontier.<h>`, a `BudgetFrontier`, written when it changes; purged when the job
  stops serving a plan of it, ends, or is removed).
* The replica applying the budgets plans on a recorded frontier as on one of its own jobs'
  (`job_views.job_views`) and records the point it gives such a job (`budget_point.<h>`, a
  `BudgetPoint`, written when it moves; purged when no budget gives the job one).
* The replica driving the job measures it at the points it serves (`budget.timing`) and
  records the measures (`budget_timing.<h>`, `store.TimingStore`); the owner counts the job's
  options at them.
* Every replica follows all three (`Recorded`); the one driving the job serves the recorded
  point while a budget governs the job's GPUs (`BudgetLoop.held_here`).

With the frontier, its driver records the job's draw at its own point from its ranks'
energies (`BudgetFrontier.own_draw_w`), by which the owner calibrates the frontier's powers
(without it, by the job's GPUs' samples while it serves its own point).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from coordinator.budget import recorded
from coordinator.budget.enforce import JobView
from coordinator.budget.frontier_options import FrontierView, Served
from coordinator.state.records import FRONTIER_PREFIX, POINT_PREFIX, TIMING_PREFIX, job_hash
from zeus_agent.wire.budget import BudgetFrontier, BudgetPoint, BudgetTiming
from zeus_agent.wire.text import bounded

LOG = logging.getLogger(__name__)

__all__ = ["FRONTIER_PREFIX", "POINT_PREFIX", "TIMING_PREFIX", "Recorded", "record_frontiers",
           "record_points"]

MAX_VALUE_BYTES = 1_000_000
"""Largest value read (a frontier at its `MAX_FRONTIER_POINTS`: about 150 KB)."""


class Recorded:
    """The frontiers and points recorded, kept current by two watches (`on_frontier`...)."""

    def __init__(self) -> None:
        self.frontiers: dict[str, tuple[str, FrontierView, float | None, bool]] = {}
        """Job digest -> (job id, its recorded frontier, its draw per GPU at its own point,
        whether it was planned from a profile a budget's caps throttled)."""
        self.points: dict[str, tuple[str, tuple[int, float]]] = {}
        """Job digest -> (job id, the point the budgets' owner gave it)."""
        self.timings: dict[str, BudgetTiming] = {}
        """Job digest -> its options as measured by the replica driving it."""

    def frontier(self, job_id: str) -> FrontierView | None:
        """A job's recorded frontier, if any."""
        found = self.frontiers.get(job_hash(job_id))
        return found[1] if found is not None and found[0] == job_id else None

    def own_draw_w(self, job_id: str) -> float | None:
        """A job's recorded draw per GPU at its own point, if any."""
        found = self.frontiers.get(job_hash(job_id))
        return found[2] if found is not None and found[0] == job_id else None

    def planned_capped(self, job_id: str, frontier: FrontierView) -> bool:
        """Whether a job's record says `frontier` was planned under a budget's caps.

        Only for that frontier: a job that planned again has another (its record follows).
        """
        found = self.frontiers.get(job_hash(job_id))
        return found is not None and found[0] == job_id and found[3] and found[1] == frontier

    def point(self, job_id: str) -> tuple[int, float] | None:
        """The point recorded for a job, if any."""
        found = self.points.get(job_hash(job_id))
        return found[1] if found is not None and found[0] == job_id else None

    def measured(self, job_id: str, frontier: str) -> tuple[Served, ...] | None:
        """A job's options as recorded measured on the frontier `frontier` digests, if any."""
        found = self.timings.get(job_hash(job_id))
        if found is None or found.job_id != job_id or found.frontier != frontier:
            return None
        return tuple(sorted((Served(o.key, o.relative_time, o.power_w) for o in found.options),
                            key=lambda m: -m.key))

    async def on_timing(self, entry: Any) -> None:
        """Apply one entry of the watch of `budget_timing.>` (`store.TimingStore`)."""
        value = _read(entry, TIMING_PREFIX, BudgetTiming)
        h = str(entry.key)[len(TIMING_PREFIX):]
        if value is None:
            self.timings.pop(h, None)
        else:
            self.timings[h] = value

    async def on_frontier(self, entry: Any) -> None:
        """Apply one entry of the watch of `budget_frontier.>`."""
        value = _read(entry, FRONTIER_PREFIX, BudgetFrontier)
        h = str(entry.key)[len(FRONTIER_PREFIX):]
        if value is None:
            self.frontiers.pop(h, None)
        else:
            self.frontiers[h] = (value.job_id, recorded.frontier_view(value), value.own_draw_w,
                                 value.planned_capped)

    async def on_point(self, entry: Any) -> None:
        """Apply one entry of the watch of `budget_point.>`."""
        value = _read(entry, POINT_PREFIX, BudgetPoint)
        h = str(entry.key)[len(POINT_PREFIX):]
        if value is None:
            self.points.pop(h, None)
        else:
            self.points[h] = (value.job_id, (value.index, value.power_w))


def _read(entry: Any, prefix: str, model: Any) -> Any:
    """The entry's value as `model`; None: deleted, or unreadable (logged)."""
    if getattr(entry, "operation", None) in ("DEL", "PURGE") or not entry.value:
        return None
    try:
        if len(entry.value) > MAX_VALUE_BYTES:
            raise ValueError(f"{len(entry.value)} bytes, at most {MAX_VALUE_BYTES} read")
        value = model.model_validate_json(entry.value)
        if job_hash(value.job_id) != str(entry.key)[len(prefix):]:
            raise ValueError(f"it names job {value.job_id!r}, whose key is another")
    except ValueError as e:  # (pydantic's ValidationError is one.)
        LOG.warning("%s in the state bucket: %s", bounded(entry.key, 200), bounded(e, 300))
        return None
    return value


async def record_frontiers(kv: Any, jobs: Iterable[JobView],
                           kept: dict[str, tuple[FrontierView, float | None, bool]],
                           capped: Callable[[JobView], bool] = lambda job: False) -> None:
    """Record the frontiers of the Perseus jobs driven here (`kept`: as last written).

    Written again when the frontier changes, the job's own draw moves
    (`recorded.draw_moved`), or what `capped` says of it changes (its frontier was planned
    under a budget's caps: `CappedProfiles.planned_capped`). A job driven here without a
    frontier now, or gone, has its record purged; one another replica drives now is left to it.
    """
    seen = {j.job_id: j for j in jobs}
    for job in seen.values():
        if job.remote or job.frontier is None:
            continue
        sent, flag = kept.get(job.job_id), capped(job)
        if sent is not None and sent[0] == job.frontier and sent[2] == flag and not (
                recorded.draw_moved(sent[1], job.own_draw_w)):
            continue
        record = recorded.frontier_record(job.job_id, job.frontier, job.own_draw_w, flag)
        if record is None:
            LOG.warning("job %s: its frontier is too large to record for the budgets",
                        job.job_id)
            continue
        await kv.put(FRONTIER_PREFIX + job_hash(job.job_id), record.model_dump_json().encode())
        kept[job.job_id] = (job.frontier, record.own_draw_w, flag)
    for job_id in list(kept):
        now = seen.get(job_id)
        if now is not None and now.remote:
            del kept[job_id]  # (Its new driver records it.)
        elif now is None or now.frontier is None:
            await kv.purge(FRONTIER_PREFIX + job_hash(job_id))
            del kept[job_id]


async def record_points(kv: Any, points: Mapping[str, tuple[int, float]],
                        jobs: Iterable[JobView], follows: Recorded,
                        sent: dict[str, tuple[int, float]]) -> None:
    """Record the points given the jobs another replica drives; purge those given none.

    `sent`: as written by this replica; `follows`: the records as every replica sees them
    (a replica taking the budgets over purges its predecessor's points it does not give).
    """
    remote = {j.job_id for j in jobs if j.remote}
    for job_id, point in points.items():
        if job_id not in remote or not recorded.point_moved(
                sent.get(job_id, follows.point(job_id)), point):
            continue
        record = recorded.point_record(job_id, point)
        if record is not None:
            await kv.put(POINT_PREFIX + job_hash(job_id), record.model_dump_json().encode())
            sent[job_id] = point
    stale = {job_id for job_id, _ in follows.points.values()} | set(sent)
    for job_id in stale - {j for j in points if j in remote}:
        await kv.purge(POINT_PREFIX + job_hash(job_id))
        sent.pop(job_id, None)
