"""A grid event on a simulated cluster, judged (pure): power against the cap, losses, restore.

The inputs are what the agents published (each GPU's samples: time, energy counter, power
limit) and the jobs' shapes; nothing here reads a clock or the bus.

* `PowerSeries`: each GPU's energy counter over time; `group_power` gives the group's power in
  bins (energy counters, not instantaneous readings: a GPU idles between steps and a reading
  catches either side).
* `seconds_to_cap`: from the signal until the group's power is under the cap and stays there
  until the event ends (`first_under`: when it first got under, and the bins over it after);
  `over_cap_joules`: the energy drawn above the cap in a window.
* `sustained`: the same held as a cluster operator's meter holds it: under the cap once the
  group's power averaged over any `SUSTAINED_S` window after it got there is (the strict
  figure next to it, always).
* `seconds_to_restore`: from the lift until every job's GPUs are at its own optimum again.
* `true_group` / `compare_losses`: the jobs on the simulator's true curves (`physics`), and the
  group's throughput loss at the limits the coordinator applied, at the uniform cut (every GPU
  one limit, the highest that fits the cap) and at the offline optimum (the allocator on the
  true curves).

* `pipeline_truth` / `compare_with_pipeline`: the same with a Perseus job in the group, on the
  simulator's noiseless instructions (its frontier for the optimum, its chosen plan under the
  uniform limit for the uniform cut; ours at its share's planned slowdown).
* `draw_ratio` / `scaled`: the judge on the curves measured in the run. Each job's curve
  powers scaled by what its GPUs measured at its own optimum before the signal over what the
  curve says there (the times stay the simulator's): a job whose GPUs draw less than their
  curve (a pipeline's bubbles waiting on a loaded host, a straggler) leaves the others more of
  the cap, at its optimum as under the cut, and the uniform cut and the optimum are judged on
  what the cluster draws, not on what the noiseless model says it would.

Throughput loss of a group: the mean over its jobs of ``1 - T_opt / T`` (the share of its own
throughput each job loses; jobs count alike, as the allocator weighs them).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from coordinator.budget import allocator as alloc
from coordinator.pipeline import planner
from zeus_agent.gpu.sim import instructions
from zeus_agent.gpu.sim.physics import operating_point
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS

GpuKey = tuple[str, int]


@dataclass
class PowerSeries:
    """Each GPU's samples: (t_s, energy_j, power_limit_w), in time order."""

    samples: dict[GpuKey, list[tuple[float, float, int]]] = field(default_factory=dict)

    def add(self, key: GpuKey, t_s: float, energy_j: float, limit_w: int) -> None:
        """One sample (one older than the GPU's last is dropped: batches may overlap)."""
        rows = self.samples.setdefault(key, [])
        if rows and t_s <= rows[-1][0]:
            return
        rows.append((t_s, energy_j, limit_w))

    def energy_at(self, key: GpuKey, t_s: float) -> float | None:
        """The GPU's counter at `t_s`, interpolated; None outside its samples."""
        rows = self.samples.get(key, [])
        i = bisect.bisect_left(rows, (t_s, -math.inf, 0))
        if i < len(rows) and rows[i][0] == t_s:
            return rows[i][1]
        if i == 0 or i >= len(rows):
            return None
        (t0, e0, _), (t1, e1, _) = rows[i - 1], rows[i]
        return e0 + (e1 - e0) * (t_s - t0) / (t1 - t0)

    def group_power(self, keys: Sequence[GpuKey], t0_s: float, t1_s: float,
                    bin_s: float) -> list[tuple[float, float]]:
        """(bin end, group power W) for each bin of [t0, t1) every GPU's samples cover."""
        out = []
        n = int((t1_s - t0_s) / bin_s)
        for b in range(n):
            a, z = t0_s + b * bin_s, t0_s + (b + 1) * bin_s
            total = 0.0
            for key in keys:
                ea, ez = self.energy_at(key, a), self.energy_at(key, z)
                if ea is None or ez is None:
                    break
                total += (ez - ea) / bin_s
            else:
                out.append((z, total))
        return out

    def limit_since(self, key: GpuKey, t_s: float, limit_w: int) -> float | None:
        """The first sample time after `t_s` from which the GPU's limit stays `limit_w`."""
        since = None
        for t, _, w in self.samples.get(key, []):
            if t < t_s:
                continue
            since = (t if since is None else since) if w == limit_w else None
        return since

    def limit_at(self, key: GpuKey, t_s: float) -> int | None:
        """The GPU's limit in its last sample at or before `t_s`."""
        rows = self.samples.get(key, [])
        i = bisect.bisect_right(rows, (t_s, math.inf, 0))
        return rows[i - 1][2] if i else None


