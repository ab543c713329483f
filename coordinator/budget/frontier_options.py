"""A Perseus job's time-energy frontier as a power budget's options, and back (pure).

A pipeline job serving a plan of a scheduler with a frontier (Perseus) takes part in a budget
through its frontier points, not a proportional cap: each point is one option of the allocator
(`coordinator.budget.allocator`), keyed by its index on the frontier (fastest first, energies
decreasing, so the average power E / T decreases along it too).

* **Time**: the point's planned iteration time. The measured iteration also holds what the
  planner does not see (the all-reduce, the optimizer step); that part hardly depends on the
  clocks, so the ratio of two points' planned times is a slight overestimate of the slowdown.
* **Power per GPU**: the point's energy over its time, over the GPUs whose energy it counts.
  The planner counts it as Perseus does: every instruction's energy plus the blocking power
  (P_block) for every second a stage waits (`planner.points.evaluate`), over one pipeline of
  S stages whose energies are the stage's ranks' summed (`make_3d_parallel`), so the frontier
  counts every GPU of the job: power per GPU = E / T / the job's GPUs.
* **Limit** (the node cap the GPUs get, the safety net): the highest power per GPU of any
  instruction the point's plan runs, from the scheduler's profile (time and energy of each
  (stage, kind, MHz)) with `HEADROOM`, within the GPUs' limits: it never throttles the plan as
  profiled, and holds a job that ignores its schedules near the point. Without a profile it is
  the GPUs' maximum limit (the clocks hold the point; the budget's measured draw corrects).

* **Under the slowest point**: a frontier ends at its least energy, often not far under the
  chosen point's power (GPT-3 on A40s, 8 stages: 11 % less), and its plans keep the
  critical path's instructions at the top clock, so a point's peak (and its node cap) is
  about the GPU's maximum. A cap that needs less gets *throttled* options, keyed by minus
  their limit L: the slowest point's plan under a node cap L. With the job's profile and
  schedule (`evaluate`), `throttle` models it every `THROTTLE_STEP_W` under its peak: each
  instruction at its highest profiled clock whose power fits L, the plan's time and energy
  as the planner counts them, while lower caps still change it. Under the last one's average
  power (or without a profile, the slowest point's), down to the GPUs' minimum: counted at L
  itself, a throttled GPU's most, at the same energy per iteration (time x P / L). Models,
  which the budget's measured draw corrects (`enforce.Tightener`); a job told such an option
  serves its slowest point (`pick`), its GPUs capped at L.

**Measured once served**: an option the job served (a frontier point or a throttled one)
counts at its measured step time, relative to its own point's, and its measured draw, and
deeper caps are scaled alike (`coordinator.budget.timing`: the models underestimate the time
of a point served under a cap and of deep caps, and overestimate the draw).

**Calibrated by measurement**: a plan's power is the planner's (its profile's energies, its
blocking power), and the draw also holds what the plan does not see (the all-reduce, the
optimizer step, clock changes). As Perseus calibrates its times by the first window served,
the budget loop scales every power of a frontier by the job's measured draw per GPU over the
planned one while it serves its own point (`own_ratio`, `calibrated`), and keeps that ratio
while a budget moves it.

The optimum is the point the job chose itself (`chosen`); the allocator never offers a point
that draws more (a faster one). Of the points from it on, at most `MAX_POINTS` are offered,
spread evenly in power (`offered`). The job is told the point's index and its power per GPU, and
serves `pick`'s point: that index if its frontier still has it at or under that power, else
the fastest point at or under it (the frontier changed: a re-plan), else its slowest point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.budget.allocator import Option, ProfiledJob
from zeus_agent.pipeline_order import action_kind

RATIO_RANGE = (0.5, 2.0)
"""Measured over planned power at a job's own point taken as its calibration (`own_ratio`)."""
MAX_POINTS = 32
"""Frontier points offered to the allocator per job, at most (`offered`)."""
THROTTLE_STEP_W = 25
"""Spacing of the throttled options' limits (W), as the power-limit optimizer's profile."""
HEADROOM = 1.05
"""The cap over the point's highest instruction power: profiles are means, draws vary."""
POWER_TOLERANCE = 1e-6
"""Relative: a point's power this close over a target is still at or under it."""

