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
throughout one. It starts from what its predecessor kept in the state bucket (`LoopBucket`,
`budget.bucket`: each budget's backoff and caps, the Perseus jobs' measures, frontiers and
points).

The parts: what the budgets know of the jobs (`budget.job_views`), the plan of each budget
(`budget.enforce` over `budget.allocator`), the frontier points given the Perseus jobs
(`budget.points`), what is kept for a successor and for the other replicas (`budget.bucket`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from coordinator.budget import budgets as core
from coordinator.budget import enforce, frontier_options
from coordinator.budget.allocator import BudgetError
from coordinator.budget.bucket import LoopBucket
from coordinator.budget.capped_profiles import CappedProfiles
from coordinator.budget.points import frontier_points, told_key
from coordinator.budget.store import BudgetView, LiftedCaps
from coordinator.budget.timing import Timing, frontier_digest
from coordinator.state.ownership import OwnershipBook
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetStatus
from zeus_agent.wire.messages import CommandEnvelope, Reply
from zeus_agent.wire.node_cap import MAX_CAP_LEASE_S, NodeCapCmd

if TYPE_CHECKING:  # (coordinator.service builds this loop: no import cycle at run time)
    from coordinator.service.link import Link

LOG = logging.getLogger(__name__)
ROUNDS = logging.getLogger(__name__ + ".rounds")
"""Each budget's plan, round by round (INFO: `enforce.describe`), to explain a run."""

Serve = Callable[[dict[str, tuple[int, float]]], Awaitable[None]]
"""Tells the pipeline jobs their points (`points.serve_points` over this replica's drivers)."""
CapJobs = Callable[[dict[core.GpuKey, int], set[core.GpuKey]], Awaitable[None]]
"""Tells the power-limit jobs still profiling their cap (`job_caps.cap_profiling_jobs`)."""
Reprofile = Callable[[set[str]], Awaitable[set[str]]]
"""Asks pipeline jobs driven here to profile again; those that will (`points.reprofile_jobs`)."""

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


def holder(budget_id: str) -> str:
    """Who holds a budget's caps on the agents."""
    return f"budget:{budget_id}"


class BudgetLoop:
    """Plans and sends the caps while this replica holds the budgets' lease."""

    def __init__(self, *, link: Link, book: OwnershipBook, cluster: core.Cluster,
                 jobs: Callable[[], list[enforce.JobView]], cap_lease_s: float,
                 view: BudgetView, wall: Callable[[], float] = time.time,
                 serve: Serve | None = None, cap_jobs: CapJobs | None = None,
                 margin_pct: float = 0.0, reprofile: Reprofile | None = None) -> None:
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
        self.bucket = LoopBucket(link, view, wall)
        """What this replica keeps in the state bucket, and resumes from."""
        self.views: list[enforce.JobView] = []
        """The jobs as the latest round saw them."""
        self.points: dict[str, tuple[int, float]] = {}
        """Job -> the frontier point (index, power per GPU) a budget gives it, as told."""
        self.cap_jobs = cap_jobs
        """Tells the power-limit jobs still profiling here their cap (every replica)."""
        self.profiles = CappedProfiles()
        """Which pipeline jobs' frontiers were planned under a budget's caps: not planned on
        (`budget.capped_profiles`; followed by every replica, owner or not)."""
        self.reprofile = reprofile
        """Asks such jobs driven here to profile again once no budget governs them."""
        self.governed: set[core.GpuKey] = set()
        """The GPUs a budget governed in the latest round planned (`plan`)."""

    async def tick(self) -> None:
        """One round: own, plan, send caps and lifts."""
        if self.link.state is None or not self.link.connected:
            return
        budgets = [b for b, _ in self.view.budgets.values()]
        if (not budgets and not self.capped and not self.points and not self.unlifted
                and not self.view.lifted and not self.view.remote.points):
            await self.cap_profiling({}, budgets)  # (A lift seen here: the jobs learn it.)
            if self.profiles.pending():  # (A job to ask to profile again: no caps now.)
                jobs = self.jobs()
                self.observe_profiles(jobs, set())
                await self.reprofile_capped(jobs, set())
            else:
                self.profiles.unobserved()
            return
        jobs = self.jobs()
        await self.bucket.resume_timing(jobs, self.timing)
        now_s = time.monotonic()
        counting = now_s - self.counted_at >= COUNTED_GAP * PERIOD_S
        if counting:
            self.counted_at = now_s
        if not await self.own():
            self.capped.clear()  # Another replica acts; what was sent here lapses or is kept.
            self.tighteners.clear()  # (Its backoffs too: back here, start from the kept ones.)
            self.bucket.disown()
            self.plans.clear()
            self.statuses.clear()
            governed = {k for g in core.governing(budgets, self.cluster, self.wall())
                        for k in g.gpus}
            self.observe_profiles(jobs, governed)
            await self.bucket.record_frontiers(jobs, self.profiles.planned_capped)
            held = self.held_here(budgets, jobs)  # (The owner caps them.)
            if counting:
                self.measure_here(jobs, held)
            await self.tell(held)
            await self.reprofile_capped(jobs, governed)
            await self.bucket.keep_timing(jobs, self.timing)
            await self.cap_profiling({}, budgets)
            return
        await self.bucket.resume_backoffs(self.tighteners)
        caps = self.plan(budgets, counting, jobs)
        await self.bucket.record_frontiers(jobs, self.profiles.planned_capped)
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
        await self.reprofile_capped(jobs, self.governed)
        await self.bucket.record_points(points, self.views)
        await self.cap_profiling({k: w for k, (w, _) in caps.items()}, budgets)
        await self.bucket.keep_backoffs(self.tighteners, self.plans)
        await self.bucket.keep_timing(self.views, self.timing)
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

    async def reprofile_capped(self, jobs: list[enforce.JobView],
                               governed: set[core.GpuKey]) -> None:
        """Ask jobs driven here to profile again (`CappedProfiles.to_reprofile`).

        Those whose frontier was planned under a budget's caps, none of whose GPUs a budget
        governs now. Asked once per frontier: a job whose scheduler cannot profile again
        (not Perseus) is not asked every round.
        """
        want = self.profiles.to_reprofile(jobs, governed)
        if not want or self.reprofile is None:
            return
        try:
            done = await self.reprofile(set(want))
        except Exception:  # noqa: BLE001 - not asked: the next round asks again
            LOG.exception("jobs not asked to profile again")
            return
        for job in jobs:
            if job.job_id in want:
                self.profiles.reprofiled(job)
                LOG.info("job %s: %s to profile again: its frontier was planned under a power "
                         "budget's caps, and no budget governs its GPUs now", job.job_id,
                         "asked" if job.job_id in done else "cannot be asked")

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
        jobs = self.jobs() if jobs is None else jobs
        self.governed = {k for g in governed for k in g.gpus}
        self.observe_profiles(jobs, self.governed)
        jobs = self.views = self.calibrate(jobs, counting)
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
            p = enforce.staged(p, sent, tight, counting)  # (Its raises a round after its cuts.)
            tight.sent(sent, p.caps, p.room_w)  # (Taken over: `sent` is the predecessor's.)
            self.plans[g.budget_id] = p
            self.statuses[g.budget_id] = enforce.status(p, g, measured, self.book.me)
            if ROUNDS.isEnabledFor(logging.INFO):
                ROUNDS.info("%s", enforce.describe(p, g, measured, tight, counting))
            for key, cap_w in p.caps.items():
                caps[key] = (cap_w, holder(g.budget_id))
        live = {g.budget_id for g in governed}
        for gone in [b for b in self.tighteners if b not in live]:
            del self.tighteners[gone]
            self.plans.pop(gone, None)
            self.statuses.pop(gone, None)
        return caps

    def observe_profiles(self, jobs: list[enforce.JobView], governed: set[core.GpuKey]) -> None:
        """Follow the jobs' frontiers: one planned under a budget's caps is not planned on."""
        for job_id in self.profiles.observe(jobs, governed):
            LOG.info("job %s: its frontier was planned from a profile a budget's caps throttled: "
                     "capped proportionally until it plans one no budget capped", job_id)

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
        held = enforce.held_under(self.plans.values())  # (The caps sent: not its option's.)
        for job in jobs:
            job = self.profiles.trusted(job)  # (Planned under caps: capped proportionally.)
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
            if counting:  # (A straggler moving it, or the guard's caps: not the option's alone.)
                key = None if job.job_id in held else told_key(job, told)
                self.timing.observe(job.job_id, key, job.own_step_s,
                                    job.step_times, digest, len(job.gpus))
            measured = self.timing.measured(job.job_id)
            if job.remote:  # (Measured by the replica driving it.)
                measured = self.view.remote.measured(job.job_id, digest) or measured
            ratio = self.ratios.get(job.job_id, 1.0)
            if counting and ROUNDS.isEnabledFor(logging.INFO):
                ROUNDS.info("pipeline %s ratio=%.3f own_s=%s held=%d told=%s measured=%s",
                            job.job_id[-8:], ratio, self.timing.own.get(job.job_id),
                            job.job_id in held, told, [(m.key, round(m.relative_time, 3),
                                                        m.power_w and round(m.power_w))
                                                       for m in measured])
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
