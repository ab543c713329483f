"""From a governing budget to a cap per GPU, tightened by what the group measures (pure).

The budget loop (`coordinator.budget.loop`) hands this core what it knows each round: the
GPUs a budget governs and its room (`budgets.governing`), the jobs on them (`JobView`: their
GPUs and, for a power-limit job whose profile is known, its measurements and optimum), and the
cluster's last samples. It returns the cap of every governed GPU:

* a profiled power-limit job gets the limit the allocator chose for it (`allocator.allocate`,
  its options from its measurements: time per window and average power per GPU, energy /
  time / GPUs, as `PowerLimitMeasurement` sums energy over the job's GPUs);
* a pipeline job serving a plan of its frontier (Perseus) gets a frontier point, its GPUs
  capped at that point's limit (`frontier_options`; driven by another replica: the frontier
  that replica recorded, `remote`);
* a job without a profile (still profiling, a job another replica drives whose profile or
  frontier is not recorded) is capped proportionally, counted at its measured draw;
* an idle GPU counts at its measured power and is capped at its minimum limit, so a job that
  starts there cannot overshoot before the next round.

`Tightener`: expected draws come from profiles; the samples say what the group draws. While
the measured draw stays over its target for `OVER_ROUNDS` rounds, the room allocated shrinks
by the excess (integral action, never under the floor); once it is back under, the backoff
decays, so a group that measured over gives the room back a little at a time. The target is a
band under the room, `BAND_JITTERS` of the draw's jitter from round to round (at most
`MAX_BAND` of the room): a draw held with its mean at the cap is over it half the time.
After the caps change, the samples describe the old caps for a while (a GPU takes a new
limit at its next step, an agent publishes its samples every second): for `SETTLE_ROUNDS`
rounds the tightener holds still (`Tightener.hold`), or it would count the old excess again
and cut far too deep; a change under `SETTLED_MOVE` of the room is the samples' noise, and
does not hold it (`Tightener.sent`).
A plan that raises some caps and lowers others sends its raises a round after its cuts
(`staged`): a GPU takes a higher cap at once, a lower one only at its job's next step.
The backoff is kept in the state bucket with the caps sent (`Tightener.worth_keeping`,
`store.Backoffs`): a replica taking the budgets over starts from it and sends no cap above its
predecessor's for a while (`Tightener.resume`, `guarded`), so the cap holds through a takeover.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from coordinator.budget import allocator as alloc
from coordinator.budget.budgets import Cluster, Governed, GpuKey
from coordinator.budget.frontier_options import FrontierView, profiled_job
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.budget import MAX_SLOWDOWN, BudgetShare, BudgetStatus

OVER_ROUNDS = 2
"""Rounds over the room in a row before the room allocated shrinks (samples are noisy)."""
RELEASE = 0.2
"""Share of the backoff given back each round spent under the room."""
SETTLE_ROUNDS = 3
"""Rounds after the caps changed in which the samples still show the old caps."""
KEEP_STEP = 0.1
"""Relative change of the backoff that is written again to the state bucket."""
BAND_JITTERS = 0.5
"""The measured draw is held this many jitters under the room (`Tightener.band_w`)."""
MAX_BAND = 0.03
"""The band never exceeds this share of the room (a jitter inflated by a job starting)."""
JITTER_WEIGHT = 0.2
"""Weight of each round in the jitter's moving mean."""
START_MARGIN = 0.03
"""Share of the room a new budget's first allocation keeps back (`Tightener.fresh`)."""
GUARD_ROUNDS = SETTLE_ROUNDS + OVER_ROUNDS + 3
"""Rounds in which an owner that took a budget over sends no cap above its predecessor's."""
SETTLED_MOVE = 0.01
"""Share of the room the caps may move by, summed over `SETTLE_ROUNDS` rounds, without a hold
(`Tightener.sent`)."""