def seconds_to_cap(power: Sequence[tuple[float, float]], cap_w: float,
                   signal_s: float) -> float | None:
    """From the signal to the end of the first bin after which every bin is under the cap."""
    after = [(t, p) for t, p in power if t > signal_s]
    last_over = max((i for i, (_, p) in enumerate(after) if p > cap_w), default=-1)
    if last_over == len(after) - 1:
        return None
    return after[last_over + 1][0] - signal_s


def first_under(power: Sequence[tuple[float, float]], cap_w: float,
                signal_s: float) -> dict[str, float | int | None]:
    """When the group's power first got under the cap, and how it held from then on.

    `seconds_to_cap` is strict: one bin a few watts over, late in the event, moves it there.
    This says what it hides: the end of the first bin under the cap (s from the signal), the
    bins over it after that and their largest excess (W).
    """
    after = [(t, p) for t, p in power if t > signal_s]
    first = next((i for i, (_, p) in enumerate(after) if p <= cap_w), None)
    if first is None:
        return {"seconds_to_first_under": None, "bins_over_after": None,
                "max_over_after_w": None}
    over = [p - cap_w for _, p in after[first:] if p > cap_w]
    return {"seconds_to_first_under": after[first][0] - signal_s, "bins_over_after": len(over),
            "max_over_after_w": max(over, default=0.0)}


SUSTAINED_S = 5.0
"""The window a cap is held over in the operator's policy (`sustained`; see
docs/guides/power-budgets.md)."""


def sustained(power: Sequence[tuple[float, float]], cap_w: float, signal_s: float,
              end_s: float, window_s: float = SUSTAINED_S,
              bin_s: float = 0.5) -> dict[str, float | None]:
    """Seconds to the cap held as sustained power: each `window_s` window's mean under it.

    From the signal to the end of the first bin under the cap after which the group's power,
    averaged over any `window_s` of bins that starts there or later and ends by `end_s` (the
    lift), stays under the cap; and the largest such mean's excess once under (W, 0 if
    none). A window with a bin missing (a GPU not sampled) is not judged. The strict figure
    (`seconds_to_cap`, every bin) is reported next to it.
    """
    after = [(t, p) for t, p in power if signal_s < t <= end_s]
    n = max(1, round(window_s / bin_s))
    means: list[tuple[int, float]] = []  # (index of the window's first bin, mean)
    for i in range(len(after) - n + 1):
        chunk = after[i:i + n]
        if chunk[-1][0] - chunk[0][0] <= (n - 1) * bin_s + bin_s / 2:
            means.append((i, sum(p for _, p in chunk) / n))
    for i, (t, p) in enumerate(after):
        if p > cap_w:
            continue
        later = [m for j, m in means if j >= i]
        if all(m <= cap_w for m in later):
            return {"seconds_to_cap_sustained": t - signal_s,
                    "max_over_sustained_w": max(0.0, *(m - cap_w for m in later))}
    return {"seconds_to_cap_sustained": None, "max_over_sustained_w": None}


def over_cap_joules(power: Sequence[tuple[float, float]], cap_w: float, t0_s: float,
                    t1_s: float, bin_s: float) -> float:
    """Energy drawn above the cap by bins ending in (t0, t1]."""
    return sum(max(0.0, p - cap_w) * bin_s for t, p in power if t0_s < t <= t1_s)


def seconds_to_restore(series: PowerSeries, optimum: Mapping[GpuKey, int],
                       lift_s: float) -> float | None:
    """From the lift until every GPU's limit is its job's optimum (None: one never got back)."""
    latest = lift_s
    for key, limit in optimum.items():
        since = series.limit_since(key, lift_s, limit)
        if since is None:
            return None
        latest = max(latest, since)
    return latest - lift_s