ProfileRow = tuple[int, str, int, float, float]
"""(stage, kind, MHz, time, energy), as `Perseus.profile_rows`."""


class Point(Protocol):
    """A frontier point (`planner.FrontierPoint`, `schedulers.base.PlanPoint`)."""

    @property
    def time(self) -> Any: ...  # noqa: D102 - a float or the planner's number
    @property
    def energy(self) -> Any: ...  # noqa: D102
    @property
    def plan(self) -> Any: ...  # noqa: D102 - per stage, (instruction, MHz) in order


Evaluate = Callable[[Any], tuple[float, float]]
"""(iteration time, energy) of a plan as the planner counts them (`planner.evaluate` on the
job's profile and schedule)."""


@dataclass(frozen=True, slots=True)
class Throttled:
    """The slowest point's plan under a node cap: what each instruction runs at then."""

    cap_w: int
    time_s: float
    power_w: float
    """Average power per GPU (W)."""
    peak_w: float
    """Highest instruction power per GPU of the throttled plan (W)."""


@dataclass(frozen=True, slots=True)
class Served:
    """An option as the job ran it (`coordinator.budget.timing`)."""

    key: int
    """The option's key: a frontier point's index, or minus a throttled option's cap (W)."""
    relative_time: float
    """Its step time over the job's at its own point."""
    power_w: float | None
    """Its draw per GPU (W); None: no energy measured."""


@dataclass(frozen=True, slots=True)
class FrontierView:
    """What a budget needs of one job's frontier: per point, time, power and peak per GPU."""

    times: tuple[float, ...]
    powers: tuple[float, ...]
    """Average power per GPU at each point (W)."""
    peaks: tuple[float | None, ...]
    """Highest instruction power per GPU at each point (W); None: not known."""
    chosen: int
    """Index of the point the job chose itself."""
    throttled: tuple[Throttled, ...] = ()
    """The slowest point under lower caps, by descending cap (modelled with its profile)."""
    measured: tuple[Served, ...] = ()
    """Options the job served, as measured (`coordinator.budget.timing`); they replace the
    model's times and draws (`options`)."""


def view(frontier: Sequence[Point], chosen: Point, gpus: int, rows: Iterable[ProfileRow] = (),
         evaluate: Evaluate | None = None) -> FrontierView | None:
    """The frontier of a job on `gpus` GPUs (None: nothing usable, e.g. a zero time).

    `rows` (the job's profile) give the points' peaks; with `evaluate` too, the slowest
    point under lower caps (`throttle`).
    """
    if not frontier or gpus < 1:
        return None
    index = next((i for i, p in enumerate(frontier) if p is chosen), None)
    if index is None:
        index = next((i for i, p in enumerate(frontier)
                      if (float(p.time), float(p.energy)) == (float(chosen.time),
                                                              float(chosen.energy))), None)
    times = tuple(float(p.time) for p in frontier)
    energies = tuple(float(p.energy) for p in frontier)
    if index is None or not all(math.isfinite(t) and t > 0 for t in times) or not all(
            math.isfinite(e) and e >= 0 for e in energies):
        return None
    table = _Table.of(rows, len(frontier[index].plan) or 1, gpus)
    peaks = tuple(table.peak(p.plan) for p in frontier)
    throttled = throttle(frontier[-1].plan, table, evaluate, gpus) if evaluate else ()
    return FrontierView(times, tuple(e / t / gpus for e, t in zip(energies, times, strict=True)),
                        peaks, index, throttled)