@dataclass(frozen=True, slots=True)
class JobView:
    """What the budget loop knows of one job."""

    job_id: str
    gpus: tuple[GpuKey, ...]
    measurements: tuple[PowerLimitMeasurement, ...] = ()
    optimum_w: int | None = None
    """The job's own optimum (its profile is known); None: no profile."""
    weight: float = 1.0
    frontier: FrontierView | None = None
    """A pipeline job's frontier, while it serves a plan of it (`frontier_options`)."""
    own_point: bool = True
    """No straggler slows it: its draw is its own point's (when no budget moves it)."""
    step_times: tuple[tuple[int, float, float | None], ...] = ()
    """A pipeline job's last steps, (sequence, s, J) (`StragglerHandling.step_times`)."""
    own_step_s: float | None = None
    """A pipeline job's step time at its own point (`StragglerHandling.own_step_s`)."""
    own_draw_w: float | None = None
    """A pipeline job's draw per GPU there, from its energies (`StragglerHandling.own_draw_w`)."""
    remote: bool = False
    """Another replica drives it (a frontier is the one that replica recorded: `remote`)."""
    profiling: bool = False
    """A pipeline job driven here, profiling its instructions now (`capped_profiles`)."""
    planned_capped: bool = False
    """Its frontier's record says it was planned from a profile a budget's caps throttled
    (`BudgetFrontier.planned_capped`: its driver found it so, maybe another replica)."""


@dataclass(frozen=True, slots=True)
class CapPlan:
    """The caps of one budget's GPUs and how they were chosen."""

    budget_id: str
    caps: dict[GpuKey, int]
    allocation: alloc.Allocation
    room_w: float
    """The room allocated (the budget's room less the tightener's backoff)."""
    members: dict[str, tuple[GpuKey, ...]] = field(default_factory=dict)
    """Each job's GPUs inside the budget."""
    idle: tuple[GpuKey, ...] = ()


def _profile(job: JobView, inside: int, min_limit_w: int,
             max_limit_w: int) -> alloc.ProfiledJob | None:
    """The allocator's job for a profiled job (None: no usable profile).

    A frontier whose options the allocator refuses (one another replica recorded, which
    passed the wire's checks: `alloc.check_job`) is no usable profile: the job is capped
    proportionally, rather than the whole budget getting no allocation (its caps lifted).
    """
    if job.frontier is not None:  # A pipeline job: its frontier points are its options.
        found = profiled_job(job.job_id, job.frontier, inside, min_limit_w, max_limit_w,
                             job.weight)
        try:
            alloc.check_job(found)
        except alloc.BudgetError:  # (Its status share says so: no slowdown, a plain cap.)
            return None
        return found
    if job.optimum_w is None or not job.measurements:
        return None
    everyone = len(job.gpus)
    options = tuple(alloc.Option(m.power_limit, m.time, m.energy / m.time / everyone,
                                 m.power_limit) for m in job.measurements)
    if job.optimum_w not in {o.key for o in options}:
        return None
    return alloc.ProfiledJob(job.job_id, inside, options, job.optimum_w, min_limit_w,
                             job.weight)


def build_group(governed: Governed, jobs: Iterable[JobView], cluster: Cluster,
                room_w: float) -> tuple[alloc.Group, dict[str, tuple[GpuKey, ...]],
                                        tuple[GpuKey, ...]]:
    """The allocator's group for a budget, each job's GPUs inside it, and its idle GPUs."""
    mine = set(governed.gpus)
    profiled, unprofiled, members = [], [], {}
    for job in sorted(jobs, key=lambda j: j.job_id):
        inside = tuple(k for k in job.gpus if k in mine and k in cluster.gpus)
        if not inside:
            continue
        members[job.job_id] = inside
        lo = max(cluster.gpus[k].min_limit_w for k in inside)
        hi = min(cluster.gpus[k].max_limit_w for k in inside)
        p = _profile(job, len(inside), lo, max(lo, hi))
        if p is not None:
            profiled.append(p)
            continue
        sampled = [cluster.power_w[k] for k in inside if k in cluster.power_w]
        draw = sum(sampled) / len(sampled) if sampled else None
        unprofiled.append(alloc.UnprofiledJob(job.job_id, len(inside), lo, max(lo, hi), draw))
    busy = {k for ks in members.values() for k in ks}
    idle = tuple(sorted(mine - busy))
    idle_w = sum(cluster.power_w.get(k, float(cluster.gpus[k].min_limit_w))
                 for k in idle if k in cluster.gpus)
    group = alloc.Group(room_w, tuple(profiled), tuple(unprofiled), idle_w)
    return group, members, idle