@dataclass(frozen=True, slots=True)
class SimJob:
    """A simulated job: its workload (a reference profile's fit), GPU model and GPUs."""

    name: str
    workload: str
    preset: str
    gpus: tuple[GpuKey, ...]
    optimum_w: int
    step_w: int = 25


def true_options(job: SimJob) -> tuple[alloc.Option, ...]:
    """The job's options at each limit on the simulator's curves (no noise)."""
    hw, wl = PRESETS[job.preset], WORKLOADS[job.workload]
    out = []
    for limit in range(hw.min_power_limit_w, hw.max_power_limit_w + 1, job.step_w):
        p = operating_point(hw, wl, limit)
        out.append(alloc.Option(limit, p.step_time_s, p.avg_power_w, limit))
    return tuple(out)


def true_group(jobs: Iterable[SimJob], cap_w: float, idle_w: float) -> alloc.Group:
    """The allocator's group for the jobs on their true curves."""
    profiled = []
    for job in jobs:
        options = true_options(job)
        low = min(o.limit_w for o in options)
        profiled.append(alloc.ProfiledJob(job.name, len(job.gpus), options, job.optimum_w, low))
    return alloc.Group(cap_w, tuple(profiled), (), idle_w)


def draw_ratio(measured_w: float | None, curve_w: float) -> float:
    """A job's measured draw over its curve's at the same limit (1 without a measure)."""
    if measured_w is None or not math.isfinite(measured_w) or measured_w <= 0 or curve_w <= 0:
        return 1.0
    return measured_w / curve_w


def curve_draw(job: alloc.ProfiledJob) -> float:
    """A job's draw at its optimum on its options (all its GPUs)."""
    return job.gpus * next(o.power_w for o in job.options if o.key == job.optimum)


def scaled(job: alloc.ProfiledJob, ratio: float) -> alloc.ProfiledJob:
    """`job` with every option's power times `ratio` (its times as they are)."""
    return replace(job, options=tuple(replace(o, power_w=o.power_w * ratio)
                                      for o in job.options))


def scaled_group(group: alloc.Group, ratios: Mapping[str, float],
                 idle_w: float | None = None) -> alloc.Group:
    """`group` with each job's powers scaled by `ratios[job]` (1 if absent; `scaled`)."""
    jobs = tuple(scaled(j, ratios.get(j.job_id, 1.0)) for j in group.jobs)
    return alloc.Group(group.cap_w, jobs, group.unprofiled,
                       group.idle_w if idle_w is None else idle_w)


def throughput_loss(group: alloc.Group, limits: Mapping[str, int]) -> float:
    """The group's throughput loss with each job at `limits[job]` (see the module)."""
    losses = []
    for job in group.jobs:
        by_limit = {o.limit_w: o for o in job.options}
        best = by_limit[job.optimum]
        at = by_limit[on_grid(limits[job.job_id], by_limit)]
        losses.append(max(0.0, 1.0 - best.time_s / at.time_s))
    return sum(losses) / len(losses) if losses else 0.0


def true_draw(group: alloc.Group, limits: Mapping[str, int]) -> float:
    """The group's draw on the true curves with each job at `limits[job]`."""
    total = group.idle_w
    for job in group.jobs:
        by_limit = {o.limit_w: o for o in job.options}
        total += job.gpus * by_limit[on_grid(limits[job.job_id], by_limit)].power_w
    return total


def on_grid(limit_w: int, by_limit: Mapping[int, object]) -> int:
    """The highest profiled limit at or under `limit_w` (the lowest if none is)."""
    under = [w for w in by_limit if w <= limit_w]
    return max(under) if under else min(by_limit)


def room_at(rounds: Sequence[tuple[float, str, float]],
            t_s: float) -> tuple[float, str, float] | None:
    """The owner's room at `t_s` from its statuses (time, replica, room W), and who it was.

    Returns (room W, replica, since when that replica published without another between),
    from the last status at or before `t_s`; None if none. The room is the cap less the
    tightener's backoff: what the allocation planned under when the limits were judged.
    """
    before = [r for r in rounds if r[0] <= t_s]
    if not before:
        return None
    t, replica, room = before[-1]
    since = t
    for at, who, _ in reversed(before):
        if who != replica:
            break
        since = at
    return room, replica, since


