"""`BudgetLoop`: one replica applies the power budgets to the agents (thin shell).

Every `PERIOD_S`, the replica holding the budgets' lease reads the budgets from the state
bucket, asks `budgets.governing` which budget governs which GPU, and for each budget plans a
cap per GPU (`enforce.plan`: the allocator over the jobs' profiles, tightened while the group
measures over its room), then sends every governed GPU its cap (`NodeCapCmd`, holder
`budget:<id>`): resending it each round renews it, and reaches an agent that restarted. Its
lease is `cap_lease_s` for a budget without an end; a budget with an end is held by the agents
until it ends (at most an hour ahead), so the cap holds even if every coordinator is gone.
A GPU it capped that no budget governs any more (the budget was lifted or ended) gets a lift,
and its job's own limit (or the default) comes back at once.

Ownership: one lease in the ownership bucket under the key `budgets`, taken and renewed like a
job's (`OwnershipBook`; the ownership loop renews every lease this replica holds and gives
them up at shutdown), taken only while a budget exists. Its job id has a control character,
which no job's id may have, so it never names a job. A replica that takes over knows nothing
of what its predecessor capped: caps it does not renew lapse with their lease; the caps it
keeps are sent at once. The lease of a cap is longer than a takeover, so the cap holds
throughout one. It starts from what its predecessor kept in the state bucket: each budget's
backoff and caps (`store.Backoffs`). What was measured of each Perseus job's options under
the caps is kept there by the replica driving the job, owner or not (`store.TimingStore`,
`budget.timing`), as are the frontiers of those jobs and the points the owner gives them
(`budget.remote`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from coordinator.budget import budgets as core
from coordinator.budget import enforce, frontier_options, remote
from coordinator.budget.allocator import BudgetError
from coordinator.budget.store import Backoffs, BudgetView, LiftedCaps, TimingStore
from coordinator.budget.timing import Timing, frontier_digest, worth_keeping
from coordinator.optimizer import Action
from coordinator.pipeline import budget_point
from coordinator.pipeline.job import PipelineJob
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.job_parts import make_selector
from coordinator.state.ownership import OwnershipBook
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetStatus, BudgetTiming
from zeus_agent.wire.messages import CommandEnvelope, Reply
from zeus_agent.wire.node_cap import MAX_CAP_LEASE_S, NodeCapCmd

if TYPE_CHECKING:  # (coordinator.service builds this loop: no import cycle at run time)
    from coordinator.jobs.registry import JobRecord
    from coordinator.service.driver import JobDriver
    from coordinator.service.link import Link

LOG = logging.getLogger(__name__)

Execute = Callable[["JobRecord", list[Action]], Awaitable[None]]
"""Runs a job's actions (`ActionExecutor.execute`)."""
Serve = Callable[[dict[str, tuple[int, float]]], Awaitable[None]]
"""Tells the pipeline jobs their points (`serve_points` over this replica's drivers)."""
CapJobs = Callable[[dict[core.GpuKey, int], set[core.GpuKey]], Awaitable[None]]
"""Tells the power-limit jobs still profiling their cap (`job_caps.cap_profiling_jobs`)."""

PERIOD_S = 1.0
"""How often the owner plans and sends the caps (s); and at once when a budget changes."""
COUNTED_GAP = 0.9
"""A round this part of a period after the last counted one counts (samples come each
period)."""
LEASE_KEY = "budgets"
"""The budgets' lease in the ownership bucket (a job's key is 32 hex digits)."""
LEASE_ID = "\x1fbudgets"
"""What the lease names as its job: no job id has a control character."""
COMMAND_TIMEOUT_S = 2.0