def plan(governed: Governed, jobs: Sequence[JobView], cluster: Cluster,
         backoff_w: float = 0.0) -> CapPlan:
    """The caps of the budget's GPUs: the allocator's limits, idle GPUs at their minimum."""
    group, members, idle = build_group(governed, jobs, cluster, governed.room_w)
    floor = alloc.floor_w(group)
    room = max(floor, governed.room_w - backoff_w)
    group = alloc.Group(room, group.jobs, group.unprofiled, group.idle_w)
    allocation = alloc.allocate(group)
    caps: dict[GpuKey, int] = {}
    for share in allocation.shares:
        for key in members[share.job_id]:
            caps[key] = share.limit_w
    for key in idle:
        if key in cluster.gpus:
            caps[key] = cluster.gpus[key].min_limit_w
    return CapPlan(governed.budget_id, caps, allocation, room, members, idle)


@dataclass
class Tightener:
    """Shrinks a budget's room while the group measures over it; gives it back slowly."""

    backoff_w: float = 0.0
    over_rounds: int = 0
    settling: int = 0
    """Rounds left in which the samples may still show caps since changed."""
    raised: bool = False
    """Those caps only went up (`hold`): a draw over the target while they settle counts."""
    held: dict[GpuKey, int] = field(default_factory=dict)
    """The caps the previous owner sent last (a takeover), bounding this owner's (`guarded`)."""
    guard: int = 0
    """Rounds left in which `held` bounds the caps."""
    jitter_w: float = 0.0
    """How much the measured draw moves from one round to the next (a moving mean), W."""
    last_w: float | None = None
    """The last round's measured draw (None after the caps changed)."""
    deferred: frozenset[GpuKey] = frozenset()
    """GPUs whose raise `staged` held back last round: the next counting round sends it."""
    fresh: bool = False
    """A new budget's, nothing kept from a predecessor: its first round keeps `START_MARGIN`
    of the room back. The first allocation rests on models (profiles, a Perseus job's
    calibration, proportional shares of unprofiled jobs) whose error would otherwise hold the
    group over the cap for `SETTLE_ROUNDS` + `OVER_ROUNDS` rounds; the margin is given back at
    `RELEASE` a round once the group measures under."""

    recent: tuple[Mapping[GpuKey, int], ...] = ()
    """The caps sent in the rounds since the last hold, the latest `SETTLE_ROUNDS` of them
    (`sent`; the last one's replacement not yet)."""
    cut: bool = False
    """This round's draw shrank the room (`update`): any change of the caps holds (`sent`)."""

    def sent(self, before: Mapping[GpuKey, int] | None, after: Mapping[GpuKey, int],
             room_w: float) -> None:
        """The caps `after` replace `before` (None: none sent yet): hold if the move matters.

        The samples may show any caps of the last `SETTLE_ROUNDS` rounds: they are off by at
        most how far each GPU's cap now is from the farthest of those, summed over the GPUs.
        Up to `SETTLED_MOVE` of the room (1%, about half the 16 x 8 group's round-to-round
        jitter, 400 W of a 19 kW cap: what the band already covers) that is the samples'
        noise, not the caps' step: no hold. Held on any change, a job capped proportionally,
        counted at its draw, moved its cap by a watt or two every round with the draw's noise,
        the tightener never had a settled round, and a new budget's start margin stayed until
        the lift (2 of 10 first events at 16 x 8, 2026-12-07). A GPU capped anew (or the first
        caps) always holds, and so does any change in a round whose draw shrank the room
        (`cut`): its samples would count the same excess again, round after round.
        """
        seen = (*self.recent, before)[-SETTLE_ROUNDS:] if before is not None else ()
        move = math.inf if not seen else sum(
            max(abs(w - c.get(k, -math.inf)) for c in seen) for k, w in after.items())
        if move > SETTLED_MOVE * room_w or (self.cut and move > 0):
            self.hold(raised=raised_only(before, after))  # (Which forgets `recent`.)
        else:
            self.recent = seen

    def resume(self, held: dict[GpuKey, int], jitter_w: float = 0.0) -> None:
        """Taken over from an owner that sent `held` last: bound the caps by them a while.

        `jitter_w`: the draw's jitter it measured (the band under the room holds at once).

        Until this owner has measured the group under its own caps, and the jobs its
        predecessor drove are driven again (their profiles known here), a plan may well raise
        caps the group needs: a job another replica drives whose profile or frontier is not
        recorded yet is capped proportionally, counted at its draw, which the cap holds down.
        No hold: the samples show the caps in force, which are `held` (the loop holds when it
        sends others). While the guard lasts the backoff is not given back: the caps, the
        least of this owner's plan and its predecessor's per GPU, draw under either plan (a
        16 x 8 takeover that gave the kept backoff back meanwhile went over the cap, up to
        641 W, once the guard ended).
        """
        self.held, self.guard, self.jitter_w = dict(held), GUARD_ROUNDS, jitter_w
        self.fresh = False

    def worth_keeping(self, kept_w: float | None) -> bool:
        """Whether the backoff moved enough from the one kept (`kept_w`) to write it again.

        A replica taking over starts from the kept one (`store.Backoffs`): a write when it
        moves by `KEEP_STEP` (relative, at least 1 W), not every round of its decay.
        """
        if kept_w is None:
            return self.backoff_w > 0.0
        return abs(self.backoff_w - kept_w) > max(1.0, KEEP_STEP * kept_w)

    def hold(self, rounds: int = SETTLE_ROUNDS, raised: bool = False) -> None:
        """The caps just changed: the next `rounds` rounds' samples say nothing of them.

        Their changes from round to round still count in the jitter, but for the first (the
        caps' own step): each release of the backoff changes the caps, so at 16 x 8 a round
        and the next were both free of a hold only every fourth round or so, and the jitter
        (the band under the room) stayed 0 for the first 10 s of the cut.

        `raised`: no cap went down (`raised_only`). The samples then show at most the draw
        to come (a GPU takes a higher cap at once, its job's draw follows): a draw over the
        target while they settle is over it, and counts toward tightening at once (only a
        draw under it is not counted: the backoff is not given back on samples of the old
        caps). Without it, a raise whose draw the models undercounted went over the cap for
        `SETTLE_ROUNDS` + `OVER_ROUNDS` rounds (16 x 8, 2026-12-07: a Perseus job moved to a
        point at 300 W counted at 837 W drew ~1,400 W, 476 J over the cap after a takeover).
        A raise while the samples still settle a cut stays a cut's hold (they show its
        excess).
        """
        self.raised = raised and (self.settling == 0 or self.raised)
        self.settling = rounds
        self.recent = ()
        self.over_rounds = 0
        self.last_w = None  # (The next change of the draw is the caps', not noise.)

    def band_w(self, room_w: float) -> float:
        """How far under the room the measured draw is held: its jitter (`BAND_JITTERS`)."""
        return min(BAND_JITTERS * self.jitter_w, MAX_BAND * room_w)

    def update(self, measured_w: float | None, room_w: float) -> float:
        """One round's measured draw (None: not every GPU sampled); the backoff to apply.

        The draw is held a band under the room (`band_w`): a draw whose mean sits at the cap
        is over it half the time. The backoff never exceeds the room (one kept by a
        predecessor may: a huge one would hold the group at its floor while it decays).
        """
        self.cut = False
        if self.fresh:
            self.fresh = False
            self.backoff_w = max(self.backoff_w, START_MARGIN * room_w)
        self.backoff_w = min(self.backoff_w, max(0.0, room_w))
        if measured_w is not None:  # (Settling too: see `hold`.)
            if self.last_w is not None:
                self.jitter_w += JITTER_WEIGHT * (abs(measured_w - self.last_w) - self.jitter_w)
            self.last_w = measured_w
        if self.settling > 0:
            self.settling -= 1
            if self.raised and measured_w is not None:
                self._over(measured_w, room_w - self.band_w(room_w))
            return self.backoff_w
        if measured_w is None:
            return self.backoff_w
        target = room_w - self.band_w(room_w)
        if self._over(measured_w, target):
            return self.backoff_w
        if self.guard <= 0:  # (Guarded, the caps are the least of two plans': under both.)
            self.over_rounds = 0
            self.backoff_w *= 1 - RELEASE
            if self.backoff_w < 1.0:
                self.backoff_w = 0.0
        else:
            self.over_rounds = 0
        return self.backoff_w

    def _over(self, measured_w: float, target_w: float) -> bool:
        """Whether the draw is over the target; counted, the room shrinks after `OVER_ROUNDS`."""
        if measured_w <= target_w:
            return False
        self.over_rounds += 1
        if self.over_rounds >= OVER_ROUNDS:
            self.backoff_w += measured_w - target_w
            self.cut = True
        return True