def job_loss(job: alloc.ProfiledJob, limit_w: int) -> float:
    """One job's throughput loss at `limit_w` (``1 - T_opt / T``, on its options' grid)."""
    by_limit = {o.limit_w: o for o in job.options}
    at = by_limit[on_grid(limit_w, by_limit)]
    return max(0.0, 1.0 - by_limit[job.optimum].time_s / at.time_s)


def per_job(group: alloc.Group, applied: Mapping[str, int], optimal: Mapping[str, int],
            uniform: Mapping[str, int]) -> dict[str, list[float]]:
    """Job by job: [limit applied, the optimum's, the uniform cut's (W), loss ours, optimum's].

    Where the group's loss against the optimum comes from (the bench's `per_job` key).
    """
    return {j.job_id: [applied[j.job_id], optimal[j.job_id], uniform[j.job_id],
                       round(job_loss(j, applied[j.job_id]), 4),
                       round(job_loss(j, optimal[j.job_id]), 4)] for j in group.jobs}


def loss_figures(ours: float, theirs: float, optimal: float) -> dict[str, object]:
    """Our throughput loss against the uniform cut's and the offline optimum's, as figures.

    `gap_to_optimal_pct`: how much more of the throughput the optimum keeps, in percent.
    `optimal_vs_uniform`: the offline optimum's loss over the uniform cut's, the least
    `loss_vs_uniform` any allocation reaches at this cap (reported next to ours).
    """
    gap = (optimal - ours) / (1.0 - optimal) * -100.0 if optimal < 1 else 0.0
    return {
        "loss": round(ours, 5),
        "uniform_loss": round(theirs, 5),
        "optimal_loss": round(optimal, 5),
        "loss_vs_uniform": round(ours / theirs, 4) if theirs > 0 else None,
        "optimal_vs_uniform": round(optimal / theirs, 4) if theirs > 0 else None,
        "gap_to_optimal_pct": round(gap, 3),
    }


def compare_losses(group: alloc.Group, applied: Mapping[str, int]) -> dict[str, object]:
    """Ours (the applied limits) against the uniform cut and the offline optimum."""
    uniform = alloc.uniform_cut(group)
    best = alloc.allocate(group)
    uniform_limits = {s.job_id: s.limit_w for s in uniform.shares}
    best_limits = {s.job_id: s.limit_w for s in best.shares}
    ours, theirs = throughput_loss(group, applied), throughput_loss(group, uniform_limits)
    optimal = throughput_loss(group, best_limits)
    return {
        **loss_figures(ours, theirs, optimal),
        "uniform_limit_w": max(uniform_limits.values(), default=None),
        "true_draw_w": round(true_draw(group, applied), 1),
        "uniform_true_draw_w": round(uniform.expected_w, 1),
        "optimal_true_draw_w": round(best.expected_w, 1),
        "cap_w": round(group.cap_w, 1),
        "per_job": per_job(group, applied, best_limits, uniform_limits),
    }


@dataclass(frozen=True, slots=True)
class SimPipeline:
    """A simulated Perseus job: its stage profile, shape and speed (`jobs.PerseusSpec`)."""

    name: str
    profile: str
    stages: int
    dp: int
    microbatches: int
    time_scale: float
    clocks: tuple[int, ...] = (1740, 1590, 1440, 1290, 1140, 990)
    step_w: int = 25


