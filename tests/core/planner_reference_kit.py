"""The frontier planner's pieces written plainly, as they were before they were made fast.

Each stands in for a faster one with the same answers (`tests/core/test_frontier_fast_paths.py`
patches them in and compares the frontiers bit for bit): rounding one plan at a time,
placing every operation on its hull at every step, counting fitting options by comparing
every option, summing a longest path's rate in a tracked forward pass, longest paths as
Python loops or numpy by topological level, reclaiming slack by level, a step's shrinking,
snapping and plans on the way in numpy, and a sweep step's critical subgraph and cut in numpy
(with `CutNetwork.compiled` off, scipy's max flow) instead of the compiled kernels
(`coordinator.pipeline.planner.kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coordinator.pipeline.planner import frontier
from coordinator.pipeline.planner.cut import INF_CAP, CutNetwork
from coordinator.pipeline.planner.graph import Graph, OptionTable


def record_one_by_one(self: frontier._Candidates, durs: np.ndarray,
                      horizons: Sequence[float]) -> None:
    """`_Candidates.record_many` as one `record` per row, each rounded on its own."""
    for dur, horizon in zip(durs, horizons, strict=True):
        ops = self.ops
        before = len(self.time)
        choice = self.table.fitting(ops.rows, dur + ops.eps_t) - 1
        at = self.row_start + choice
        between = np.flatnonzero(self.flat_times[at] != dur)
        energy = float(self.flat_costs[at].sum())
        self._add(choice.astype(np.int16), math.nan if between.size else horizon, energy)
        if between.size:
            _record_slower(self, dur, choice, between, energy)
        self.count += len(self.time) - before
        if len(self.time) - self.settled >= frontier.PRUNE_EVERY:
            self._prune()


def _record_slower(self: frontier._Candidates, dur: np.ndarray, choice: np.ndarray,
                   between: np.ndarray, energy: float) -> None:
    """The plan rounded the other way and the mixes between, one mask at a time."""
    last = self.ops.times.shape[1] - 1
    slower = np.minimum(choice[between] + 1, last)
    moving = slower != choice[between]
    ops_moved, slower = between[moving], slower[moving]
    low_at = self.row_start[ops_moved] + choice[ops_moved]
    high_at = self.row_start[ops_moved] + slower
    extra = self.flat_costs[high_at] - self.flat_costs[low_at]
    masks = [np.ones(ops_moved.size, dtype=bool)]
    if ops_moved.size > 1:
        low, high = self.flat_times[low_at], self.flat_times[high_at]
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(np.isfinite(high), (dur[ops_moved] - low) / (high - low), 0.0)
        masks = [frac >= tau for tau in frontier.THRESHOLDS] + masks
    for mask in masks:
        if mask.any():
            plan = choice.copy()
            plan[ops_moved[mask]] = slower[mask]
            self._add(plan.astype(np.int16), math.nan, energy + float(extra[mask].sum()))


def place_everyone(self: frontier._OnHull, dur: np.ndarray, moved: np.ndarray) -> None:
    """`_OnHull.update` in numpy, placing every operation anew, whichever moved."""
    ops, eps_t, moved = self.ops, self.ops.eps_t, self.ops.rows
    cd = dur[moved]
    ch = ops.hull[moved]
    below = (ch < (cd - eps_t)[:, None]).sum(axis=1)  # vertices strictly faster
    upto = (ch <= (cd + eps_t)[:, None]).sum(axis=1)  # vertices at least as fast
    nh = ops.hull_n[moved]
    cs = ops.slope[moved]
    idx = np.arange(moved.size)
    self.ub[moved] = np.where(below >= 1, cs[idx, np.maximum(below - 1, 0)], np.inf)
    self.lb[moved] = np.where(upto <= nh - 1, cs[idx, np.minimum(upto - 1, nh - 1)], 0.0)
    self.below[moved] = below
    self.upto[moved] = upto


def snap(ops: frontier._Ops, values: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """`values` with the moved operations within rounding above a hull vertex put on it."""
    near = ops.hull[moved]
    gap = values[moved][:, None] - near
    gap[(gap < 0) | (gap > ops.eps_t)] = np.inf
    j = gap.argmin(axis=1)
    close = np.isfinite(gap[np.arange(moved.size), j])
    values[moved[close]] = near[np.arange(moved.size), j][close]
    return values


def shrink_in_numpy(graph: Graph, ops: frontier._Ops, dur: np.ndarray, rate: np.ndarray,
                    moved: np.ndarray, horizon: float,
                    step: float) -> tuple[np.ndarray, np.ndarray, float]:
    """`frontier._shrink` with numpy and the graph's passes (`kernels.shrink` compiled)."""
    eps_t = ops.eps_t
    trial = dur
    fin = np.zeros(0)
    for _ in range(1000):
        trial = snap(ops, dur + step * rate, moved)
        fin = graph.forward(trial)
        end = int(fin.argmax())
        length = float(fin[end])
        if length <= horizon - step + eps_t:
            break
        acc = graph.path_rate(fin, rate, end)
        if acc <= -1.0:
            break
        shorter = (horizon - (length - step * acc)) / (acc + 1.0)
        if not shorter < step:
            break
        step = shorter
    return trial, fin, step