def with_margin(governed: Governed, margin_pct: float) -> Governed:
    """`governed` with `margin_pct` percent of its room kept unused.

    The allocation plans under the smaller room and the tightener holds the measured draw a
    band under it (`Tightener.update`): a fixed margin besides the band, for the draw's noise
    over a shorter time than a round (the group's power in half-second bins crossed a cap
    its one-second samples stayed under). Never under the floor (`plan`).
    """
    if margin_pct <= 0:
        return governed
    return replace(governed, room_w=governed.room_w * (1 - margin_pct / 100))


def guarded(plan: CapPlan, tight: Tightener) -> CapPlan:
    """`plan` with no cap above the one the previous owner sent, while `tight` guards.

    One round of the guard is spent. After its last, the tightener holds (`Tightener.hold`):
    the next rounds' samples still show the guarded caps, under both plans, and would give
    the backoff back.
    """
    if tight.guard <= 0:
        return plan
    tight.guard -= 1
    if tight.guard == 0:
        tight.hold(raised=True)  # (Its own caps next: none under the guarded ones.)
    caps = {k: min(w, tight.held.get(k, w)) for k, w in plan.caps.items()}
    return replace(plan, caps=caps)


def staged(plan: CapPlan, sent: Mapping[GpuKey, int] | None, tight: Tightener,
           counting: bool = True) -> CapPlan:
    """`plan` with its raises a round behind its cuts, when it has both (issue 37).

    A GPU takes a higher cap at once and a lower one only at its job's next step, so a plan
    that raises some GPUs and lowers others drew over the cap while it landed (h-bins,
    2026-12-07: both of main's bins over in a 60 s takeover event). The cuts (a GPU capped
    anew is one) and the caps unchanged go now; a raised GPU keeps the cap `sent` before,
    and the next counting round sends it its plan's cap whatever that plan cuts
    (`Tightener.deferred`). A raise is held back once only: held every round, a job capped
    at its draw would be cut round after round. `counting`: a round woken between ticks
    (`loop.plan`) sends no raise it held back (its samples are the last round's). A plan
    that only raises, or only cuts, goes as it is.
    """
    if sent is None:
        tight.deferred = frozenset()
        return plan
    cuts = any(k not in sent or w < sent[k] for k, w in plan.caps.items())
    if not cuts:
        tight.deferred = frozenset()
        return plan
    due = tight.deferred if counting else frozenset()
    held = frozenset(k for k, w in plan.caps.items()
                     if k in sent and w > sent[k] and k not in due)
    tight.deferred = held
    if not held:
        return plan
    return replace(plan, caps={k: sent[k] if k in held else w for k, w in plan.caps.items()})