@dataclass(frozen=True, slots=True)
class _Table:
    """Power per GPU of each (stage, kind) at each profiled clock, fastest clock first."""

    clocks: dict[tuple[int, str], tuple[tuple[int, float], ...]]
    single: bool
    """A one-stage profile (it serves every stage)."""

    @classmethod
    def of(cls, rows: Iterable[ProfileRow], stages: int, gpus: int) -> _Table:
        per_stage = max(1.0, gpus / stages)  # (A stage's rows sum its GPUs' energies.)
        clocks: dict[tuple[int, str], list[tuple[int, float]]] = {}
        for s, kind, mhz, t, e in rows:
            if t > 0:
                clocks.setdefault((s, kind), []).append((int(mhz), e / t / per_stage))
        single = all(s == 0 for s, _ in clocks)
        return cls({k: tuple(sorted(v, reverse=True)) for k, v in clocks.items()}, single)

    def row(self, stage: int, name: str) -> tuple[tuple[int, float], ...] | None:
        try:
            kind = action_kind(name) or name
        except ValueError:
            return None
        return self.clocks.get((0 if self.single else stage, kind))

    def peak(self, plan: Any) -> float | None:
        """The highest instruction power per GPU of a plan (None: a row is missing)."""
        top = 0.0
        for stage, row in enumerate(plan):
            for name, mhz in row:
                w = dict(self.row(stage, name) or ()).get(int(mhz))
                if w is None:
                    return None
                top = max(top, w)
        return top if self.clocks else None

    def capped(self, plan: Any, cap_w: float) -> tuple[tuple[tuple[str, int], ...], ...] | None:
        """`plan` under a power limit of `cap_w`: what a cap does to it (None: a row is missing).

        Every instruction at its highest clock, at most its own, whose power is under the
        cap (its lowest when none is).
        """
        out = []
        for stage, row in enumerate(plan):
            new = []
            for name, mhz in row:
                clocks = self.row(stage, name)
                if not clocks:
                    return None
                fits = [f for f, w in clocks if f <= int(mhz) and w <= cap_w]
                new.append((name, fits[0] if fits else clocks[-1][0]))
            out.append(tuple(new))
        return tuple(out)


def throttle(plan: Any, table: _Table, evaluate: Evaluate, gpus: int) -> tuple[Throttled, ...]:
    """The plan under caps every `THROTTLE_STEP_W` under its peak, while they change it."""
    peak = table.peak(plan)
    if peak is None:
        return ()
    out: list[Throttled] = []
    previous = plan
    cap = math.ceil(peak / THROTTLE_STEP_W) * THROTTLE_STEP_W - THROTTLE_STEP_W
    while cap > 0:
        capped = table.capped(previous, cap)
        if capped is None:
            break
        if capped != tuple(tuple(r) for r in previous):
            try:
                t, e = evaluate(capped)
            except (ValueError, KeyError):  # A plan the profile or the schedule cannot take.
                break
            top = table.peak(capped)
            if not (t > 0 and math.isfinite(e)) or top is None:
                break
            out.append(Throttled(cap, float(t), float(e) / float(t) / gpus, top))
            previous = capped
        if all(f == (table.row(s, n) or ((0, 0.0),))[-1][0]
               for s, row in enumerate(previous) for n, f in row):
            break  # Every instruction at its lowest clock: lower caps are not modelled.
        cap -= THROTTLE_STEP_W
    return tuple(out)


def offered(frontier: FrontierView, most: int = MAX_POINTS) -> list[int]:
    """The points offered: the chosen one, the slowest, and at most `most` in all.

    From the chosen point on (faster ones are never offered), the nearest under evenly spaced
    powers: a planner's frontier has a point every 0.05 % of the iteration time, hundreds
    where a few dozen say as much, and the allocator's time grows with the options.
    """
    first, last = frontier.chosen, len(frontier.times) - 1
    if last - first + 1 <= most:
        return list(range(first, last + 1))
    top, low = frontier.powers[first], frontier.powers[last]
    keep = {first, last}
    for k in range(1, most - 1):
        level = top - (top - low) * k / (most - 1)
        keep.add(next(i for i in range(first, last + 1) if frontier.powers[i] <= level))
    return sorted(keep)


