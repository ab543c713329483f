"""Perseus (SOSP '24) iteration time-energy frontier planner. Pure (numpy, scipy, numba).

Input: an instruction profile, the mean time and energy of one forward or backward instruction
of each pipeline stage at each locked SM clock (`InstructionProfile`). Output: the iteration
time T versus energy frontier over per-instruction clock choices of one synchronous 1F1B
iteration, each point with its plan (per stage, (instruction, MHz) in execution order).

Energy is counted as Perseus and lowtime 0.3.0 count it: every instruction's energy minus
`P_block` times its time (its "cost"), summed, plus `S * T * P_block`, where `P_block` is the
power of a GPU that waits (blocked on communication) and S the number of stages. Equivalently,
the GPUs' instruction energy plus `P_block` for every second a GPU is idle during the iteration.
Per instruction only the options that are Pareto-optimal in (time, cost) matter (measured time
is not always monotone in the clock).

Algorithm: an event-driven Phillips-Dessouky (PD) sweep over continuous durations. Each
instruction's cost is replaced by the lower convex hull of its Pareto options (a convex
piecewise-linear function of its duration); starting from every instruction at its cheapest
(slowest) option, each step finds the least-cost way to shorten the critical subgraph, a minimum s-t
cut with lower bounds (cut arcs are sped up at their left slope, arcs crossing back are slowed down
at their right slope; a slowdown that buys nothing loses ties), solved as one maximum flow started
from the last step's (`cut`: Dinic's algorithm, compiled), and applies it for as long as it stays
valid: until an instruction reaches a hull vertex or another path becomes critical (found exactly by
a few longest-path passes; each instruction's place on its hull is redone only when it moved). For
convex piecewise-linear costs this traces the optimum of the continuous relaxation; unlike lowtime
0.3.0 there is no time quantum (lowtime shortens by one quantum per step) and no fitted cost model
(lowtime fits an exponential). Real plans are taken from the sweep: after every step and wherever a
moving instruction passes one of its options, the durations are rounded to real options (each
instruction takes its slowest option at least as fast as planned; as further candidates, the next
slower one, and mixes where an instruction takes the slower one when it is at least 3/4, 1/2 or 1/4
of the way there), evaluated on the profile (critical path and the formula above), and the
Pareto-optimal candidates get their off-critical slack reclaimed (in topological order every
instruction takes its slowest option that keeps the iteration time). The frontier keeps the
Pareto-optimal plans, at most one per `unit_time` of iteration time.

The discrete problem is NP-hard; this is a heuristic on top of an exact relaxation. On the
Perseus artifact's profiles its energies are at or below lowtime 0.3.0's plans evaluated the
same way (bench/perseus_planner.py); on tiny adversarial chains it can be a few percent above
the exact discrete frontier (tests/core/test_frontier_planner.py).

The pieces: `profile` (the input), `dag` (the iteration's DAG), `graph` (longest-path passes),
`cut` (one step's least-cost cut), `points` (a plan's cost, the all-max plan, the choice),
`kernels` (the per-step loops compiled with numba: ~4 ms a step as Python loops and small numpy
calls, ~1 ms now, the plans the same bit for bit), `kernels_flow` (the max flow's), and
`kernels_plans` (rounding, deduplicating and timing plans); this module runs the sweep
(`plan_frontier`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from coordinator.pipeline.planner.cut import CutNetwork
from coordinator.pipeline.planner.dag import PipelineDAG, PipelineSchedule
from coordinator.pipeline.planner.graph import Graph, OptionTable
from coordinator.pipeline.planner.lazy import lazy_module
from coordinator.pipeline.planner.learned import node_kind
from coordinator.pipeline.planner.points import FrontierPoint, schedule_dag
from coordinator.pipeline.planner.profile import DEFAULT_P_BLOCK_W, InstructionProfile

if TYPE_CHECKING:
    from coordinator.pipeline.planner import kernels, kernels_plans
else:  # (numba loaded at the first plan: `lazy`)
    kernels = lazy_module("coordinator.pipeline.planner.kernels")
    kernels_plans = lazy_module("coordinator.pipeline.planner.kernels_plans")

__all__ = ["PlannerStats", "plan_frontier"]


@dataclass
class PlannerStats:
    """What one `plan_frontier` run did (for benchmarks and tests)."""

    iterations: int = 0
    longest_path_passes: int = 0
    candidates: int = 0
    stopped: str = ""
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class _Kinds:
    """Per (stage, instruction) options, padded to rectangular arrays."""

    keys: list[tuple[int, str]]
    freqs: np.ndarray  # [K, P] int, Pareto options ascending in time
    times: np.ndarray  # [K, P] float, +inf padding
    costs: np.ndarray  # [K, P] float
    hull_t: np.ndarray  # [K, H] hull vertex times ascending, +inf padding
    hull_n: np.ndarray  # [K] vertices per kind
    slope: np.ndarray  # [K, H] slope of segment j (vertex j to j+1): cost saved per second


def _pareto(
    rows: Sequence[tuple[int, float, float]], p_block: float
) -> list[tuple[float, float, int]]:
    """(time, cost, MHz) of the options not dominated in (time, cost), ascending in time."""
    opts = sorted((t, e - p_block * t, -f) for f, t, e in rows)  # ties: the highest clock first
    out: list[tuple[float, float, int]] = []
    for t, c, nf in opts:
        if out and c >= out[-1][1]:
            continue  # No cheaper than a faster (or equally fast) option.
        if out and t == out[-1][0]:
            continue
        out.append((t, c, -nf))
    return out


def _lower_hull(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the lower convex hull of points sorted by ascending x (decreasing y)."""
    hull: list[int] = []
    for i, (x, y) in enumerate(points):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = points[hull[-2]], points[hull[-1]]
            # Drop the middle point if it is on or above the segment from hull[-2] to i.
            if (y2 - y1) * (x - x1) >= (y - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _build_kinds(profile: InstructionProfile, p_block: float) -> _Kinds:
    keys = sorted(profile.entries)
    pareto = [_pareto(profile.entries[k], p_block) for k in keys]
    hulls = [_lower_hull([(t, c) for t, c, _ in opts]) for opts in pareto]
    n_k = len(keys)
    width = max(len(o) for o in pareto)
    h_width = max(len(h) for h in hulls)
    freqs = np.zeros((n_k, width), dtype=np.int64)
    times = np.full((n_k, width), np.inf)
    costs = np.full((n_k, width), np.inf)
    hull_t = np.full((n_k, h_width + 1), np.inf)
    hull_n = np.zeros(n_k, dtype=np.int64)
    slope = np.zeros((n_k, h_width + 1))
    for k, (opts, hull) in enumerate(zip(pareto, hulls, strict=True)):
        for j, (t, c, f) in enumerate(opts):
            times[k, j], costs[k, j], freqs[k, j] = t, c, f
        hull_n[k] = len(hull)
        for j, i in enumerate(hull):
            hull_t[k, j] = opts[i][0]
        for j in range(len(hull) - 1):
            a, b = opts[hull[j]], opts[hull[j + 1]]
            slope[k, j] = (a[1] - b[1]) / (b[0] - a[0])
    return _Kinds(keys, freqs, times, costs, hull_t, hull_n, slope)



def _pareto_indices(times: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """Indices of the points no faster-or-as-fast point beats on energy, fastest first.

    (Ties in time: the least energy first, then the first recorded.)
    """
    order = np.lexsort((energies, times))
    ordered = energies[order]
    before = np.empty_like(ordered)  # the least energy of every point ahead in the order
    if ordered.size:
        before[0] = np.inf
        np.minimum.accumulate(ordered[:-1], out=before[1:])
    return order[ordered < before]


@dataclass
class _Ops:
    """Each DAG node's options and cost hull (its kind's rows of `_Kinds`)."""

    kind: np.ndarray  # [n] index into `_Kinds`
    times: np.ndarray  # [n, P]
    costs: np.ndarray  # [n, P]
    hull: np.ndarray  # [n, H]
    hull_n: np.ndarray  # [n]
    slope: np.ndarray  # [n, H]
    rows: np.ndarray  # arange(n)
    eps_t: float = 0.0
    """Criticality and snapping tolerance (s)."""

    @classmethod
    def of(cls, kinds: _Kinds, kind: np.ndarray) -> _Ops:
        """Gather the kinds' arrays by node."""
        return cls(kind, kinds.times[kind], kinds.costs[kind], kinds.hull_t[kind],
                   kinds.hull_n[kind], kinds.slope[kind], np.arange(kind.size))



class _OnHull:
    """Every operation's place on its cost hull: kept, and redone only for those that move.

    An operation's place (the hull vertices strictly faster than it and those at least as
    fast, within the tolerance) and its slopes there (`ub`: the cost of speeding it up, inf
    at its fastest; `lb`: the saving of slowing it down, 0 at its slowest) depend on its own
    duration only, which a step changes for the operations it moves.
    """

    def __init__(self, ops: _Ops, dur: np.ndarray) -> None:
        self.ops = ops
        n = dur.size
        self.below = np.zeros(n, dtype=np.int64)
        self.upto = np.zeros(n, dtype=np.int64)
        self.ub = np.zeros(n)
        self.lb = np.zeros(n)
        self.update(dur, ops.rows)

    def update(self, dur: np.ndarray, moved: np.ndarray) -> None:
        """Place the operations `moved` anew (at durations `dur`)."""
        ops = self.ops
        kernels.place(ops.hull, ops.hull_n, ops.slope, dur, moved, ops.eps_t, self.below,
                      self.upto, self.ub, self.lb)


THRESHOLDS = (0.75, 0.5, 0.25)
"""A rounded operation's fraction of the way to its slower option from which it is rounded up,
in the mixed plans recorded beside the all-faster and all-slower ones."""

PRUNE_EVERY = 4096
"""Candidates recorded between two prunings of the dominated ones (bounds the memory)."""


_TAUS = np.array(THRESHOLDS)


class _Candidates:
    """Plans met along the sweep, rounded to real options; timed and reclaimed at the end.

    Every `PRUNE_EVERY` candidates, those recorded so far are timed and the dominated ones
    dropped: a dominated candidate never reaches the frontier, so the result is the same and
    the memory stays bounded (a plan is 2 bytes per instruction). Candidates are kept in
    arrays (the first `size` rows of `time`, `energy`, `plan`); a plan met again is not
    recorded twice: every plan recorded has its 128-bit key (`kernels_plans.plan_key`) in a
    compiled hash set.
    """

    def __init__(self, ops: _Ops, graph: Graph, stages: int, p_block_w: float) -> None:
        self.ops, self.graph = ops, graph
        self.stages, self.p_block_w = stages, p_block_w
        n, width = ops.rows.size, ops.times.shape[1]
        self._time = np.empty(256)
        self._energy = np.empty(256)
        """The plan's cost until timed (`settled`), then its energy."""
        self._plan = np.empty((256, n), dtype=np.int16)
        self.size = 0
        """Candidates kept."""
        self.settled = 0
        """Candidates before this index are timed, their energies final."""
        self.count = 0
        """Candidates recorded in all."""
        self.table = OptionTable(ops.kind, ops.times)
        """Rounding by table: an operation's slowest option at least as fast as x."""
        self.row_start = ops.rows * width
        """Each operation's first option in the flattened option arrays."""
        self.flat_times, self.flat_costs = ops.times.ravel(), ops.costs.ravel()
        self.zobrist = kernels_plans.zobrist_tables(n, width)
        self.memo = kernels_plans.memo(self.zobrist)
        """Each operation's last rounding (`kernels_plans.Memo`: only changes are redone)."""
        self._keys = np.zeros((1024, 2), dtype=np.uint64)
        self._used = np.zeros(1024, dtype=bool)
        self._keys_held = 0
        """The keys of every plan recorded (a hash set, at most half full)."""

    @property
    def time(self) -> np.ndarray:
        """Each candidate's iteration time (nan: not timed yet)."""
        return self._time[: self.size]

    @property
    def energy(self) -> np.ndarray:
        """Each candidate's energy (its cost alone until settled)."""
        return self._energy[: self.size]

    @property
    def plan(self) -> np.ndarray:
        """Each candidate's plan: option indices [size, n] (int16)."""
        return self._plan[: self.size]

    def _room(self, keys: int) -> None:
        """Room in the hash set of keys for `keys` more (it stays at most half full)."""
        while 2 * (self._keys_held + keys) > self._used.size:
            self._keys, self._used = kernels_plans.grow(self._keys, self._used)

    def _fresh(self, keys: np.ndarray) -> np.ndarray:
        """Which plans (by key, [k, 2]) were never recorded; they are from now on."""
        self._room(keys.shape[0])
        fresh = kernels_plans.remember(self._keys, self._used, keys)
        self._keys_held += int(np.count_nonzero(fresh))
        return fresh

    def _append(self, plans: np.ndarray, times: np.ndarray, energies: np.ndarray) -> None:
        """Keep rows `plans` as candidates (times nan: to be timed), after the others."""
        end = self.size + plans.shape[0]
        if end > self._time.size:
            room = max(end, 2 * self._time.size)
            self._time = np.resize(self._time, room)
            self._energy = np.resize(self._energy, room)
            self._plan = np.resize(self._plan, (room, plans.shape[1]))
        self._time[self.size : end] = times
        self._energy[self.size : end] = energies
        self._plan[self.size : end] = plans
        self.size = end

    def _add(self, plan: np.ndarray, time: float, energy: float) -> bool:
        """Keep `plan` (option indices, int16) as a candidate unless it was recorded before."""
        key = kernels_plans.plan_key(self.zobrist, plan)
        if not self._fresh(key[None, :])[0]:
            return False
        self._append(plan[None, :], np.array([time]), np.array([energy]))
        return True

    def record(self, dur: np.ndarray, horizon: float) -> None:
        """Round `dur` to real options (never slower) and keep the plan as a candidate."""
        self.record_many(dur[None, :], [horizon])

    def record_many(self, durs: np.ndarray, horizons: Sequence[float] | np.ndarray) -> None:
        """`record` each row of `durs` ([count, n]), in order, rounded all at once.

        A plan's iteration time is its `horizons` entry when no operation was rounded, else
        its longest path, computed for thousands of plans at once when they are settled.
        """
        ops, table = self.ops, self.table
        self._room(durs.shape[0] * (_TAUS.size + 2))
        plans, times, costs = kernels_plans.round_plans(
            durs, np.asarray(horizons, dtype=float), ops.eps_t, table.ladder, table.below,
            ops.kind, self.flat_times, self.flat_costs, ops.times.shape[1], _TAUS,
            self.zobrist, self.memo, self._keys, self._used)
        self._keys_held += plans.shape[0]
        self._append(plans, times, costs)
        self.count += plans.shape[0]
        if self.size - self.settled >= PRUNE_EVERY:
            self._prune()

    def _settle(self) -> None:
        """Time the candidates recorded since the last call and add their blocking energy."""
        lo, hi = self.settled, self.size
        pending = lo + np.flatnonzero(np.isnan(self._time[lo:hi]))
        if pending.size:
            self._time[pending] = self.graph.plan_times(self._plan[pending], self.flat_times,
                                                        self.ops.times.shape[1])
        self._energy[lo:hi] += self.stages * self._time[lo:hi] * self.p_block_w
        self.settled = hi

    def _prune(self) -> None:
        """Keep only the candidates no other one dominates (in their order)."""
        self._settle()
        keep = np.sort(_pareto_indices(self.time, self.energy))
        count = keep.size
        # (Those kept last time mostly stay where they are: rows move from the first change.)
        first = int(np.argmin(keep == np.arange(count))) if count else 0
        if count and keep[first] != first:
            moving = keep[first:]
            self._time[first:count] = self._time[moving]
            self._energy[first:count] = self._energy[moving]
            self._plan[first:count] = self._plan[moving]
        self.size = self.settled = count

    def finish(self) -> None:
        """Time the last candidates, then reclaim the slack of the Pareto-optimal ones."""
        ops, stages, p_block_w = self.ops, self.stages, self.p_block_w
        self._settle()
        # Rounding to real options leaves slack off the critical path: reclaim it on the
        # Pareto-optimal candidates (a plan's time never grows, its energy never does).
        pareto = _pareto_indices(self.time, self.energy)
        for lo in range(0, pareto.size, 512):
            chunk = pareto[lo : lo + 512]
            choices = self._plan[chunk].T.astype(np.int64)
            new, times = self.graph.reclaim_many(choices, ops.times, ops.eps_t)
            costs = ops.costs[ops.rows[:, None], new].sum(axis=0)
            energy = costs + stages * times * p_block_w
            better = energy < self._energy[chunk]
            where = chunk[better]
            self._time[where] = times[better]
            self._energy[where] = energy[better]
            self._plan[where] = new[:, better].T.astype(np.int16)

    def kept(self, resolution: float) -> list[int]:
        """The Pareto-optimal candidates, at most one per `resolution` of time (0: all)."""
        kept = _pareto_indices(self.time, self.energy).tolist()
        if not (resolution > 0 and kept):
            return kept
        times = self.time.tolist()
        first = times[kept[0]]
        thinned: list[int] = []
        last_cell = -1
        for i in kept:
            cell = math.ceil((times[i] - first) / resolution - 1e-9)
            if thinned and cell == last_cell:
                thinned[-1] = i
            else:
                thinned.append(i)
            last_cell = cell
        return thinned


def _check(num_microbatches: int, p_block_w: float, unit_time: float | None) -> None:
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not (math.isfinite(p_block_w) and p_block_w >= 0):
        raise ValueError(f"p_block_w must be >= 0, got {p_block_w}")
    if unit_time is not None and not (math.isfinite(unit_time) and unit_time >= 0):
        raise ValueError(f"unit_time must be >= 0, got {unit_time}")


def plan_frontier(
    profile: InstructionProfile,
    num_microbatches: int,
    num_stages: int | None = None,
    p_block_w: float = DEFAULT_P_BLOCK_W,
    unit_time: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    stats: PlannerStats | None = None,
    schedule: PipelineSchedule | None = None,
) -> list[FrontierPoint]:
    """The iteration time-energy frontier of a pipeline schedule over per-instruction clocks.

    Args:
        profile: The instruction profile: rows for every (stage, action kind) the schedule
            runs ("forward" and "backward" for 1F1B).
        num_microbatches: Microbatches M per iteration.
        num_stages: Pipeline stages S (default: the schedule's, else the profile's; a
            one-stage profile is used for every stage).
        p_block_w: Power of a waiting GPU (W).
        unit_time: Time resolution (s): at most one point per `unit_time` of iteration time is
            kept (the least energy one at or below each multiple of it above the fastest).
            Default: 1/2000 of the fastest iteration time (0.05%); 0 keeps every point found.
        progress: Called with (done, total) as the sweep goes from the slowest to the fastest
            iteration time (total is 1000).
        stats: Filled in with what the run did.
        schedule: The iteration's schedule (`dag.PipelineSchedule`, e.g. a
            `learned.LearnedSchedule`); default synchronous 1F1B of S stages and M microbatches.

    Returns:
        Frontier points, fastest first, energies strictly decreasing. The first one's time is
        the critical path with every instruction at its fastest profiled option. A plan's rows
        are each stage's instruction names (the schedule's) in execution order with clocks.

    Raises:
        ValueError: Bad arguments, a schedule that cannot be built, or a profile that lacks an
            action kind of a stage.
    """
    _check(num_microbatches, p_block_w, unit_time)
    default = profile.num_stages if schedule is None else schedule.num_stages
    stages = default if num_stages is None else num_stages
    if stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {stages}")
    profile = profile.for_stages(stages)
    stats = stats if stats is not None else PlannerStats()
    dag = schedule_dag(stages, num_microbatches, schedule)
    keys = [(node.stage, node_kind(node)) for node in dag.nodes]
    for (stage, kind_name), node in zip(keys, dag.nodes, strict=True):
        if (stage, kind_name) not in profile.entries:
            raise ValueError(f"the profile has no {kind_name} rows for stage {stage} "
                             f"({node.instruction})")
    kinds = _build_kinds(profile, p_block_w)
    kind_index = {key: k for k, key in enumerate(kinds.keys)}
    kind = np.array([kind_index[key] for key in keys], dtype=np.int64)
    graph = Graph(dag)
    ops = _Ops.of(kinds, kind)
    fastest = ops.hull[:, 0].copy()
    t_min = float(graph.forward(fastest).max())
    t_max = float(graph.forward(ops.hull[ops.rows, ops.hull_n - 1]).max())
    ops.eps_t = 1e-9 * max(t_max, 1e-12)
    candidates = _Candidates(ops, graph, stages, p_block_w)
    _sweep(graph, ops, candidates, (t_min, t_max), progress, stats)
    if progress is not None:
        progress(1000, 1000)
    stats.longest_path_passes = graph.passes
    stats.candidates = candidates.count
    candidates.finish()
    resolution = t_min / 2000 if unit_time is None else unit_time
    return _points(dag, kinds, kind, candidates, candidates.kept(resolution))


def _points(dag: PipelineDAG, kinds: _Kinds, kind: np.ndarray, candidates: _Candidates,
            kept: list[int]) -> list[FrontierPoint]:
    """The kept candidates as frontier points, each plan per stage in execution order."""
    points: list[FrontierPoint] = []
    names = [[dag.nodes[v].instruction for v in ids] for ids in dag.stage_nodes]
    stage_ids = [np.array(ids, dtype=np.int64) for ids in dag.stage_nodes]
    for i in kept:
        freqs = kinds.freqs[kind, candidates.plan[i]]
        plan = tuple(
            tuple(zip(row_names, freqs[ids].tolist(), strict=True))
            for row_names, ids in zip(names, stage_ids, strict=True)
        )
        points.append(FrontierPoint(float(candidates.time[i]), float(candidates.energy[i]), plan))
    return points


def _sweep(graph: Graph, ops: _Ops, candidates: _Candidates, span_t: tuple[float, float],
           progress: Callable[[int, int], None] | None, stats: PlannerStats) -> None:
    """The Phillips-Dessouky sweep from every operation at its slowest to the fastest time.

    (`stats.extra`: how the steps' max flows started, `CutNetwork.starts`.)
    """
    n = graph.n
    dur = ops.hull[ops.rows, ops.hull_n - 1].copy()
    fin_all = graph.forward(dur)
    candidates.record(dur, float(fin_all[:n].max()))
    max_iterations = 50 * n * int(ops.hull_n.max()) + 1000
    network = CutNetwork(graph)
    on_hull = _OnHull(ops, dur)
    try:
        _steps(graph, network, ops, on_hull, candidates, dur, fin_all, span_t, progress, stats,
               max_iterations)
    finally:
        for key, count in zip(("flows_from_zero", "flows_carried", "flows_rebalanced"),
                              network.starts, strict=True):
            stats.extra[key] = count


def _steps(graph: Graph, network: CutNetwork, ops: _Ops, on_hull: _OnHull,
           candidates: _Candidates, dur: np.ndarray, fin_all: np.ndarray,
           span_t: tuple[float, float], progress: Callable[[int, int], None] | None,
           stats: PlannerStats, max_iterations: int) -> None:
    """The sweep's steps (`_sweep`), until the fastest time or a stop."""
    n = graph.n
    t_min, t_max = span_t
    eps_t = ops.eps_t
    span = max(t_max - t_min, 1e-300)
    last_report = -1
    stats.stopped = "converged"
    for _ in range(max_iterations):
        fin = fin_all[:n]
        horizon = float(fin.max())
        if horizon <= t_min + eps_t:
            return
        if progress is not None:
            done = min(1000, int(1000 * (t_max - horizon) / span))
            if done != last_report:
                progress(done, 1000)
                last_report = done
        move = _cut_step(graph, network, ops, on_hull, dur, fin, horizon)
        stats.iterations += 1
        if isinstance(move, str):
            stats.stopped = move
            return
        sp_ops, sl_ops, step = move
        rate = np.zeros(n)
        rate[sp_ops] = -1.0
        rate[sl_ops] = 1.0
        moved = np.concatenate([sp_ops, sl_ops])
        trial, fin_all, step = _shrink(graph, ops, dur, rate, moved, horizon, step)
        if step <= 0:
            stats.stopped = "no progress"
            return
        # Plans on the way: wherever a moving operation passes one of its (Pareto) options.
        durs = kernels.on_the_way(dur, trial, rate, ops.times, sp_ops, sl_ops, step, eps_t)
        dur = trial
        on_hull.update(dur, moved)
        horizons = np.full(durs.shape[0], math.nan)
        horizons[-1] = fin_all[:n].max()
        candidates.record_many(durs, horizons)
    stats.stopped = "iteration limit"


def _cut_step(graph: Graph, network: CutNetwork, ops: _Ops, on_hull: _OnHull, dur: np.ndarray,
              fin: np.ndarray, horizon: float) -> tuple[np.ndarray, np.ndarray, float] | str:
    """One sweep step: (operations sped up, slowed down, longest step on the hulls).

    Or why the sweep stops (a string).
    """
    latest_start = graph.backward(dur, horizon)
    crit_ops, prec, src, sink = kernels.critical(latest_start, dur, fin, horizon, ops.eps_t,
                                                 graph.eu, graph.ev, network.src_ops)
    ub, lb = on_hull.ub[crit_ops], on_hull.lb[crit_ops]
    side = network.min_cut(crit_ops, ub, lb, prec, src, sink)
    if side is None:
        return "no finite cut"
    sp_ops, sl_ops, step = kernels.cut_moves(side, crit_ops, ub, lb, dur, ops.hull,
                                             on_hull.below, on_hull.upto)
    if math.isnan(step):
        return "no speed-up"
    return sp_ops, sl_ops, float(step)


def _shrink(graph: Graph, ops: _Ops, dur: np.ndarray, rate: np.ndarray, moved: np.ndarray,
            horizon: float, step: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Shrink the step until no other path outgrows the shortened critical ones.

    Returns the durations after the step, their finish times and the step (`kernels.shrink`:
    each try snaps the moved operations within rounding above a hull vertex onto it, only ever
    downwards, so a snapped operation never lengthens a path).
    """
    trial, fin, step, passes = kernels.shrink(graph.preds, graph.topo, ops.hull, dur, rate,
                                              moved, horizon, step, ops.eps_t)
    graph.passes += passes
    return trial, fin, float(step)