def held_under(plans: Iterable[CapPlan]) -> set[str]:
    """The jobs whose GPUs the caps sent hold under their share's limit (`guarded`).

    A new owner's guard sends the least of its plan's caps and its predecessor's: such a
    job runs under a lower cap than the option it was told, so its steps are not that
    option's (a Perseus job's measured under a point's caps: `budget.timing`).
    """
    return {share.job_id for p in plans for share in p.allocation.shares
            if any(p.caps.get(k, share.limit_w) < share.limit_w
                   for k in p.members.get(share.job_id, ()))}


def describe(plan: CapPlan, governed: Governed, measured: float | None, tight: Tightener,
             counting: bool) -> str:
    """One round of a budget's plan in a line (a replica's log, to explain a run).

    The room and the tightener's state, the allocation's expected draw, and per job its
    share's limit, expected draw and option, and the least cap sent to its GPUs (under the
    limit: the guard's).
    """
    jobs = []
    for s in plan.allocation.shares:
        sent = min((plan.caps.get(k, s.limit_w) for k in plan.members.get(s.job_id, ())),
                   default=s.limit_w)
        jobs.append(f"{s.job_id[-8:]}:{s.limit_w}/{sent}W,{s.expected_w:.0f}W,k={s.key}")
    m = "-" if measured is None else f"{measured:.0f}"
    return (f"budget {plan.budget_id} counting={int(counting)} cap={governed.cap_w:.0f} "
            f"room={plan.room_w:.0f} backoff={tight.backoff_w:.0f} measured={m} "
            f"expected={plan.allocation.expected_w:.0f} guard={tight.guard} "
            f"settling={tight.settling} over={tight.over_rounds} jitter={tight.jitter_w:.0f} "
            f"held={len(tight.held)} jobs=[{' '.join(jobs)}]")