def options(frontier: FrontierView, min_limit_w: int, max_limit_w: int) -> tuple[Option, ...]:
    """The allocator's options: the points `offered`, keyed by index, then throttled ones."""
    out = []
    for i in offered(frontier):
        t, p, peak = frontier.times[i], frontier.powers[i], frontier.peaks[i]
        limit = max_limit_w if peak is None else math.ceil(peak * HEADROOM)
        out.append(Option(i, t, p, min(max(limit, min_limit_w), max_limit_w)))
    # The slowest point under the caps its profile models, then under caps below the last
    # one's average power: counted at the cap (a throttled GPU draws at most that), at the
    # same energy per iteration.
    last, peak = out[-1], frontier.peaks[-1]
    ref = min(max_limit_w, math.ceil(last.power_w if peak is None else peak * HEADROOM))
    modelled = [th for th in frontier.throttled if min_limit_w <= th.cap_w < ref]
    for th in modelled:  # (Calibrated over its cap: the GPUs draw the cap, taking longer.)
        option = Option(-th.cap_w, th.time_s, th.power_w, th.cap_w)
        out.append(_held(option, th.cap_w) if th.power_w > th.cap_w else option)
    last = out[-1]
    top = min(last.limit_w, math.ceil(last.power_w))
    limits = list(range(top - top % THROTTLE_STEP_W, min_limit_w, -THROTTLE_STEP_W))
    for cap in [*limits, min_limit_w] if top > min_limit_w else []:
        if cap < min(last.limit_w, last.power_w):
            out.append(_held(last, cap))
    return _measured(out, frontier) if frontier.measured else tuple(out)


def _measured(out: list[Option], frontier: FrontierView) -> tuple[Option, ...]:
    """The options with what was measured: an option served, at its time and draw.

    (The draw at most the option's limit.) An option not measured is scaled as the nearest
    measured one of its kind was (measured over modelled): a frontier point as the nearest
    measured point (the model's error there, clock changes it does not see, is its
    neighbours' too: without it the allocator would try one optimistic point after
    another), a throttled option as the nearest measured cap above it; above every measured
    cap the model stands, and the job's own point is the plan's. Deeper caps never run
    faster, nor faster than the slowest point as counted (they run its plan).
    """
    chosen_s = frontier.times[frontier.chosen]
    modelled = {o.key: o for o in out}
    scale: dict[int, tuple[float, float]] = {}
    for m in frontier.measured:
        model = modelled.get(m.key)
        if (model is not None and model.time_s > 0 and model.power_w > 0
                and math.isfinite(m.relative_time) and m.relative_time > 0
                and (m.power_w is None or 0 < m.power_w < math.inf)):
            power = 1.0 if m.power_w is None else m.power_w / model.power_w
            scale[m.key] = (chosen_s * m.relative_time / model.time_s, power)
    points = [key for key in scale if key >= 0]
    done: list[Option] = []
    slowest = 0.0
    for o in out:
        if o.key == frontier.chosen:
            time, power = 1.0, 1.0
        elif o.key >= 0:  # (The nearest measured point's error, the slower one of a tie.)
            near = min(points, key=lambda k: (abs(k - o.key), -k), default=None)
            time, power = (1.0, 1.0) if near is None else scale[near]
        else:
            above = [key for key in scale if key <= o.key]  # (caps at or over its own)
            time, power = scale[max(above)] if above else (1.0, 1.0)
        t = o.time_s * time
        if o.key >= 0:  # (In order: the last is the slowest point, whose plan caps throttle.)
            slowest = t
        else:
            t = slowest = max(slowest, t)
        done.append(Option(o.key, t, min(o.power_w * power, float(o.limit_w)), o.limit_w))
    return tuple(done)


def _held(option: Option, cap: int) -> Option:
    """`option` under a cap below its average power: counted at the cap.

    A throttled GPU draws at most its cap; the iteration takes the same energy.
    """
    return Option(-cap, option.time_s * option.power_w / cap, float(cap), cap)


