"""`LoopBucket`: what the budget loop keeps in the state bucket, and resumes from (thin shell).

A replica that takes the budgets over starts from what its predecessor kept: each budget's
backoff and caps (`store.Backoffs`). What was measured of each Perseus job's options under the
caps is kept by the replica driving the job, owner or not (`store.TimingStore`,
`budget.timing`), as are the frontiers of those jobs and the points the owner gives them
(`budget.remote`). Every write is best effort: the bucket away, the next round writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.budget import budgets as core
from coordinator.budget import enforce, frontier_options, remote
from coordinator.budget.store import Backoffs, BudgetView, TimingStore
from coordinator.budget.timing import Timing, frontier_digest, worth_keeping
from zeus_agent.wire.budget import BudgetTiming

if TYPE_CHECKING:  # (coordinator.service builds the loop: no import cycle at run time)
    from coordinator.service.link import Link

LOG = logging.getLogger(__name__)


class LoopBucket:
    """The budget loop's records in the state bucket: what it wrote, and what it read."""

    def __init__(self, link: Link, view: BudgetView, wall: Callable[[], float]) -> None:
        self.link = link
        self.view = view
        self.wall = wall
        self.kept: dict[str, float] = {}
        """Budget -> the backoff last written to the state bucket (`keep_backoffs`)."""
        self.kept_caps: dict[str, dict[core.GpuKey, int]] = {}
        """Budget -> the caps last written with it."""
        self.timing_read: set[str] = set()
        """Pipeline jobs driven here whose kept measures were read (`resume_timing`)."""
        self.timing_kept: dict[str, BudgetTiming] = {}
        """Job -> its measures as last written to (or read from) the state bucket."""
        self.frontiers_sent: dict[str, tuple[frontier_options.FrontierView, float | None,
                                             bool]] = {}
        """Perseus job driven here -> its frontier and own draw as recorded (`budget.remote`)."""
        self.points_sent: dict[str, tuple[int, float]] = {}
        """Perseus job another replica drives -> the point recorded for it (as the owner)."""

    def disown(self) -> None:
        """Another replica owns the budgets: what this one wrote as the owner is its now."""
        self.kept.clear()
        self.kept_caps.clear()
        self.points_sent.clear()

    async def resume_backoffs(self, tighteners: dict[str, enforce.Tightener]) -> None:
        """A budget new to this owner starts from the backoff its last owner kept."""
        now = self.wall()
        for bid, (budget, set_at) in list(self.view.budgets.items()):
            if bid in tighteners or not budget.active(now):
                continue
            try:
                kept = await Backoffs(self.link.require_state().kv).get(bid, set_at)
            except Exception as e:  # noqa: BLE001 - the bucket is away: start afresh
                LOG.warning("budget %s: its backoff not read (%s)", bid, e)
                kept = None
            tight = tighteners[bid] = enforce.Tightener(fresh=kept is None)
            if kept is not None:
                tight.backoff_w, self.kept[bid], self.kept_caps[bid] = kept[0], kept[0], kept[1]
                tight.resume(kept[1], kept[2])
                LOG.info("budget %s: resumed with a backoff of %.0f W", bid, kept[0])

    async def keep_backoffs(self, tighteners: dict[str, enforce.Tightener],
                            plans: dict[str, enforce.CapPlan]) -> None:
        """Write each budget's backoff and caps when they moved; forget those of budgets gone."""
        try:
            backoffs = Backoffs(self.link.require_state().kv)
            for bid, tight in tighteners.items():
                p = plans.get(bid)
                if bid not in self.view.budgets or p is None:
                    continue
                if tight.worth_keeping(self.kept.get(bid)) or p.caps != self.kept_caps.get(bid):
                    await backoffs.put(bid, self.view.budgets[bid][1], tight.backoff_w, p.caps,
                                       tight.jitter_w)
                    self.kept[bid], self.kept_caps[bid] = tight.backoff_w, p.caps
            for gone in [b for b in self.kept_caps if b not in tighteners]:
                await backoffs.delete(gone)
                self.kept.pop(gone, None)
                del self.kept_caps[gone]
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("budget backoffs not kept: %s", e)

    async def resume_timing(self, jobs: list[enforce.JobView], timing: Timing) -> None:
        """A Perseus job new here starts from the measures its last driver kept.

        Read once per job driven here (again when its read failed, or when it comes back
        here), taken only for the frontier they were measured on (`Timing.restore`). Those of
        a job another replica drives are followed instead (`Recorded.measured`).
        """
        new = [j for j in jobs if j.frontier is not None and not j.remote
               and j.job_id not in self.timing_read]
        if not new:
            return
        store = TimingStore(self.link.require_state().kv)
        for job in new:
            assert job.frontier is not None
            try:
                kept = await store.get(job.job_id)
            except Exception as e:  # noqa: BLE001 - the bucket is away: the next round reads
                LOG.warning("job %s: its kept measures not read (%s)", job.job_id, e)
                return
            self.timing_read.add(job.job_id)
            digest = frontier_digest(job.frontier.chosen, job.frontier.times)
            if kept is not None and timing.restore(job.job_id, digest, kept):
                self.timing_kept[job.job_id] = kept
                LOG.info("job %s: resumed with %d options measured under the budgets",
                         job.job_id, len(kept.options))

    async def keep_timing(self, jobs: list[enforce.JobView], timing: Timing) -> None:
        """Write the measures of the Perseus jobs when they moved (`timing.worth_keeping`).

        Those of a job gone, or that planned another frontier, are purged. A job's measures
        are written by the replica that measures them, the one driving it: none of a job
        another replica drives (those measured here are forgotten: back here, it starts from
        its other driver's, `resume_timing`).
        """
        theirs = {j.job_id for j in jobs if j.remote}
        self.timing_read = {j.job_id for j in jobs if j.job_id in self.timing_read} - theirs
        # (Its driver's measures are the news: back here, it starts from them, not from
        # what was measured here before, which it would write over them.)
        timing.forget({j.job_id for j in jobs} - theirs)
        try:
            store = TimingStore(self.link.require_state().kv)
            for job_id in [j for j in timing.served if j not in theirs]:
                now = timing.record(job_id)
                if now is not None and worth_keeping(self.timing_kept.get(job_id), now):
                    await store.put(now)
                    self.timing_kept[job_id] = now
            for gone in [j for j in self.timing_kept if timing.record(j) is None
                         or j in theirs]:
                if gone not in theirs:
                    await store.delete(gone)
                del self.timing_kept[gone]
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("measures under the budgets not kept: %s", e)

    async def record_frontiers(self, jobs: list[enforce.JobView],
                               capped: Callable[[enforce.JobView], bool] = lambda j: False,
                               ) -> None:
        """Record the frontiers of the Perseus jobs driven here (`remote.record_frontiers`)."""
        try:
            await remote.record_frontiers(self.link.require_state().kv, jobs,
                                          self.frontiers_sent, capped)
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("frontiers not recorded for the budgets: %s", e)

    async def record_points(self, points: dict[str, tuple[int, float]],
                            views: list[enforce.JobView]) -> None:
        """Record the points given jobs another replica drives (`remote.record_points`)."""
        try:
            await remote.record_points(self.link.require_state().kv, points, views,
                                       self.view.remote, self.points_sent)
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("frontier points not recorded: %s", e)
