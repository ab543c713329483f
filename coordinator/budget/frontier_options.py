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
  chosen point's power (GPT-3 on A40s, 8 stages: 11 % less). A cap that needs less gets
  *throttled* options, keyed by minus their limit: the slowest point's plan under a node cap
  L every `THROTTLE_STEP_W` below the cap C that would not throttle it (its limit, or its
  average power when its peak is not known) down to the GPUs' minimum, modelled at the same
  energy per iteration (power x L / C, time x C / L). It is a model, which the budget's
  measured draw corrects (`enforce.Tightener`); a job told such an option serves its slowest
  point (`pick`), its GPUs capped at L.

The optimum is the point the job chose itself (`chosen`); the allocator never offers a point
that draws more (a faster one). The job is told the point's index and its power per GPU, and
serves `pick`'s point: that index if its frontier still has it at or under that power, else
the fastest point at or under it (the frontier changed: a re-plan), else its slowest point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.budget.allocator import Option, ProfiledJob
from zeus_agent.pipeline_order import action_kind

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


def view(frontier: Sequence[Point], chosen: Point, gpus: int,
         rows: Iterable[ProfileRow] = ()) -> FrontierView | None:
    """The frontier of a job on `gpus` GPUs (None: nothing usable, e.g. a zero time)."""
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
    power = {(s, k, f): e / t for s, k, f, t, e in rows if t > 0}
    stages = len(frontier[index].plan) or 1
    peaks = tuple(_peak(p.plan, power, stages, gpus) for p in frontier)
    return FrontierView(times, tuple(e / t / gpus for e, t in zip(energies, times, strict=True)),
                        peaks, index)


def _peak(plan: Any, power: dict[tuple[int, str, int], float], stages: int,
          gpus: int) -> float | None:
    """The highest instruction power per GPU of a plan (None: a row is missing)."""
    if not power:
        return None
    per_stage = max(1.0, gpus / stages)
    single = all(s == 0 for s, _, _ in power)  # (A one-stage profile serves every stage.)
    top = 0.0
    for stage, row in enumerate(plan):
        for name, mhz in row:
            try:
                kind = action_kind(name) or name
            except ValueError:
                return None
            w = power.get((0 if single else stage, kind, int(mhz)))
            if w is None:
                return None
            top = max(top, w / per_stage)
    return top


def options(frontier: FrontierView, min_limit_w: int, max_limit_w: int) -> tuple[Option, ...]:
    """The allocator's options: one per point, keyed by its index, then throttled ones."""
    out = []
    for i, (t, p, peak) in enumerate(zip(frontier.times, frontier.powers, frontier.peaks,
                                         strict=True)):
        limit = max_limit_w if peak is None else math.ceil(peak * HEADROOM)
        out.append(Option(i, t, p, min(max(limit, min_limit_w), max_limit_w)))
    last, peak = out[-1], frontier.peaks[-1]
    ref = min(max_limit_w, math.ceil(last.power_w if peak is None else peak * HEADROOM))
    limits = list(range(ref - THROTTLE_STEP_W, min_limit_w, -THROTTLE_STEP_W))
    for cap in [*limits, min_limit_w] if ref > min_limit_w else []:
        out.append(Option(-cap, last.time_s * ref / cap, last.power_w * cap / ref, cap))
    return tuple(out)


def profiled_job(job_id: str, frontier: FrontierView, gpus: int, min_limit_w: int,
                 max_limit_w: int, weight: float = 1.0) -> ProfiledJob:
    """The allocator's job for a pipeline job with `gpus` of its GPUs inside the budget."""
    return ProfiledJob(job_id, gpus, options(frontier, min_limit_w, max_limit_w),
                       frontier.chosen, min_limit_w, weight)


def pick(frontier: Sequence[Point], gpus: int, index: int, power_w: float) -> int:
    """The index of the point a job serves for a budget's point `index` of `power_w` per GPU.

    That index if the frontier has it at or under `power_w`; else the fastest point at or
    under it; else the slowest point (the least power there is).
    """
    if not frontier:
        raise ValueError("empty frontier")
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
