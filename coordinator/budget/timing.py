"""How much slower a Perseus job runs under a budget's caps, and what it draws, measured (pure).

A throttled option of a pipeline job (`frontier_options`: its slowest point under a node cap)
is a model: the profile's clocks that fit the cap, and under its lowest clocks the same energy
per iteration at the cap. At deep caps it runs slower than that: a GPU throttled under its
lowest profiled clock still draws its static power, so less of the cap does the work, and the
iteration also holds what the planner does not see. Measured on the budget bench (A40, GPT-3,
a 125 W share): 0.96-1.01 slowdown where 0.62-0.66 was planned; at 150 W and above the model
held (0.55-0.60 measured for 0.60-0.63 planned). A frontier point served under its limit errs
too (the quick bench: planned 15 % slower than the own point, ran 42 % slower: short
instructions pay clock changes the plan does not see). The allocator, trusting the models, cut
such a job deeper than its cost warranted.

The draw errs the other way: a throttled option counts at its cap, while the slowest point's
clocks may keep the GPUs under it (the same bench: 238 W drawn for a 300 W share), and the room
left goes to no job.

`Timing` measures instead. Per job, from the step times its ranks report (`StragglerHandling.
step_times`: each rank's time and GPU energy), once the option told has been in force
`settle_rounds` rounds: for each option it was told (a frontier point or a throttled one),
the median step time there over the median at its own point (`StragglerHandling.own_step_s`,
while nothing held it), and the energy over the time, the draw per GPU (`Served`; from the
energy counters: the power samples are instantaneous and follow the phase they were taken
at, 148 W read for GPUs averaging 121 W). The job's frontier carries them
(`FrontierView.measured`), and `frontier_options.options` counts an option served at its
measured time and draw, and deeper caps scaled alike: the next allocation weighs what the
caps really cost and draw.

**Kept for a successor**: the replica driving the job (it measures it, owning the budgets or
not) writes its measures to the state bucket when they move (`record`, `worth_keeping`;
`store.TimingStore`, a `BudgetTiming` naming the frontier they were measured on,
`frontier_digest`); the budgets' owner counts a job another replica drives at them, and a
replica that takes the job over starts from them (`restore`) instead of measuring every
option again, during which the allocator trusted the models again. A replica replaying a
job it took over plans the same frontier (its scheduler is deterministic), so the digest
matches; another frontier drops them.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from coordinator.budget.frontier_options import Served
from coordinator.pipeline.steps import mean_power_w
from zeus_agent.models import MAX_POWER_W
from zeus_agent.wire.budget import MAX_MEASURED, MEASURED_RANGE, BudgetTiming, MeasuredOption

__all__ = ["KEEP_TOLERANCE", "MIN_STEPS", "OUTLIER", "RELATIVE_RANGE", "SMOOTHING", "StepTime",
           "Timing", "frontier_digest", "worth_keeping"]

MIN_STEPS = 3
"""Iterations (each rank's step) after the settling rounds needed for a measure."""
OUTLIER = 4.0
"""A step this many times longer or shorter than the median is left out of the draw."""
RELATIVE_RANGE = MEASURED_RANGE
"""An option's measured time over the own point's, kept within (a measure outside
says more about the host than the caps)."""
SMOOTHING = 0.5
"""Weight of the previous measure of an option in the next one."""
KEEP_TOLERANCE = 0.01
"""Relative move of a measure (time or draw) worth writing to the state bucket again."""


StepTime = tuple[int, float, float | None]
"""(sequence number, seconds, joules or None) of one rank's step (`StragglerHandling`)."""


@dataclass(slots=True)
class _Watch:
    """The option a job was told: since how many rounds, and its last step before measuring."""

    key: int | None
    rounds: int = 0
    mark: int = 0


class Timing:
    """Measured step times and draws of the pipeline jobs a budget governs (see the module).

    Args:
        settle_rounds: Rounds after the option changed whose steps still ran the old one.
    """

    def __init__(self, settle_rounds: int) -> None:
        self.settle_rounds = settle_rounds
        self.served: dict[str, dict[int, Served]] = {}
        """Job -> option key -> that option as measured."""
        self._watch: dict[str, _Watch] = {}
        self._frontiers: dict[str, Hashable] = {}
        self.own: dict[str, float] = {}
        """Job -> its step time at its own point, as last known (here or kept): a job taken
        over under a budget never runs its own point here, yet its options are measured."""

    def observe(self, job_id: str, key: int | None, own_s: float | None,
                step_times: Sequence[StepTime], frontier: Hashable = None,
                ranks: int = 1) -> None:
        """One round of a job: `key` is the option it was told.

        `key` None: none, its own point, or a straggler moves it (its steps then are not the
        option's alone). `own_s`: its step time at its own point (None: not known here; the
        last one known is used, here or its predecessor's kept: `own`);
        `step_times`: its ranks' steps, oldest first; `frontier`: what tells its frontier
        from another (a job that planned again: what was measured of the old one's options
        is dropped); `ranks`: how many ranks report each step (`MIN_STEPS` counts
        iterations).
        """
        if self._frontiers.get(job_id, frontier) != frontier:
            self.served.pop(job_id, None)
            self._watch.pop(job_id, None)
            self.own.pop(job_id, None)
        self._frontiers[job_id] = frontier
        if own_s is not None and 0 < own_s < math.inf:
            self.own[job_id] = own_s
        own_s = self.own.get(job_id)
        watch = self._watch.get(job_id)
        last = step_times[-1][0] if step_times else 0
        if watch is None or watch.key != key or last < watch.mark:  # (A job made again.)
            watch = self._watch[job_id] = _Watch(key)
        watch.rounds += 1
        if watch.rounds <= self.settle_rounds:
            watch.mark = last
            return
        if key is None or own_s is None or not 0 < own_s < math.inf:
            return
        ran = [(t, e) for n, t, e in step_times if n > watch.mark]
        if len(ran) < MIN_STEPS * max(1, ranks):
            return
        measure = _measure(ran, own_s)
        if measure is None:
            return
        relative, drawn = measure
        options = self.served.setdefault(job_id, {})
        old = options.get(key)
        if old is not None:
            relative = SMOOTHING * old.relative_time + (1 - SMOOTHING) * relative
            if drawn is None:
                drawn = old.power_w
            elif old.power_w is not None:
                drawn = SMOOTHING * old.power_w + (1 - SMOOTHING) * drawn
        options[key] = Served(key, relative, drawn)

    def measured(self, job_id: str) -> tuple[Served, ...]:
        """The job's options as measured, by key (frontier points, then throttled ones)."""
        return tuple(sorted(self.served.get(job_id, {}).values(), key=lambda m: -m.key))

    def record(self, job_id: str) -> BudgetTiming | None:
        """The job's measures as kept for a successor (None: none, or no frontier digest).

        At most `MAX_MEASURED` options (the frontier points first, then the shallowest caps).
        """
        frontier = self._frontiers.get(job_id)
        measured = self.measured(job_id)
        if not measured or not isinstance(frontier, str):
            return None
        own = self.own.get(job_id)
        return BudgetTiming(job_id=job_id, frontier=frontier, options=[
            MeasuredOption(key=m.key, relative_time=m.relative_time, power_w=m.power_w)
            for m in measured[:MAX_MEASURED]], own_step_s=own if own and own <= 1e6 else None)

    def restore(self, job_id: str, frontier: str, kept: BudgetTiming) -> bool:
        """Start from a predecessor's measures of a job on the frontier `frontier` digests.

        Only for a job with no measure here yet (seen already, or not), whose frontier is the
        one `kept` was measured on (another frontier's points differ under the same keys).
        Its own step time kept with them is taken if none is known here (a job taken over
        under a budget runs no step at its own point here: without it, none of its options
        would be measured until the budget lifts). Returns whether the measures were taken.
        """
        if (kept.job_id != job_id or kept.frontier != frontier
                or self._frontiers.get(job_id, frontier) != frontier):
            return False
        if kept.own_step_s is not None:  # (Its options are measured by it from now on.)
            self.own.setdefault(job_id, kept.own_step_s)
        if self.served.get(job_id):
            return False
        self._frontiers[job_id] = frontier
        self.served[job_id] = {o.key: Served(o.key, o.relative_time, o.power_w)
                               for o in kept.options}
        return bool(kept.options)

    def forget(self, live: Collection[str]) -> None:
        """Drop what is known of jobs not in `live`."""
        for table in (self.served, self._watch, self._frontiers, self.own):
            for job_id in [j for j in table if j not in live]:
                del table[job_id]


def _measure(ran: Sequence[tuple[float, float | None]], own_s: float
             ) -> tuple[float, float | None] | None:
    """(time over `own_s`, draw per GPU) of the steps `ran`; None: nothing usable.

    The time is the median's; the draw the energy over the time of the steps within
    `OUTLIER` of the median time (one step of a stalled rank, or a report a hostile trainer
    made huge, would otherwise count the option at nearly 0 W), None unless it is a power a
    GPU can draw (0, `MAX_POWER_W`].
    """
    median = statistics.median(t for t, _ in ran)
    if not 0 < median < math.inf:
        return None
    lo, hi = RELATIVE_RANGE
    relative = min(hi, max(lo, median / own_s))
    drawn, _ = mean_power_w((t, e) for t, e in ran if median / OUTLIER <= t <= median * OUTLIER)
    if drawn is not None and not 0 < drawn <= MAX_POWER_W:
        drawn = None
    return relative, drawn


def frontier_digest(chosen: int, times: Sequence[float]) -> str:
    """What tells a frontier from another, across replicas: 32 hex digits of a SHA-256.

    Of its chosen point and its points' planned times (`repr` writes a float exactly): a
    replica that replays a job's rounds plans the same frontier, to the bit.
    """
    text = repr((int(chosen), tuple(float(t) for t in times)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def worth_keeping(kept: BudgetTiming | None, now: BudgetTiming) -> bool:
    """Whether `now` says enough more than `kept` (what was written) to write it again.

    Another frontier or other options measured, or a time or draw moved by more than
    `KEEP_TOLERANCE` (a measure smoothed every round would write every round).
    """
    if kept is None or kept.frontier != now.frontier or (
            (kept.own_step_s is None) != (now.own_step_s is None)):
        return True
    before = {o.key: o for o in kept.options}
    if set(before) != {o.key for o in now.options}:
        return True
    for o in now.options:
        old = before[o.key]
        if abs(o.relative_time - old.relative_time) > KEEP_TOLERANCE * old.relative_time:
            return True
        if (o.power_w is None) != (old.power_w is None) or (
                o.power_w is not None and old.power_w is not None
                and abs(o.power_w - old.power_w) > KEEP_TOLERANCE * old.power_w):
            return True
    return False