def raised_only(before: Mapping[GpuKey, int] | None, after: Mapping[GpuKey, int]) -> bool:
    """Whether the caps `after` lower none of `before` (a GPU capped anew is lowered)."""
    return before is not None and all(k in before and w >= before[k] for k, w in after.items())


def measured_w(gpus: Iterable[GpuKey], cluster: Cluster) -> float | None:
    """The GPUs' measured draw (their last samples), None if one has no sample yet."""
    total = 0.0
    for key in gpus:
        if key not in cluster.power_w:
            return None
        total += cluster.power_w[key]
    return total


def status(plan: CapPlan, governed: Governed, measured: float | None,
           replica: str) -> BudgetStatus:
    """What a plan says of its budget, for people: the draws and each job's share.

    A slowdown over `MAX_SLOWDOWN` (a frontier another replica recorded may name one) is
    said as that: a status the wire refuses would stop the owner's round before its caps.
    """
    shares = []
    for share in plan.allocation.shares:
        n = plan.members.get(share.job_id, ())
        shares.append(BudgetShare(job_id=share.job_id, gpus=len(n), limit_w=share.limit_w,
                                  expected_w=round(share.expected_w, 1),
                                  slowdown=None if share.key is None
                                  else min(share.slowdown, MAX_SLOWDOWN)))
    return BudgetStatus(budget_id=plan.budget_id, replica=replica, cap_w=governed.cap_w,
                        room_w=round(plan.room_w, 1),
                        measured_w=None if measured is None else round(measured, 1),
                        expected_w=round(plan.allocation.expected_w, 1),
                        floor_w=round(plan.allocation.floor_w, 1), gpus=len(governed.gpus),
                        idle_gpus=len(plan.idle), shares=shares)