def on_the_way_in_numpy(dur: np.ndarray, trial: np.ndarray, rate: np.ndarray,
                        times: np.ndarray, sp_ops: np.ndarray, sl_ops: np.ndarray, step: float,
                        eps_t: float) -> np.ndarray:
    """`kernels.on_the_way` in numpy."""
    passes = np.concatenate([
        (dur[sp_ops][:, None] - times[sp_ops]).ravel(),
        (times[sl_ops] - dur[sl_ops][:, None]).ravel(),
    ])
    passes = np.unique(passes[(passes > eps_t) & (passes < step - eps_t)])
    return np.vstack([dur + passes[:, None] * rate, trial])


def fitting_by_comparison(self: OptionTable, nodes: np.ndarray,
                          limit: np.ndarray) -> np.ndarray:
    """`OptionTable.fitting` comparing every option of every node with its limit."""
    times = self.times[nodes].reshape(nodes.shape + (1,) * (limit.ndim - 1) + (-1,))
    return (times <= limit[..., None]).sum(axis=-1)


def tracked_rate(self: Graph, fin: np.ndarray, rate: np.ndarray, end: int) -> float:
    """`Graph.path_rate` from a pass that carries every longest path's summed rate forward.

    As the sweep's forward pass did before: each operation extends the path of its first
    predecessor (in index order) that finishes last.
    """
    acc = [0.0] * (self.n + 1)
    for v in self.topo.tolist():
        row = self.preds[v].tolist()
        acc[v] = acc[max(row, key=fin.__getitem__)] + rate[v]
    return acc[end]


def forward_in_python(self: Graph, d: np.ndarray) -> np.ndarray:
    """`Graph.forward` as a Python loop."""
    self.passes += 1
    fin = [0.0] * (self.n + 1)
    durations = d.tolist()
    for v in self.topo.tolist():
        fin[v] = max(fin[u] for u in self.preds[v].tolist()) + durations[v]
    return np.array(fin)


def backward_in_python(self: Graph, d: np.ndarray, horizon: float) -> np.ndarray:
    """`Graph.backward` as a Python loop."""
    self.passes += 1
    ls = [horizon] * (self.n + 1)
    durations = d.tolist()
    for v in reversed(self.topo.tolist()):
        ls[v] = min(ls[w] for w in self.succs[v].tolist()) - durations[v]
    return np.array(ls)


def _levels(self: Graph) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each topological level's (nodes, padded predecessors, padded successors)."""
    level = [0] * self.n
    for v in self.topo.tolist():
        level[v] = 1 + max((level[u] for u in self.dag.preds[v]), default=-1)
    by_level: dict[int, list[int]] = {}
    for v in range(self.n):
        by_level.setdefault(level[v], []).append(v)
    return [(np.array(vs), self.preds[vs], self.succs[vs]) for _, vs in sorted(by_level.items())]


def plan_times_by_level(self: Graph, plans: np.ndarray, flat_times: np.ndarray,
                        width: int) -> np.ndarray:
    """`Graph.plan_times` with numpy, one topological level at a time over every plan."""
    durations = flat_times.take(plans + np.arange(self.n) * width).T
    fin = np.zeros((self.n + 1, durations.shape[1]))
    for nodes, preds, _ in _levels(self):
        fin[nodes] = fin[preds].max(axis=1) + durations[nodes]
    return fin[: self.n].max(axis=0)


