"""Share a power cap among a group's jobs: the least total weighted slowdown under the cap.

Pure, synchronous and deterministic, like the power-limit machine: the service hands it what
the jobs measured and applies what it returns.

The problem is a multiple-choice knapsack. Each profiled job picks exactly one option (a power
limit for a data-parallel job, a frontier point for a Perseus job), each option has an
expected time per step and average power per GPU; the job's cost at an option is
``weight * max(0, time / time_at_its_optimum - 1)`` and the group's expected draw (the options'
power times the jobs' GPUs, plus idle GPUs and the jobs without a profile) must not exceed the
cap. Only options that draw no more than the job's own optimum are offered: a budget never
raises a job above the limit it would choose by itself.

Solved exactly by dynamic programming over discretised watts: every option's draw is rounded
*up* to a whole number of cells of `resolution_w` and the cap's room rounded *down*, so the
chosen allocation's true expected draw never exceeds the cap. The DP is exact on the rounded
draws; against the true draws it is at least as good as the true optimum for
``cap - jobs * resolution_w`` (a solution feasible there is feasible once rounded). The
resolution is 1 W unless the room between the group's floor and its optimum's draw needs more
than `MAX_CELLS` cells, when it grows to keep the table that size (3,000 GPUs, a 25 % cut:
about 10 W per cell, some 0.1 % of the cap). Chosen over branch-and-bound because its time is
bounded (jobs x options x cells, vectorised) whatever the profiles' shape, and the worst case
is what a grid event meets.

Ties: among allocations of equal cost (within `COST_TOLERANCE`, relative) the one with the
lower expected draw wins, leaving more margin under the cap; between equal draws, the table's
order decides: jobs in id order, each job's options by ascending power, the lower option first.
A cap that every job's optimum fits under is no contest: every job keeps its optimum.

Jobs without a profile are capped proportionally: each GPU gets
``clamp(floor(max_limit * cap / uncapped_draw), min_limit, max_limit)``, where the uncapped
draw is the group's expected draw with every profiled job at its optimum and every unprofiled
GPU at its measured draw (its maximum limit if nothing was measured), and it is counted at
that limit. Should the profiled jobs then not fit, the unprofiled jobs go to their minimum.

A cap below the group's floor (every busy GPU at its minimum limit, idle GPUs at their idle
power) cannot be held by power limits and is refused with `BelowFloorError`, which states it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_CELLS = 1 << 15
"""Width of the DP table; the resolution grows past 1 W to keep it this size."""

MIN_RESOLUTION_W = 1.0
"""Finest resolution used: a watt per job is far below what a GPU's draw varies by."""

COST_TOLERANCE = 1e-9
"""Relative: costs this close are a tie (float sums in different orders differ a little)."""


class BudgetError(ValueError):
    """A group or cap the allocator cannot work with; the message says why."""


class BelowFloorError(BudgetError):
    """The cap is below what the group draws with every GPU at its minimum limit."""

    def __init__(self, cap_w: float, floor_w: float) -> None:
        super().__init__(
            f"cap {cap_w:.0f} W is below the group's floor {floor_w:.0f} W "
            "(every busy GPU at its minimum power limit, idle GPUs at their idle power)"
        )
        self.cap_w = cap_w
        self.floor_w = floor_w


@dataclass(frozen=True, slots=True)
class Option:
    """One choice for a job: what a step takes and what each GPU draws there."""

    key: int
    """A power limit in W (data-parallel job) or a frontier point's index (Perseus job)."""
    time_s: float
    power_w: float
    """Expected average power per GPU."""
    limit_w: int
    """The power limit per GPU that holds the option (the limit itself for a data-parallel job)."""


@dataclass(frozen=True, slots=True)
class ProfiledJob:
    """A job with a profile: its options, its optimum and its priority weight."""

    job_id: str
    gpus: int
    options: tuple[Option, ...]
    optimum: int
    """Key of the option the job would run at without a budget."""
    min_limit_w: int
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class UnprofiledJob:
    """A job not profiled yet: capped proportionally (see the module)."""

    job_id: str
    gpus: int
    min_limit_w: int
    max_limit_w: int
    draw_w: float | None = None
    """Measured draw per GPU, if any."""


@dataclass(frozen=True, slots=True)
class Group:
    """What shares one cap: the jobs on its GPUs, its idle GPUs and the cap."""

    cap_w: float
    jobs: tuple[ProfiledJob, ...] = ()
    unprofiled: tuple[UnprofiledJob, ...] = ()
    idle_w: float = 0.0
    """Sum of the idle GPUs' idle power."""


@dataclass(frozen=True, slots=True)
class Share:
    """What one job gets: an option (None for a job without a profile) and its GPUs' limit."""

    job_id: str
    key: int | None
    limit_w: int
    expected_w: float
    """The job's expected draw, all its GPUs."""
    slowdown: float
    """time / time at its optimum - 1, unweighted (0 for a job without a profile)."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """The chosen share of every job, the expected draw and the DP's resolution."""

    shares: tuple[Share, ...]
    expected_w: float
    cost: float
    """Total weighted slowdown."""
    floor_w: float
    resolution_w: float
    by_job: dict[str, Share] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_job", {s.job_id: s for s in self.shares})