def under_caps(plan: Any, rows: Iterable[ProfileRow], gpus: int, evaluate: Evaluate,
               min_limit_w: int, max_limit_w: int) -> tuple[Option, ...]:
    """One plan kept under node caps, every `THROTTLE_STEP_W` from the maximum to the minimum.

    What a cap does to a job that stays on its plan (a proportional or uniform cut): each
    instruction at its highest clock under the cap (`_Table.capped`), timed by `evaluate`;
    under its lowest clocks, the same energy per iteration. Keyed by minus the cap; empty if
    the profile lacks a row of the plan.
    """
    table = _Table.of(rows, len(plan) or 1, gpus)
    limits = list(range(max_limit_w, min_limit_w, -THROTTLE_STEP_W)) + [min_limit_w]
    out = []
    for cap in limits:
        capped = table.capped(plan, cap)
        peak = None if capped is None else table.peak(capped)
        if capped is None or peak is None:
            return ()
        t, e = evaluate(capped)
        option = Option(-cap, float(t), float(e) / float(t) / gpus, cap)
        out.append(_held(option, cap) if option.power_w > cap else option)
    return tuple(out)


def own_ratio(frontier: FrontierView, measured_w: float) -> float | None:
    """Measured over planned power per GPU at the job's own point.

    None: out of `RATIO_RANGE` (GPUs idle while the job waits, say: nothing to learn from).
    """
    planned = frontier.powers[frontier.chosen]
    ratio = measured_w / planned if planned > 0 else None
    lo, hi = RATIO_RANGE
    return ratio if ratio is not None and lo <= ratio <= hi else None


def calibrated(frontier: FrontierView, ratio: float,
               measured: tuple[Served, ...] = ()) -> FrontierView:
    """`frontier` with every power (points, peaks, throttled plans) times `ratio`.

    `measured`: the options as served (`coordinator.budget.timing`).
    """
    if ratio == 1.0 and measured == frontier.measured:
        return frontier
    return FrontierView(
        frontier.times, tuple(p * ratio for p in frontier.powers),
        tuple(None if p is None else p * ratio for p in frontier.peaks), frontier.chosen,
        tuple(Throttled(t.cap_w, t.time_s, t.power_w * ratio, t.peak_w * ratio)
              for t in frontier.throttled), measured)


def profiled_job(job_id: str, frontier: FrontierView, gpus: int, min_limit_w: int,
                 max_limit_w: int, weight: float = 1.0) -> ProfiledJob:
    """The allocator's job for a pipeline job with `gpus` of its GPUs inside the budget."""
    return ProfiledJob(job_id, gpus, options(frontier, min_limit_w, max_limit_w),
                       frontier.chosen, min_limit_w, weight)


def served(frontier: FrontierView, index: int, power_w: float) -> int:
    """The key of the option a job serves when told (`index`, `power_w`): `pick`'s, on its view.

    The view's powers are `pick`'s (energy over time over the job's GPUs, uncalibrated), so
    a job's steps are measured under the point it runs (a stale point, of a frontier it
    planned before, is served as another index).
    """
    n = len(frontier.powers)
    if index < 0 or n == 0:
        return index
    limit = power_w * (1 + POWER_TOLERANCE)
    if index < n and frontier.powers[index] <= limit:
        return index
    under = [i for i in range(n) if frontier.powers[i] <= limit]
    if under:
        return min(under, key=lambda i: (frontier.times[i], i))
    return min(range(n), key=lambda i: (frontier.powers[i], -i))


def pick(frontier: Sequence[Point], gpus: int, index: int, power_w: float) -> int:
    """The index of the point a job serves for a budget's point `index` of `power_w` per GPU.

    A throttled option (`index` < 0): the slowest point, under its cap. Else that index if
    the frontier has it at or under `power_w` (the job's planned power, uncalibrated); else
    the fastest point at or under it; else the slowest point (the least power there is).
    """
    if not frontier:
        raise ValueError("empty frontier")
    if index < 0:
        return len(frontier) - 1
    share = max(1, gpus)

    def power(i: int) -> float:
        t = float(frontier[i].time)
        return float(frontier[i].energy) / t / share if t > 0 else math.inf

    limit = power_w * (1 + POWER_TOLERANCE)
    if 0 <= index < len(frontier) and power(index) <= limit:
        return index
    under = [i for i in range(len(frontier)) if power(i) <= limit]
    if under:
        return min(under, key=lambda i: (float(frontier[i].time), i))
    return min(range(len(frontier)), key=lambda i: (power(i), -i))