def pipeline_truth(p: SimPipeline) -> tuple[alloc.ProfiledJob, alloc.ProfiledJob]:
    """The pipeline job on the simulator's noiseless instructions (`instruction_cost`).

    Returns (its frontier, the way a budget moves it: the frontier planned on the true rows,
    chosen as Perseus chooses, then its slowest plan under each cap every `step_w` W; its
    chosen plan under each cap: what a uniform cut does to it). Under a cap every instruction
    runs as the simulator throttles it; a waiting GPU draws its idle power.
    """
    hw = PRESETS[instructions.preset_for(p.profile)]
    stages = instructions.stage_workloads(p.profile, p.stages)
    gpus, m, p_block = p.stages * p.dp, p.microbatches, hw.idle_power_w

    def profile_at(limit: float) -> planner.InstructionProfile:
        rows = []
        for s, kinds in enumerate(stages):
            for kind, wl in kinds.items():
                for clock in p.clocks:
                    t, e = instructions.instruction_cost(hw, wl, clock, power_limit_w=limit)
                    rows.append((s, kind, clock, t * p.time_scale, e * p.time_scale * p.dp))
        return planner.InstructionProfile.from_rows(rows)

    top = profile_at(hw.max_power_limit_w)
    frontier = planner.plan_frontier(top, m, num_stages=p.stages, p_block_w=p_block)
    all_max, _ = planner.evaluate(top, planner.max_frequency_plan(top, m), m, p_block)
    chosen = planner.choose(frontier, target_time=all_max * 0.99)
    limits = range(hw.max_power_limit_w, hw.min_power_limit_w - 1, -p.step_w)

    def under(plan: planner.Plan) -> list[alloc.Option]:
        out = []
        for limit in limits:
            t, e = planner.evaluate(profile_at(limit), plan, m, p_block)
            out.append(alloc.Option(-limit, t, e / t / gpus, limit))
        return out

    points = [alloc.Option(i, pt.time, pt.energy / pt.time / gpus, hw.max_power_limit_w)
              for i, pt in enumerate(frontier)]
    slowest = [o for o in under(frontier[-1].plan) if o.power_w < points[-1].power_w]
    best = frontier.index(chosen)
    low = hw.min_power_limit_w
    return (alloc.ProfiledJob(p.name, gpus, (*points, *slowest), best, low),
            alloc.ProfiledJob(p.name, gpus, tuple(under(chosen.plan)), -hw.max_power_limit_w,
                              low))


def compare_with_pipeline(group: alloc.Group, applied: Mapping[str, int],
                          pipeline: tuple[alloc.ProfiledJob, alloc.ProfiledJob],
                          slowdown: float) -> dict[str, object]:
    """`compare_losses` with a pipeline job in the group (its draw not in `group.idle_w`).

    Ours: the power-limit jobs at the limits applied, the pipeline job at its share's
    planned `slowdown`; the uniform cut: its chosen plan under the uniform limit; the offline
    optimum: its true frontier and slowest plan under caps (`pipeline_truth`).
    """
    moved, stays = pipeline
    uniform = alloc.uniform_cut(alloc.Group(group.cap_w, (*group.jobs, stays), (), group.idle_w))
    best = alloc.allocate(alloc.Group(group.cap_w, (*group.jobs, moved), (), group.idle_w))

    def mean_loss(dp: float, pipe: float) -> float:
        n = len(group.jobs)
        return (dp * n + pipe) / (n + 1)

    def pipe_loss(job: alloc.ProfiledJob, allocation: alloc.Allocation) -> float:
        share = allocation.by_job[job.job_id]
        return 1.0 - 1.0 / (1.0 + share.slowdown)

    dp_limits = {s.job_id: s.limit_w for s in uniform.shares if s.job_id != stays.job_id}
    best_limits = {s.job_id: s.limit_w for s in best.shares if s.job_id != moved.job_id}
    ours = mean_loss(throughput_loss(group, applied), 1.0 - 1.0 / (1.0 + slowdown))
    theirs = mean_loss(throughput_loss(group, dp_limits), pipe_loss(stays, uniform))
    optimal = mean_loss(throughput_loss(group, best_limits), pipe_loss(moved, best))
    return {
        **loss_figures(ours, theirs, optimal),
        "uniform_limit_w": max(s.limit_w for s in uniform.shares),
        "uniform_true_draw_w": round(uniform.expected_w, 1),
        "optimal_true_draw_w": round(best.expected_w, 1),
        "pipeline_uniform_slowdown": round(uniform.by_job[stays.job_id].slowdown, 4),
        "pipeline_optimal_slowdown": round(best.by_job[moved.job_id].slowdown, 4),
        "pipeline_optimal_point": best.by_job[moved.job_id].key,
        "dp_true_draw_w": round(true_draw(group, applied), 1),
        "cap_w": round(group.cap_w, 1),
        "per_job": per_job(group, applied, best_limits, dp_limits),
    }