def floor_w(group: Group) -> float:
    """The least the group can be held to with power limits."""
    busy = sum(j.gpus * j.min_limit_w for j in group.jobs)
    busy += sum(j.gpus * j.min_limit_w for j in group.unprofiled)
    return float(busy + group.idle_w)


def allocate(group: Group, *, max_cells: int = MAX_CELLS) -> Allocation:
    """The allocation of least total weighted slowdown whose expected draw is under the cap."""
    _validate(group)
    floor = floor_w(group)
    if group.cap_w < floor:
        raise BelowFloorError(group.cap_w, floor)
    # Jobs in the order of their ids: of equally good allocations, the same one whatever
    # order the group lists its jobs in (ties go to the job whose id sorts first).
    tables = [_JobTable.build(job) for job in sorted(group.jobs, key=lambda j: j.job_id)]
    fixed = group.idle_w
    unprof = _proportional(group, tables)
    room = group.cap_w - fixed - sum(s.expected_w for s in unprof)
    if room < sum(t.powers[0] for t in tables):
        unprof = [_unprofiled_share(u, u.min_limit_w) for u in group.unprofiled]
        room = group.cap_w - fixed - sum(s.expected_w for s in unprof)
    picks, resolution = _solve(tables, room, max_cells)
    shares = [t.share(k) for t, k in zip(tables, picks, strict=True)] + unprof
    shares.sort(key=lambda s: s.job_id)
    expected = fixed + sum(s.expected_w for s in shares)
    cost = sum(t.costs[k] for t, k in zip(tables, picks, strict=True))
    return Allocation(tuple(shares), expected, float(cost), floor, resolution)


def uniform_cut(group: Group) -> Allocation:
    """The baseline: every GPU the same limit, the highest whose expected draw fits the cap.

    A job's option at a limit is its option with the highest limit at or under it (of several
    with that limit, the fastest; its lowest if none is); a job without a profile is counted
    at the limit itself.
    """
    _validate(group)
    floor = floor_w(group)
    if group.cap_w < floor:
        raise BelowFloorError(group.cap_w, floor)
    tables = [_JobTable.build(job) for job in group.jobs]
    limits = sorted(
        {o.limit_w for t in tables for o in t.options}
        | {u.max_limit_w for u in group.unprofiled}
        | {u.min_limit_w for u in group.unprofiled},
        reverse=True,
    )
    best: Allocation | None = None
    for limit in limits:
        alloc = _at_uniform_limit(group, tables, limit, floor)
        best = alloc
        if alloc.expected_w <= group.cap_w:
            break
    assert best is not None
    return best


def _at_uniform_limit(
    group: Group, tables: Sequence[_JobTable], limit: int, floor: float
) -> Allocation:
    shares: list[Share] = []
    cost = 0.0
    for t in tables:
        under = [i for i, o in enumerate(t.options) if o.limit_w <= limit]
        # Equal limits (frontier points whose plans one cap does not throttle): the fastest.
        k = max(under, key=lambda i: (t.options[i].limit_w, i)) if under else 0
        shares.append(t.share(k))
        cost += t.costs[k]
    for u in group.unprofiled:
        shares.append(_unprofiled_share(u, min(max(limit, u.min_limit_w), u.max_limit_w)))
    shares.sort(key=lambda s: s.job_id)
    expected = group.idle_w + sum(s.expected_w for s in shares)
    return Allocation(tuple(shares), expected, cost, floor, 0.0)


@dataclass(frozen=True, slots=True)
class _JobTable:
    """A job's offered options, by ascending power, with their costs and total draws."""

    job: ProfiledJob
    options: tuple[Option, ...]
    costs: tuple[float, ...]
    powers: tuple[float, ...]
    best: int
    """Index of the job's optimum."""

    @classmethod
    def build(cls, job: ProfiledJob) -> _JobTable:
        best = next(o for o in job.options if o.key == job.optimum)
        offered = sorted(
            (o for o in job.options if o.power_w <= best.power_w),
            key=lambda o: (o.power_w, o.limit_w, o.key),
        )
        costs = tuple(job.weight * max(0.0, o.time_s / best.time_s - 1.0) for o in offered)
        powers = tuple(job.gpus * o.power_w for o in offered)
        return cls(job, tuple(offered), costs, powers, offered.index(best))

    def share(self, k: int) -> Share:
        o = self.options[k]
        slowdown = self.costs[k] / self.job.weight
        return Share(self.job.job_id, o.key, o.limit_w, self.powers[k], slowdown)


def _proportional(group: Group, tables: Sequence[_JobTable]) -> list[Share]:
    if not group.unprofiled:
        return []
    uncapped = group.idle_w + sum(t.powers[t.best] for t in tables)
    uncapped += sum(u.gpus * _draw(u) for u in group.unprofiled)
    ratio = min(1.0, group.cap_w / uncapped)
    out = []
    for u in group.unprofiled:
        limit = min(max(math.floor(u.max_limit_w * ratio), u.min_limit_w), u.max_limit_w)
        out.append(_unprofiled_share(u, limit))
    return out