def job_views(drivers: Iterable[JobDriver],
              follows: remote.Recorded | None = None) -> list[enforce.JobView]:
    """What the budgets know of the jobs: their GPUs; their profiles where known.

    A power-limit job with its optimum known brings its measurements: driven by this replica,
    its own; driven by another, the profile its owner recorded in the state bucket
    (`recorded_profile`); a pipeline job serving a plan of its frontier (Perseus) its
    frontier: driven here, its own; driven by another, the one that replica recorded
    (`follows`, `budget.remote`); every other job (profiling, a job another replica drives
    with nothing recorded, one that failed here: its frontier record is then purged) is
    capped proportionally. Each job's slowdown counts as its
    registered `priority`.
    """
    views = []
    for driver in drivers:
        record = driver.record
        if record is None or not record.ranks:
            continue
        gpus = tuple(sorted((r.gpu.node, r.gpu.gpu_index) for r in record.ranks.values()))
        job = driver.optimiser
        weight = record.power_limit.priority if record.power_limit is not None else 1.0
        if driver.failed is not None:  # (Driven by no replica: not one another drives.)
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight))
            continue
        frontier = budget_point.frontier_of(job) if isinstance(job, PipelineJob) else None
        if isinstance(job, PowerLimitJob) and job.optimal_power_limit is not None:
            views.append(enforce.JobView(driver.job_id, gpus,
                                         tuple(job.machine.measurements),
                                         job.optimal_power_limit, weight))
        elif job is None and (known := recorded_profile(driver)) is not None:
            views.append(enforce.JobView(driver.job_id, gpus, *known, weight, remote=True))
        elif job is None and follows is not None and (
                theirs := follows.frontier(driver.job_id)) is not None:
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight, frontier=theirs,
                                         own_draw_w=follows.own_draw_w(driver.job_id),
                                         remote=True))
        elif frontier is not None and isinstance(job, PipelineJob):
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight, frontier=frontier,
                                         own_point=not job.straggling.stragglers.factors(),
                                         step_times=tuple(job.straggling.step_times),
                                         own_step_s=job.straggling.own_step_s(),
                                         own_draw_w=job.straggling.own_draw_w()))
        else:
            views.append(enforce.JobView(driver.job_id, gpus, weight=weight,
                                         remote=job is None))
    return views


def recorded_profile(driver: JobDriver) -> tuple[tuple[PowerLimitMeasurement, ...], int] | None:
    """(measurements, optimum) of a power-limit job another replica drives, as recorded.

    From the profile its owner recorded (`v.prog.<h>`: "profile", or "chosen" by the user's
    own selector). The optimum of a plain profile is the job's selector's choice, as its
    owner made it (a user's own selector records its choice). None: no profile recorded, or
    not readable.
    """
    record, recorded = driver.record, driver.recorded
    if record is None or record.power_limit is None or not recorded:
        return None
    kind, state = recorded.get("kind"), recorded.get("state")
    try:
        if kind == "chosen" and isinstance(state, dict):
            rows = tuple(PowerLimitMeasurement(**m) for m in state["measurements"])
            return (rows, int(state["power_limit"])) if rows else None
        if kind != "profile" or not isinstance(state, list) or not state:
            return None
        rows = tuple(PowerLimitMeasurement(**m) for m in state)
        selector = make_selector(record.power_limit, record.job.world_size)
        return rows, int(selector.select(list(rows)))
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as e:
        LOG.debug("job %s: its recorded profile is not usable for budgets: %s", driver.job_id, e)
        return None


async def serve_points(drivers: Iterable[JobDriver], execute: Execute,
                       points: Mapping[str, tuple[int, float]]) -> None:
    """Tell each pipeline job driven here the frontier point a budget gives it, or none.

    `points`: job -> (frontier index, power per GPU); a job absent from it goes back to its
    own chosen point (`budget_point.serve`). The actions run under the job's lock.
    """
    for driver in drivers:
        job, record = driver.optimiser, driver.record
        if not isinstance(job, PipelineJob) or record is None:
            continue
        want = points.get(driver.job_id)
        if want is None and job.straggling.budget is None and not job.straggling.governed:
            continue
        async with driver.lock:
            actions = budget_point.serve(job, want)
            if actions:
                await execute(record, actions)


def frontier_points(plans: Iterable[enforce.CapPlan], jobs: Iterable[enforce.JobView],
                    ratios: Mapping[str, float] | None = None) -> dict[str, tuple[int, float]]:
    """Job -> (frontier index, power per GPU) the plans give its pipeline jobs.

    A job governed by several budgets serves the point of least power among theirs (along a
    frontier, the slowest); a job given its own chosen point is told that one (it keeps its
    plan, capped). A job no plan governs is absent. The power is the job's planned one: for
    a frontier point, its plan's (the allocator counts a point served at its measured draw,
    which `budget_point.pick` would take for a changed frontier); for a throttled option, the
    allocator's; over the job's calibration `ratios`.
    """
    frontiers = {j.job_id: j.frontier for j in jobs if j.frontier is not None}
    points: dict[str, tuple[int, float]] = {}
    for p in plans:
        for share in p.allocation.shares:
            f = frontiers.get(share.job_id)
            if f is None or share.key is None:
                continue
            if 0 <= share.key < len(f.powers):
                power = f.powers[share.key]
            else:
                power = share.expected_w / max(1, len(p.members.get(share.job_id, ())))
            power /= (ratios or {}).get(share.job_id, 1.0)
            if share.job_id not in points or power < points[share.job_id][1]:
                points[share.job_id] = (share.key, power)
    return points