def reclaim_by_level(self: Graph, choices: np.ndarray, op_times: np.ndarray,
                     tol: float) -> tuple[np.ndarray, np.ndarray]:
    """`Graph.reclaim_many` with numpy by level, fitting options counted by comparison."""
    n, count = choices.shape
    levels = _levels(self)
    dur = op_times[np.arange(n)[:, None], choices]
    fin = np.zeros((n + 1, count))
    for nodes, preds, _ in levels:
        fin[nodes] = fin[preds].max(axis=1) + dur[nodes]
    latest_start = np.empty((n + 1, count))
    latest_start[n] = fin[:n].max(axis=0)
    latest_finish = np.empty((n, count))
    for nodes, _, succs in reversed(levels):
        latest_finish[nodes] = latest_start[succs].min(axis=1)
        latest_start[nodes] = latest_finish[nodes] - dur[nodes]
    new = choices.copy()
    fin[:] = 0.0
    for nodes, preds, _ in levels:
        start = fin[preds].max(axis=1)
        room = latest_finish[nodes] - start + tol
        fitting = (op_times[nodes][:, None, :] <= room[..., None]).sum(axis=-1)
        pick = np.maximum(fitting - 1, choices[nodes])
        new[nodes] = pick
        fin[nodes] = start + op_times[nodes[:, None], pick]
    return new, fin[:n].max(axis=0)


def cut_step_in_numpy(graph: Graph, network: CutNetwork, ops: frontier._Ops,
                      on_hull: frontier._OnHull, dur: np.ndarray, fin: np.ndarray,
                      horizon: float) -> tuple[np.ndarray, np.ndarray, float] | str:
    """`frontier._cut_step` with numpy: the critical subgraph, the cut and its moves."""
    n, eps_t = graph.n, ops.eps_t
    latest_start = graph.backward(dur, horizon)[:n]
    start = fin - dur
    crit = (latest_start - start) <= eps_t
    crit_ops = np.flatnonzero(crit)
    eu, ev = graph.eu, graph.ev
    prec = crit[eu] & crit[ev] & (start[ev] - fin[eu] <= eps_t)
    src_mask = crit & (start <= eps_t)
    sink_mask = crit & (fin >= horizon - eps_t)
    ub, lb = on_hull.ub[crit_ops], on_hull.lb[crit_ops]
    side = min_cut_in_numpy(network, crit_ops, ub, lb, prec, src_mask[network.src_ops],
                            sink_mask)
    if side is None:
        return "no finite cut"
    speed = side[crit_ops] & ~side[crit_ops + n]
    slow = ~side[crit_ops] & side[crit_ops + n] & (lb > 0)
    if not speed.any() or not np.isfinite(ub[speed]).all():
        return "no speed-up"
    sp_ops, sl_ops = crit_ops[speed], crit_ops[slow]
    hull = ops.hull
    step = float(np.min(dur[sp_ops] - hull[sp_ops, on_hull.below[sp_ops] - 1]))
    if sl_ops.size:
        step = min(step, float(np.min(hull[sl_ops, on_hull.upto[sl_ops]] - dur[sl_ops])))
    return sp_ops, sl_ops, step


def min_cut_in_numpy(self: CutNetwork, crit_ops: np.ndarray, ub: np.ndarray, lb: np.ndarray,
                     prec: np.ndarray, src: np.ndarray, sink: np.ndarray) -> np.ndarray | None:
    """`CutNetwork.min_cut`'s capacities in numpy, its flow from zero (with `compiled` off,
    scipy's)."""
    finite_ub = np.isfinite(ub)
    finite_vals = np.concatenate([(ub - lb)[finite_ub], lb])
    biggest = float(finite_vals.max()) if finite_vals.size else 0.0
    cap_max = max(1, min(1 << 20, (INF_CAP // 4) // max(1, finite_vals.size)))
    scale = cap_max / biggest if biggest > 0 else 1.0
    lb_cap = np.maximum(np.rint(lb * scale).astype(np.int64) - 1, 0)
    ub_cap = np.rint(np.where(finite_ub, ub, 0.0) * scale).astype(np.int64)
    caps = np.zeros_like(self.caps)
    own = self.op_arcs[:, crit_ops]
    caps[own[0]] = np.where(finite_ub, ub_cap - lb_cap, INF_CAP)
    caps[own[1]] = lb_cap
    caps[own[2]] = lb_cap
    caps[self.edge_arcs[prec]] = INF_CAP
    caps[self.src_arcs[src]] = INF_CAP
    caps[self.sink_arcs[sink]] = INF_CAP
    residual = caps.copy()
    side = self._max_flow(residual)
    if int((caps - residual)[self.from_source].sum()) - int(lb_cap.sum()) >= INF_CAP // 2:
        return None
    return side