def _draw(u: UnprofiledJob) -> float:
    return u.draw_w if u.draw_w is not None else float(u.max_limit_w)


def _unprofiled_share(u: UnprofiledJob, limit: int) -> Share:
    return Share(u.job_id, None, limit, float(u.gpus * limit), 0.0)


def _solve(tables: Sequence[_JobTable], room_w: float, max_cells: int) -> tuple[list[int], float]:
    """Each table's chosen index: least cost, then least draw, within `room_w` (see module)."""
    tops = [t.best for t in tables]
    if not tables or sum(t.powers[t.best] for t in tables) <= room_w:
        return tops, 0.0
    base = sum(t.powers[0] for t in tables)
    span = sum(t.powers[-1] - t.powers[0] for t in tables)
    resolution = max(MIN_RESOLUTION_W, min(span, room_w - base) / max_cells)
    cells = [[_cells(p, resolution) for p in t.powers] for t in tables]
    extras = [[c - row[0] for c in row] for row in cells]
    budget = math.floor(room_w / resolution)
    while budget * resolution > room_w:
        budget -= 1
    budget -= sum(row[0] for row in cells)
    if budget < 0:
        # Rounding up cost more than the true room: every job at its lowest option fits.
        return [0] * len(tables), resolution
    return _dp(tables, extras, budget), resolution


def _cells(power_w: float, resolution: float) -> int:
    n = math.ceil(power_w / resolution)
    return n + 1 if n * resolution < power_w else n


def _dp(tables: Sequence[_JobTable], extras: list[list[int]], budget: int) -> list[int]:
    """dp[w]: least cost with the extra cells used exactly w; a tie keeps the lower option."""
    reach = 0
    dp = np.zeros(1)
    choices: list[np.ndarray] = []
    for t, extra in zip(tables, extras, strict=True):
        reach = min(budget, reach + extra[-1])
        width = reach + 1
        best = np.full(width, np.inf)
        choice = np.zeros(width, dtype=np.int16)
        for k in _undominated(t):
            e = extra[k]
            n = min(len(dp), width - e)
            if n <= 0:
                continue
            cand = dp[:n] + t.costs[k]
            view = best[e : e + n]
            better = cand < view
            np.copyto(view, cand, where=better)
            choice[e : e + n][better] = k
        dp = best
        choices.append(choice)
    least = float(dp.min())
    w = int(np.flatnonzero(dp <= least + COST_TOLERANCE * max(1.0, abs(least)))[0])
    picks = [0] * len(tables)
    for j in range(len(tables) - 1, -1, -1):
        k = int(choices[j][w])
        picks[j] = k
        w -= extras[j][k]
    return picks


def _undominated(t: _JobTable) -> list[int]:
    """Options no cheaper one at no more power beats (by ascending power, so by index)."""
    keep: list[int] = []
    least = math.inf
    for k, cost in enumerate(t.costs):
        if cost < least:
            keep.append(k)
            least = cost
    return keep


def _validate(group: Group) -> None:
    _finite("cap_w", group.cap_w, 0.0)
    _finite("idle_w", group.idle_w, 0.0)
    seen: set[str] = set()
    everyone: list[ProfiledJob | UnprofiledJob] = [*group.jobs, *group.unprofiled]
    for job in everyone:
        if job.job_id in seen:
            raise BudgetError(f"job {job.job_id!r} is listed twice")
        seen.add(job.job_id)
        if job.gpus < 1:
            raise BudgetError(f"job {job.job_id!r} has {job.gpus} GPUs")
        if job.min_limit_w < 1:
            raise BudgetError(f"job {job.job_id!r}: minimum limit {job.min_limit_w} W")
    for u in group.unprofiled:
        if u.max_limit_w < u.min_limit_w:
            raise BudgetError(f"job {u.job_id!r}: maximum limit below its minimum")
        if u.draw_w is not None:
            _finite(f"{u.job_id} draw_w", u.draw_w, 0.0)
    for j in group.jobs:
        check_job(j)


def check_job(j: ProfiledJob) -> None:
    """Refuse a profiled job's options the allocator cannot work with (`BudgetError`).

    What `allocate` checks of each profiled job, so that a caller can leave one job's bad
    profile out (cap it proportionally) instead of losing the whole group's allocation.
    """
    _finite(f"{j.job_id} weight", j.weight, 1e-6)
    if not j.options or j.optimum not in {o.key for o in j.options}:
        raise BudgetError(f"job {j.job_id!r}: its optimum {j.optimum} is not an option")
    if len({o.key for o in j.options}) != len(j.options):
        raise BudgetError(f"job {j.job_id!r}: two options share a key")
    for o in j.options:
        _finite(f"{j.job_id} option {o.key} time_s", o.time_s, 1e-12)
        _finite(f"{j.job_id} option {o.key} power_w", o.power_w, 0.0)


def _finite(name: str, value: float, least: float) -> None:
    if not math.isfinite(value) or value < least:
        raise BudgetError(f"{name} must be a finite number >= {least:g}, not {value!r}")