def told_key(job: enforce.JobView, told: tuple[int, float] | None) -> int | None:
    """The option a pipeline job runs, told `told` (None: its own point, or a straggler's).

    The point it serves (`frontier_options.served`), not the index told: a point recorded
    for a frontier it planned before is served as another of this one.
    """
    f = job.frontier
    if told is None or f is None or not job.own_point:
        return None
    key = frontier_options.served(f, *told)
    return None if key == f.chosen else key


def holder(budget_id: str) -> str:
    """Who holds a budget's caps on the agents."""
    return f"budget:{budget_id}"


class BudgetLoop:
    """Plans and sends the caps while this replica holds the budgets' lease."""

    def __init__(self, *, link: Link, book: OwnershipBook, cluster: core.Cluster,
                 jobs: Callable[[], list[enforce.JobView]], cap_lease_s: float,
                 view: BudgetView, wall: Callable[[], float] = time.time,
                 serve: Serve | None = None, cap_jobs: CapJobs | None = None,
                 margin_pct: float = 0.0) -> None:
        self.link = link
        self.view = view
        """The budgets, as the state bucket's watch keeps them (`BudgetView`)."""
        self.book = book
        self.cluster = cluster
        self.jobs = jobs
        self.cap_lease_s = cap_lease_s
        self.margin_pct = margin_pct
        """Percent of each budget's room kept unused (`enforce.with_margin`)."""
        self.wall = wall
        self.capped: dict[core.GpuKey, str] = {}
        """GPU -> the holder this replica capped it for (lifted when no budget governs it)."""
        self.unlifted: dict[core.GpuKey, tuple[str, float]] = {}
        """GPU -> (holder, until when) of a lift it did not take: sent again every round."""
        self.tighteners: dict[str, enforce.Tightener] = {}
        self.plans: dict[str, enforce.CapPlan] = {}
        """The latest plan of each governing budget (for people, tests and benchmarks)."""
        self.statuses: dict[str, BudgetStatus] = {}
        """What each plan says, as published (`zeus-coordinator watch`, the metrics)."""
        self.failures = 0
        self.counted_at = -math.inf
        """When the last round that counted began (monotonic s): a round woken sooner
        (`zeus_agent.aio.every`'s wake) plans on the same samples and counts nothing."""
        self.serve = serve
        """Tells the pipeline jobs their budget's frontier point (`serve_points`)."""
        self.ratios: dict[str, float] = {}
        """Pipeline job -> its measured over planned power at its own point (learnt while it
        serves that point, kept while a budget moves it: `frontier_options.own_ratio`)."""
        self.settling: dict[str, int] = {}
        """Pipeline job -> rounds left before its draw is its own point's again."""
        self.timing = Timing(enforce.SETTLE_ROUNDS)
        """The pipeline jobs' measured step times under the caps (`budget.timing`)."""
        self.timing_read: set[str] = set()
        """Pipeline jobs driven here whose kept measures were read (`resume_timing`)."""
        self.timing_kept: dict[str, BudgetTiming] = {}
        """Job -> its measures as last written to (or read from) the state bucket."""
        self.frontiers_sent: dict[str, tuple[frontier_options.FrontierView, float | None]] = {}
        """Perseus job driven here -> its frontier and own draw as recorded (`budget.remote`)."""
        self.points_sent: dict[str, tuple[int, float]] = {}
        """Perseus job another replica drives -> the point recorded for it (as the owner)."""
        self.views: list[enforce.JobView] = []
        """The jobs as the latest round saw them."""
        self.points: dict[str, tuple[int, float]] = {}
        """Job -> the frontier point (index, power per GPU) a budget gives it, as told."""
        self.cap_jobs = cap_jobs
        """Tells the power-limit jobs still profiling here their cap (every replica)."""
        self.kept: dict[str, float] = {}
        """Budget -> the backoff last written to the state bucket (`keep_backoffs`)."""
        self.kept_caps: dict[str, dict[core.GpuKey, int]] = {}
        """Budget -> the caps last written with it."""

    async def tick(self) -> None:
        """One round: own, plan, send caps and lifts."""
        if self.link.state is None or not self.link.connected:
            return
        budgets = [b for b, _ in self.view.budgets.values()]
        if (not budgets and not self.capped and not self.points and not self.unlifted
                and not self.view.lifted and not self.view.remote.points):
            await self.cap_profiling({}, budgets)  # (A lift seen here: the jobs learn it.)
            return
        jobs = self.jobs()
        await self.record_frontiers(jobs)
        await self.resume_timing(jobs)
        now_s = time.monotonic()
        counting = now_s - self.counted_at >= COUNTED_GAP * PERIOD_S
        if counting:
            self.counted_at = now_s
        if not await self.own():
            self.capped.clear()  # Another replica acts; what was sent here lapses or is kept.
            self.tighteners.clear()  # (Its backoffs too: back here, start from the kept ones.)
            self.kept.clear()
            self.kept_caps.clear()
            self.plans.clear()
            self.statuses.clear()
            self.points_sent.clear()
            held = self.held_here(budgets, jobs)  # (The owner caps them.)
            if counting:
                self.measure_here(jobs, held)
            await self.tell(held)
            await self.keep_timing(jobs)
            await self.cap_profiling({}, budgets)
            return
        await self.resume_backoffs()
        caps = self.plan(budgets, counting, jobs)
        leases = self.cap_leases(budgets)
        now = self.wall()
        lifts = {k: h for k, (h, until) in self.unlifted.items() if until > now}
        lifts = {k: h for k, h in (lifts | self.capped).items() if k not in caps}
        done = await asyncio.gather(
            *(self.send(k, w, h, leases.get(h)) for k, (w, h) in caps.items()),
            *(self.send(k, None, h) for k, h in lifts.items()))
        # (A lift not taken is sent again while the cap it lifts may still hold.)
        self.unlifted = {k: (h, self.unlifted.get(k, (h, now + MAX_CAP_LEASE_S))[1])
                         for (k, h), ok in zip(lifts.items(), done[len(caps):], strict=True)
                         if not ok}
        self.capped = {k: h for k, (_, h) in caps.items()}
        await self.lift_lifted(now)
        points = frontier_points(self.plans.values(), self.views, self.ratios)
        await self.tell(points)
        await self.record_points(points)
        await self.cap_profiling({k: w for k, (w, _) in caps.items()}, budgets)
        await self.keep_backoffs()
        await self.keep_timing(self.views)
        await self.publish()

    async def lift_lifted(self, now: float) -> None:
        """Lift the caps of the budgets lifted lately (`LiftedCaps`) until every GPU took it.

        Whoever owns the budgets does, every round: the lift request's replica lifted them
        once, but an agent that missed it, or an owner that died as the budget was lifted,
        would leave a GPU capped until its cap lapses (up to an hour for a budget with an end).
        """
        for bid, (gpus, until) in list(self.view.lifted.items()):
            by = holder(bid)
            if until > now and not all(
                    await asyncio.gather(*(self.send(k, None, by) for k in gpus))):
                continue  # (Again next round.)
            try:
                await LiftedCaps(self.link.require_state().kv).forget(bid)
            except Exception as e:  # noqa: BLE001 - the bucket is away: next round
                LOG.warning("lifted budget %s: not forgotten yet (%s)", bid, e)
                continue
            self.view.lifted.pop(bid, None)
            LOG.info("budget %s: lifted on all its %d GPUs", bid, len(gpus))

    async def resume_backoffs(self) -> None:
        """A budget new to this owner starts from the backoff its last owner kept."""
        now = self.wall()
        for bid, (budget, set_at) in list(self.view.budgets.items()):
            if bid in self.tighteners or not budget.active(now):
                continue
            try:
                kept = await Backoffs(self.link.require_state().kv).get(bid, set_at)
            except Exception as e:  # noqa: BLE001 - the bucket is away: start afresh
                LOG.warning("budget %s: its backoff not read (%s)", bid, e)
                kept = None
            tight = self.tighteners[bid] = enforce.Tightener(fresh=kept is None)
            if kept is not None:
                tight.backoff_w, self.kept[bid], self.kept_caps[bid] = kept[0], kept[0], kept[1]
                tight.resume(kept[1], kept[2])
                LOG.info("budget %s: resumed with a backoff of %.0f W", bid, kept[0])

    async def keep_backoffs(self) -> None:
        """Write each budget's backoff and caps when they moved; forget those of budgets gone."""
        try:
            backoffs = Backoffs(self.link.require_state().kv)
            for bid, tight in self.tighteners.items():
                p = self.plans.get(bid)
                if bid not in self.view.budgets or p is None:
                    continue
                if tight.worth_keeping(self.kept.get(bid)) or p.caps != self.kept_caps.get(bid):
                    await backoffs.put(bid, self.view.budgets[bid][1], tight.backoff_w, p.caps,
                                       tight.jitter_w)
                    self.kept[bid], self.kept_caps[bid] = tight.backoff_w, p.caps
            for gone in [b for b in self.kept_caps if b not in self.tighteners]:
                await backoffs.delete(gone)
                self.kept.pop(gone, None)
                del self.kept_caps[gone]
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("budget backoffs not kept: %s", e)

    async def resume_timing(self, jobs: list[enforce.JobView]) -> None:
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
            if kept is not None and self.timing.restore(job.job_id, digest, kept):
                self.timing_kept[job.job_id] = kept
                LOG.info("job %s: resumed with %d options measured under the budgets",
                         job.job_id, len(kept.options))

    def measure_here(self, jobs: list[enforce.JobView],
                     held: Mapping[str, tuple[int, float]]) -> None:
        """Measure the Perseus jobs driven here at the points they hold (not owning budgets).

        Their measures reach the owner through the state bucket (`keep_timing`; it plans a job
        another replica drives with them, `Recorded.measured`).
        """
        for job in jobs:
            f = job.frontier
            if f is None or job.remote:
                continue
            self.timing.observe(job.job_id, told_key(job, held.get(job.job_id)),
                                job.own_step_s, job.step_times,
                                frontier_digest(f.chosen, f.times), len(job.gpus))
        self.timing.forget({j.job_id for j in jobs})

    async def keep_timing(self, jobs: list[enforce.JobView]) -> None:
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
        self.timing.forget({j.job_id for j in jobs} - theirs)
        try:
            store = TimingStore(self.link.require_state().kv)
            for job_id in [j for j in self.timing.served if j not in theirs]:
                now = self.timing.record(job_id)
                if now is not None and worth_keeping(self.timing_kept.get(job_id), now):
                    await store.put(now)
                    self.timing_kept[job_id] = now
            for gone in [j for j in self.timing_kept if self.timing.record(j) is None
                         or j in theirs]:
                if gone not in theirs:
                    await store.delete(gone)
                del self.timing_kept[gone]
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("measures under the budgets not kept: %s", e)

    async def cap_profiling(self, planned: dict[core.GpuKey, int],
                            budgets: list[Budget]) -> None:
        """Tell the jobs still profiling here their cap: `planned` (the owner's), or lifted."""
        if self.cap_jobs is None:
            return
        governed = {k for g in core.governing(budgets, self.cluster, self.wall()) for k in g.gpus}
        try:
            await self.cap_jobs(planned, governed)
        except Exception:  # noqa: BLE001 - a job not told: the next round tells it
            LOG.exception("caps not told to the jobs profiling")

    def held_here(self, budgets: list[Budget],
                  jobs: list[enforce.JobView]) -> dict[str, tuple[int, float]]:
        """Pipeline jobs driven here on GPUs a budget governs: the owner's point, or held.

        For a replica that does not own the budgets: the owner plans on the frontiers this
        replica recorded and records the point it gives each job (`budget.remote`), served
        here. Until it has (a takeover, a frontier not recorded yet), a job stays on the point
        this replica gave it while it owned the budgets (going back to a faster one would raise
        the group's draw), else on its own plan, held either way (their times are the caps',
        not the plan's: no drift re-profile under them).
        """
        governed = {k for g in core.governing(budgets, self.cluster, self.wall()) for k in g.gpus}
        return {j.job_id: (self.view.remote.point(j.job_id) or
                           self.points.get(j.job_id, (j.frontier.chosen, math.inf)))
                for j in jobs if j.frontier is not None and not j.remote
                and governed.intersection(j.gpus)}

    async def record_frontiers(self, jobs: list[enforce.JobView]) -> None:
        """Record the frontiers of the Perseus jobs driven here (`remote.record_frontiers`)."""
        try:
            await remote.record_frontiers(self.link.require_state().kv, jobs,
                                          self.frontiers_sent)
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("frontiers not recorded for the budgets: %s", e)

    async def record_points(self, points: dict[str, tuple[int, float]]) -> None:
        """Record the points given jobs another replica drives (`remote.record_points`)."""
        try:
            await remote.record_points(self.link.require_state().kv, points, self.views,
                                       self.view.remote, self.points_sent)
        except Exception as e:  # noqa: BLE001 - the bucket is away: the next round writes
            LOG.debug("frontier points not recorded: %s", e)

    async def tell(self, points: dict[str, tuple[int, float]]) -> None:
        """Tell the pipeline jobs their points (those told before and now absent: none)."""
        if self.serve is None or (points == self.points and not points):
            return
        try:
            await self.serve(points)
        except Exception:  # noqa: BLE001 - a job's schedules not sent: the next round retries
            LOG.exception("frontier points not served")
            return
        self.points = points

    async def publish(self) -> None:
        """Each governing budget's status, on `<p>.budget.<id>.status` (best effort)."""
        for bid, status in list(self.statuses.items()):
            try:
                await self.link.nc.publish(subjects.budget_status(bid, self.link.prefix),
                                           codec.encode(status))
            except Exception as e:  # noqa: BLE001 - the bus is down: next round publishes
                LOG.debug("budget %s status not published: %s", bid, e)

    def cap_leases(self, budgets: list[Budget]) -> dict[str, float]:
        """Each budget's cap lease (s), by holder (those with an end only).

        A budget with an end is held by the agents until it ends (at most `MAX_CAP_LEASE_S`),
        even if no coordinator renews it; one without an end, `cap_lease_s` at a time.
        """
        now = self.wall()
        return {holder(b.budget_id): min(MAX_CAP_LEASE_S, max(b.end_s - now, 1.0))
                for b in budgets if b.end_s is not None}

    def plan(self, budgets: list[Budget], counting: bool = True,
             jobs: list[enforce.JobView] | None = None) -> dict[core.GpuKey, tuple[int, str]]:
        """The cap and holder of every governed GPU this round.

        `counting`: a round of its own. A round woken between the loop's ticks (a budget set)
        plans and sends at once, but the samples are the last round's: it advances no
        tightener, settling or measure (each would count them twice). `jobs`: the jobs as
        seen this round (default: `self.jobs()`).
        """
        governed = [enforce.with_margin(g, self.margin_pct)
                    for g in core.governing(budgets, self.cluster, self.wall())]
        jobs = self.views = self.calibrate(self.jobs() if jobs is None else jobs, counting)
        caps: dict[core.GpuKey, tuple[int, str]] = {}
        for g in governed:
            if not g.gpus:
                continue
            tight = self.tighteners.get(g.budget_id)
            measured = enforce.measured_w(g.gpus, self.cluster)
            if tight is None or counting:
                tight = self.tighteners.setdefault(g.budget_id, enforce.Tightener(fresh=True))
                backoff = tight.update(measured, g.room_w)
            else:
                backoff = min(tight.backoff_w, max(0.0, g.room_w))
            try:
                p = enforce.guarded(enforce.plan(g, jobs, self.cluster, backoff), tight)
            except BudgetError as e:
                LOG.warning("budget %s: no allocation this round: %s", g.budget_id, e)
                continue
            before = self.plans.get(g.budget_id)
            sent = before.caps if before is not None else tight.held or None
            if sent != p.caps:  # (Taken over: the caps in force are the predecessor's.)
                tight.hold()
            self.plans[g.budget_id] = p
            self.statuses[g.budget_id] = enforce.status(p, g, measured, self.book.me)
            for key, cap_w in p.caps.items():
                caps[key] = (cap_w, holder(g.budget_id))
        live = {g.budget_id for g in governed}
        for gone in [b for b in self.tighteners if b not in live]:
            del self.tighteners[gone]
            self.plans.pop(gone, None)
            self.statuses.pop(gone, None)
        return caps

    def calibrate(self, jobs: list[enforce.JobView],
                  counting: bool = True) -> list[enforce.JobView]:
        """The pipeline jobs' frontiers scaled by their measured draw (`frontier_options`).

        The draw at its own point is its ranks' energies over their time while nothing held
        it (`JobView.own_draw_w`); without those, its GPUs' samples while it serves its own
        point and no budget governs it (a budget's caps may throttle it at its own point: a
        replica that took the job over, its energies there not known yet, learnt a ratio under
        the caps and set the points' limits too low); else 1 (the plan's own powers).
        `counting`: a round of its own (not a woken one: `plan`).
        """
        out = []
        for job in jobs:
            f = job.frontier
            if f is None:
                out.append(job)
                continue
            sampled = [self.cluster.power_w[k] for k in job.gpus if k in self.cluster.power_w]
            # (Back at its own point: the next samples still show the point it left.)
            settling = self.settling.get(job.job_id, 0)
            told = self.points.get(job.job_id)  # (A straggler's point moves it too.)
            moved = told is not None or not job.own_point
            metered = frontier_options.own_ratio(f, job.own_draw_w) if job.own_draw_w else None
            if metered is not None:  # (Its energies at its own point, no budget capping it.)
                self.ratios[job.job_id] = metered
            elif not counting:
                pass
            elif moved or settling > 0:
                self.settling[job.job_id] = enforce.SETTLE_ROUNDS if moved else settling - 1
            elif job.gpus and len(sampled) == len(job.gpus):
                ratio = frontier_options.own_ratio(f, sum(sampled) / len(sampled))
                if ratio is not None:
                    old = self.ratios.get(job.job_id)
                    self.ratios[job.job_id] = ratio if old is None else 0.8 * old + 0.2 * ratio
            digest = frontier_digest(f.chosen, f.times)
            if counting:  # (A straggler moving it: its steps are not the option's alone.)
                self.timing.observe(job.job_id, told_key(job, told), job.own_step_s,
                                    job.step_times, digest, len(job.gpus))
            measured = self.timing.measured(job.job_id)
            if job.remote:  # (Measured by the replica driving it.)
                measured = self.view.remote.measured(job.job_id, digest) or measured
            ratio = self.ratios.get(job.job_id, 1.0)
            out.append(dataclasses.replace(job, frontier=frontier_options.calibrated(
                f, ratio, measured)))
        live = {j.job_id for j in jobs}
        self.timing.forget(live)
        self.ratios = {k: v for k, v in self.ratios.items() if k in live}
        self.settling = {k: v for k, v in self.settling.items() if k in live}
        return out

    async def own(self) -> bool:
        """Whether this replica applies the budgets now (taking the lease if it is free)."""
        book, state = self.book, self.link.require_state()
        now = time.time()
        if book.owns(LEASE_KEY, now):
            return True
        for key, revision in book.claimable([LEASE_KEY], now):
            value = book.value(LEASE_ID, now)
            new = await state.take(key, value, revision)
            if new is None:
                current = await state.read_lease(key)
                if current is not None:
                    book.observe(key, *current)
                return False
            book.observe(key, value, new)
            LOG.info("replica %s applies the power budgets now", book.me)
        return book.owns(LEASE_KEY, time.time())

    async def lift(self, budget: Budget) -> None:
        """Lift a budget's caps at once (its lift request came here; the owner lifts too)."""
        try:
            gpus = core.members(budget.group, self.cluster)
        except core.BudgetRefused:
            return
        await asyncio.gather(*(self.send(k, None, holder(budget.budget_id)) for k in gpus))

    async def send(self, key: core.GpuKey, cap_w: int | None, by: str,
                   lease_s: float | None = None) -> bool:
        """Send one GPU its cap (None: lift) for `lease_s` (default `cap_lease_s`).

        Returns False if it did not take it.
        """
        node, index = key
        cmd = NodeCapCmd(holder=by, cap_w=cap_w, lease_s=lease_s or self.cap_lease_s)
        subject = subjects.gpu_command(node, index, self.link.prefix)
        try:
            msg: Any = await self.link.nc.request(
                subject, codec.encode(CommandEnvelope(cmd=cmd)), timeout=COMMAND_TIMEOUT_S)
            reply = codec.decode(msg.data, Reply)
        except Exception as e:  # noqa: BLE001 - a gone agent, a timeout: next round retries
            self._failed(key, str(e) or type(e).__name__)
            return False
        if not reply.ok:
            self._failed(key, f"{reply.code}: {reply.error}")
        return reply.ok

    def _failed(self, key: core.GpuKey, why: str) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            LOG.warning("node cap for GPU %d of node %s not applied (%d so far): %s",
                        key[1], key[0], self.failures, why)
