"""Perseus (SOSP '24) iteration time-energy frontier planner. Pure (numpy and scipy only).

Input: an instruction profile, the mean time and energy of one forward or backward instruction
of each pipeline stage at each locked SM clock (Zeus 0.16's `InstructionProfilingResult` CSV or
lowtime 0.3.0's `stage,instruction,frequency,time,energy`). Output: the iteration time T versus
energy frontier over per-instruction clock choices of one synchronous 1F1B iteration, each point
with its plan (per stage, (instruction, MHz) in execution order).

Energy is counted as Perseus and lowtime 0.3.0 count it: every instruction's energy minus
`P_block` times its time (its "cost"), summed, plus `S * T * P_block`, where `P_block` is the
power of a GPU that waits (blocked on communication) and S the number of stages. Equivalently,
the GPUs' instruction energy plus `P_block` for every second a GPU is idle during the iteration.
Per instruction only the options that are Pareto-optimal in (time, cost) matter (measured time
is not always monotone in the clock).

Algorithm: an event-driven Phillips-Dessouky (PD) sweep over continuous durations. Each
instruction's cost is replaced by the lower convex hull of its Pareto options (a convex
piecewise-linear function of its duration); starting from every instruction at its cheapest
(slowest) option, each step finds the least-cost way to shorten the critical subgraph, a minimum
s-t cut with lower bounds (cut arcs are sped up at their left slope, arcs crossing back are
slowed down at their right slope), solved as one maximum flow (`scipy.sparse.csgraph`), and
applies it for as long as it stays valid: until an instruction reaches a hull vertex or another
path becomes critical (found exactly by a few longest-path passes). For convex piecewise-linear
costs this traces the optimum of the continuous relaxation; unlike lowtime 0.3.0 there is no
time quantum (lowtime shortens by one quantum per step) and no fitted cost model (lowtime fits
an exponential). Real plans are taken from the sweep: after every step and wherever a moving
instruction passes one of its options, the durations are rounded to real options (each
instruction takes its slowest option at least as fast as planned, and also, as a second
candidate, the next slower one), evaluated on the profile (critical path and the formula
above), and the Pareto-optimal candidates get their off-critical slack reclaimed (in
topological order every instruction takes its slowest option that keeps the iteration time).
The frontier keeps the Pareto-optimal plans, at most one per `unit_time` of iteration time.

The discrete problem is NP-hard; this is a heuristic on top of an exact relaxation. On the
Perseus artifact's profiles its energies are at or below lowtime 0.3.0's plans evaluated the
same way (bench/perseus_planner.py); on tiny adversarial chains it can be a few percent above
the exact discrete frontier (tests/core/test_frontier_planner.py).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from coordinator.pipeline.dag import PipelineDAG, Synchronous1F1B, build_dag

__all__ = [
    "DEFAULT_P_BLOCK_W",
    "FrontierPoint",
    "InstructionProfile",
    "PlannerStats",
    "choose",
    "evaluate",
    "load_profile",
    "max_frequency_plan",
    "plan_frontier",
]

DEFAULT_P_BLOCK_W = 83.64
"""Blocking power of a waiting GPU (W): the A100 figure of the Perseus artifact."""

Plan = tuple[tuple[tuple[str, int], ...], ...]
"""Per stage, (instruction, MHz) pairs in execution order."""

_ZEUS_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstructionProfile:
    """Time and energy of each (stage, instruction) at each SM clock.

    Attributes:
        entries: (stage, instruction) -> ((MHz, seconds, joules), ...), fastest clock first.
            Rows of several ranks of one stage (data or tensor parallel) are merged: the time is
            the slowest rank's (a stage's instruction ends when all its ranks finish) and the
            energy the ranks' mean (the energy formula counts one GPU per stage).
    """

    entries: Mapping[tuple[int, str], tuple[tuple[int, float, float], ...]]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any] | Sequence[Any]]) -> InstructionProfile:
        """Build a profile from rows.

        A row is a mapping with keys stage, instruction, frequency, time, energy (other keys,
        such as Zeus's rank columns, are ignored) or a (stage, instruction, frequency, time,
        energy) sequence.

        Raises:
            ValueError: A malformed row, a non-positive or non-finite time, a negative or
                non-finite energy, stages not numbered 0 to S-1, or no rows.
        """
        merged: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for n, row in enumerate(rows):
            try:
                if isinstance(row, Mapping):
                    values = [row[c] for c in _COLUMNS]
                else:
                    values = list(row)
                    if len(values) != len(_COLUMNS):
                        raise ValueError(f"{len(values)} fields, need {len(_COLUMNS)}")
                stage = int(values[0])
                name = str(values[1]).strip()
                freq = int(float(values[2]))
                if float(values[2]) != freq:
                    raise ValueError(f"frequency {values[2]!r} is not a whole number of MHz")
                time, energy = float(values[3]), float(values[4])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"profile row {n}: {e!r}") from None
            if stage < 0 or not name or freq <= 0:
                raise ValueError(f"profile row {n}: bad stage, instruction or frequency")
            if not (math.isfinite(time) and time > 0):
                raise ValueError(f"profile row {n}: time must be positive, got {time}")
            if not (math.isfinite(energy) and energy >= 0):
                raise ValueError(f"profile row {n}: energy must be >= 0, got {energy}")
            merged.setdefault((stage, name, freq), []).append((time, energy))
        if not merged:
            raise ValueError("the profile has no rows")
        entries: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
        for (stage, name, freq), values in merged.items():
            time = max(t for t, _ in values)
            energy = sum(e for _, e in values) / len(values)
            entries.setdefault((stage, name), []).append((freq, time, energy))
        stages = sorted({stage for stage, _ in entries})
        if stages != list(range(len(stages))):
            raise ValueError(f"profile stages must be numbered 0 to S-1, got {stages}")
        return cls(
            {key: tuple(sorted(rows_, reverse=True)) for key, rows_ in sorted(entries.items())}
        )

    @property
    def num_stages(self) -> int:
        """Stages in the profile."""
        return 1 + max(stage for stage, _ in self.entries)

    def instructions(self, stage: int) -> list[str]:
        """The instruction names profiled for `stage`."""
        return sorted(name for s, name in self.entries if s == stage)

    def lookup(self, stage: int, instruction: str, frequency: int) -> tuple[float, float]:
        """(time, energy) of one instruction at one clock.

        Raises:
            KeyError: Not in the profile.
        """
        for freq, time, energy in self.entries[(stage, instruction)]:
            if freq == frequency:
                return time, energy
        raise KeyError(f"stage {stage} {instruction} was not profiled at {frequency} MHz")

    def for_stages(self, num_stages: int) -> InstructionProfile:
        """This profile for `num_stages` stages (a one-stage profile is copied to every stage).

        Raises:
            ValueError: The profile has another number of stages (and not one).
        """
        if num_stages == self.num_stages:
            return self
        if self.num_stages != 1:
            raise ValueError(
                f"the profile has {self.num_stages} stages, not {num_stages} (only a one-stage "
                "profile can be used for any number of stages)"
            )
        return InstructionProfile(
            {(s, name): rows for s in range(num_stages) for (_, name), rows in self.entries.items()}
        )


def load_profile(path: str | os.PathLike[str]) -> InstructionProfile:
    """Read an instruction profile CSV.

    Accepts Zeus 0.16's `InstructionProfilingResult` columns (`rank,dp_rank,pp_rank,tp_rank,
    stage,instruction,frequency,time,energy`) and lowtime 0.3.0's (`stage,instruction,
    frequency,time,energy`), in any column order.

    Raises:
        ValueError: A missing column or a bad row (see `InstructionProfile.from_rows`).
        OSError: The file cannot be read.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [c.strip() for c in reader.fieldnames or ()]
        missing = [c for c in _COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{os.fspath(path)}: missing column(s) {', '.join(missing)} (need "
                f"{','.join(_COLUMNS)}, optionally after {','.join(_ZEUS_COLUMNS)})"
            )
        reader.fieldnames = header
        try:
            return InstructionProfile.from_rows(list(reader))
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the frontier: iteration time (s), energy (J) and its plan."""

    time: float
    energy: float
    plan: Plan


def _schedule_dag(num_stages: int, num_microbatches: int) -> PipelineDAG:
    return build_dag(Synchronous1F1B(num_stages, num_microbatches))


def evaluate(
    profile: InstructionProfile,
    plan: Sequence[Sequence[tuple[str, int]]],
    num_microbatches: int,
    p_block_w: float = DEFAULT_P_BLOCK_W,
) -> tuple[float, float]:
    """(iteration time, energy) of `plan` on the profile's rows.

    The time is the 1F1B critical path with every instruction taking its profiled time at its
    planned clock; the energy is the sum of instruction energies plus `p_block_w` for every
    second a stage's GPU waits: sum(e - P_block * t) + S * T * P_block.

    Raises:
        ValueError: The plan's rows do not follow the 1F1B order of `num_microbatches`.
        KeyError: A clock the profile has no row for.
    """
    num_stages = len(plan)
    dag = _schedule_dag(num_stages, num_microbatches)
    profile = profile.for_stages(num_stages)
    durations = [0.0] * len(dag.nodes)
    busy_energy = busy_time = 0.0
    for stage, ids in enumerate(dag.stage_nodes):
        row = plan[stage]
        if len(row) != len(ids):
            raise ValueError(
                f"plan stage {stage} has {len(row)} instructions, the 1F1B order "
                f"{len(ids)}"
            )
        for (name, freq), v in zip(row, ids, strict=True):
            if name != dag.nodes[v].instruction:
                raise ValueError(
                    f"plan stage {stage} runs {name!r} where 1F1B runs "
                    f"{dag.nodes[v].instruction!r}"
                )
            time, energy = profile.lookup(stage, name, int(freq))
            durations[v] = time
            busy_energy += energy
            busy_time += time
    iteration_time = dag.longest_path(durations)
    energy = busy_energy + p_block_w * (num_stages * iteration_time - busy_time)
    return iteration_time, energy


def max_frequency_plan(profile: InstructionProfile, num_microbatches: int) -> Plan:
    """Every instruction at the highest profiled clock of its (stage, instruction)."""
    dag = _schedule_dag(profile.num_stages, num_microbatches)
    return tuple(
        tuple(
            (dag.nodes[v].instruction, profile.entries[(s, dag.nodes[v].instruction)][0][0])
            for v in ids
        )
        for s, ids in enumerate(dag.stage_nodes)
    )


def choose(
    frontier: Sequence[FrontierPoint],
    *,
    target_time: float | None = None,
    max_slowdown: float | None = None,
    eta_knob: float | None = None,
    all_max_time: float | None = None,
    max_power_w: float | None = None,
) -> FrontierPoint:
    """Pick one point of a frontier (fastest first, energies decreasing).

    * `target_time`: the least energy with T <= target_time (the fastest point if none is).
    * `max_slowdown`: the least energy with T <= (1 + max_slowdown) * reference, where the
      reference is `all_max_time` (T with every clock at its maximum, see `max_frequency_plan`
      and `evaluate`) or, without it, the fastest point's T.
    * `eta_knob`: the least ZeusCost-style `eta * E + (1 - eta) * max_power_w * T`;
      `max_power_w` defaults to the highest average power E / T on the frontier.
    * None of them: no slowdown, the least energy with T <= `all_max_time` (the fastest point
      without `all_max_time`).

    Raises:
        ValueError: An empty frontier, more than one criterion, or one out of range.
    """
    if not frontier:
        raise ValueError("empty frontier")
    given = [x is not None for x in (target_time, max_slowdown, eta_knob)]
    if sum(given) > 1:
        raise ValueError("give at most one of target_time, max_slowdown, eta_knob")
    if eta_knob is not None:
        if not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"eta_knob must be in [0, 1], got {eta_knob}")
        power = max_power_w if max_power_w is not None else max(p.energy / p.time for p in frontier)
        return min(frontier, key=lambda p: eta_knob * p.energy + (1 - eta_knob) * power * p.time)
    reference = all_max_time if all_max_time is not None else frontier[0].time
    if max_slowdown is not None:
        if max_slowdown < 0:
            raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
        limit = (1.0 + max_slowdown) * reference
    elif target_time is not None:
        limit = target_time
    else:
        limit = reference
    feasible = [p for p in frontier if p.time <= limit * (1 + 1e-12)]
    if not feasible:
        return frontier[0]
    return min(feasible, key=lambda p: (p.energy, p.time))


# --------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------


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


class _Graph:
    """The DAG as flat lists and numpy arrays for fast longest-path passes.

    Every node's predecessors (and successors) are padded to the same count with a sentinel
    node `n` whose finish time is 0 (whose latest start is the horizon); with at most two
    (1F1B) the passes use a specialised loop.
    """

    def __init__(self, dag: PipelineDAG) -> None:
        self.dag = dag
        n = self.n = len(dag.nodes)
        width_p = max(1, max((len(p) for p in dag.preds), default=1))
        width_s = max(1, max((len(s) for s in dag.succs), default=1))
        self.width = max(width_p, width_s)
        self.pad_preds = [list(p) + [n] * (self.width - len(p)) for p in dag.preds]
        self.pad_succs = [list(s) + [n] * (self.width - len(s)) for s in dag.succs]
        topo = list(dag.topo_order)
        self.fwd_rows = [(v, *self.pad_preds[v]) for v in topo]
        self.bwd_rows = [(v, *self.pad_succs[v]) for v in reversed(topo)]
        edges = list(dag.edges())
        self.eu = np.array([u for u, _ in edges], dtype=np.int64)
        self.ev = np.array([v for _, v in edges], dtype=np.int64)
        self.has_pred = np.array([bool(p) for p in dag.preds])
        self.passes = 0
        # Topological levels, for passes vectorised over many duration vectors at once.
        level = [0] * n
        for v in topo:
            level[v] = 1 + max((level[u] for u in dag.preds[v]), default=-1)
        by_level: dict[int, list[int]] = {}
        for v in range(n):
            by_level.setdefault(level[v], []).append(v)
        self.levels = [
            (
                np.array(vs, dtype=np.int64),
                np.array([self.pad_preds[v] for v in vs], dtype=np.int64),
                np.array([self.pad_succs[v] for v in vs], dtype=np.int64),
            )
            for _, vs in sorted(by_level.items())
        ]

    def longest_many(self, durations: np.ndarray) -> np.ndarray:
        """Iteration times of many duration vectors at once (`durations` is [n, count])."""
        fin = np.zeros((self.n + 1, durations.shape[1]))
        for nodes, preds, _ in self.levels:
            fin[nodes] = fin[preds].max(axis=1) + durations[nodes]
        return fin[: self.n].max(axis=0)

    def reclaim_many(
        self, choices: np.ndarray, op_times: np.ndarray, tol: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slow operations down into their slack, for many plans at once.

        `choices` is [n, count] option indices into `op_times` ([n, P], ascending). Each plan
        keeps its iteration time: a backward pass gives every operation's latest finish, then
        in topological order every operation takes its slowest option that still finishes by
        then (starting after its predecessors' new finish times). Returns the new choices and
        iteration times.
        """
        n, count = choices.shape
        rows = np.arange(n)[:, None]
        dur = op_times[rows, choices]
        fin = np.zeros((n + 1, count))
        for nodes, preds, _ in self.levels:
            fin[nodes] = fin[preds].max(axis=1) + dur[nodes]
        horizon = fin[:n].max(axis=0)
        latest_start = np.empty((n + 1, count))
        latest_start[n] = horizon
        latest_finish = np.empty((n, count))
        for nodes, _, succs in reversed(self.levels):
            latest_finish[nodes] = latest_start[succs].min(axis=1)
            latest_start[nodes] = latest_finish[nodes] - dur[nodes]
        new = choices.copy()
        fin[:] = 0.0
        for nodes, preds, _ in self.levels:
            start = fin[preds].max(axis=1)  # [L, count]
            room = latest_finish[nodes] - start + tol
            fits = (op_times[nodes][:, None, :] <= room[:, :, None]).sum(axis=2) - 1
            pick = np.maximum(fits, choices[nodes])
            new[nodes] = pick
            fin[nodes] = start + op_times[nodes[:, None], pick]
        return new, fin[:n].max(axis=0)

    def forward(self, d: list[float]) -> list[float]:
        """Earliest finish times (index n is the sentinel)."""
        self.passes += 1
        fin = [0.0] * (self.n + 1)
        if self.width == 2:
            for v, a, b in self.fwd_rows:
                x = fin[a]
                y = fin[b]
                fin[v] = (x if x > y else y) + d[v]
        else:
            for row in self.fwd_rows:
                fin[row[0]] = max(fin[u] for u in row[1:]) + d[row[0]]
        return fin

    def backward(self, d: list[float], horizon: float) -> list[float]:
        """Latest start times for the iteration to end by `horizon` (index n: the horizon)."""
        self.passes += 1
        ls = [horizon] * (self.n + 1)
        if self.width == 2:
            for v, a, b in self.bwd_rows:
                x = ls[a]
                y = ls[b]
                ls[v] = (x if x < y else y) - d[v]
        else:
            for row in self.bwd_rows:
                ls[row[0]] = min(ls[w] for w in row[1:]) - d[row[0]]
        return ls

    def forward_tracked(
        self, d: list[float], rate: list[float]
    ) -> tuple[list[float], float, float]:
        """(finish times, length, summed rate along it) of a longest path."""
        self.passes += 1
        n = self.n
        fin = [0.0] * (n + 1)
        acc = [0.0] * (n + 1)
        if self.width == 2:
            for v, a, b in self.fwd_rows:
                x = fin[a]
                y = fin[b]
                if x >= y:
                    fin[v] = x + d[v]
                    acc[v] = acc[a] + rate[v]
                else:
                    fin[v] = y + d[v]
                    acc[v] = acc[b] + rate[v]
        else:
            for row in self.fwd_rows:
                v = row[0]
                u = max(row[1:], key=fin.__getitem__)
                fin[v] = fin[u] + d[v]
                acc[v] = acc[u] + rate[v]
        best = max(range(n), key=fin.__getitem__)
        return fin, fin[best], acc[best]


_INF_CAP = 1 << 28
"""An uncuttable arc's capacity in the integer max-flow (scipy's flows are 32-bit)."""


class _CutNetwork:
    """The flow network of the least-cost cut, with a fixed arc layout.

    Node i is operation i's start, n + i its end, 2n the source, 2n + 1 the sink. Arcs (and, with
    capacity 0, their reverses): each operation's arc i -> n + i; each dependency u -> v as
    n + u -> v; source -> i for operations without predecessors; n + i -> sink for every
    operation; and per operation the two arcs source -> n + i and i -> sink that carry its lower
    bound. One iteration only fills in capacities (0 for arcs off the critical subgraph), so the
    CSR layout is computed once.

    The cut with lower bounds (forward operation arcs count ub, backward ones -lb) is found with
    one max flow: operation arcs get capacity ub - lb and each operation's lb is moved onto its
    source and sink arcs (every cut's value shifts by the sum of the lbs).
    """

    def __init__(self, graph: _Graph) -> None:
        n = self.n = graph.n
        s, t = 2 * n, 2 * n + 1
        ops = np.arange(n)
        self.src_ops = np.flatnonzero(~graph.has_pred)
        e = graph.eu.size
        rows = np.concatenate(
            [ops, graph.eu + n, np.full(self.src_ops.size, s), ops + n, np.full(n, s), ops]
        )
        cols = np.concatenate(
            [ops + n, graph.ev, self.src_ops, np.full(n, t), ops + n, np.full(n, t)]
        )
        # Offsets of each arc group in the capacity vector.
        self.o_prec = n
        self.o_src = n + e
        self.o_sink = self.o_src + self.src_ops.size
        self.o_lbs = self.o_sink + n
        self.o_lbt = self.o_lbs + n
        self.arcs = rows.size
        size = self.size = 2 * n + 2
        all_rows = np.concatenate([rows, cols])
        all_cols = np.concatenate([cols, rows])
        order = np.argsort(all_rows * size + all_cols, kind="stable")
        key = (all_rows * size + all_cols)[order]
        if np.any(key[1:] == key[:-1]):
            raise AssertionError("duplicate arcs in the cut network")
        self.order = order
        self.indices = all_cols[order].astype(np.int32)
        self.indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(np.bincount(all_rows, minlength=size), out=self.indptr[1:])
        self.row_of = np.repeat(np.arange(size), np.diff(self.indptr))
        self.caps = np.zeros(2 * rows.size, dtype=np.int64)

    def min_cut(
        self,
        crit_ops: np.ndarray,
        ub: np.ndarray,
        lb: np.ndarray,
        prec: np.ndarray,
        src: np.ndarray,
        sink: np.ndarray,
    ) -> np.ndarray | None:
        """Source side of a least-cost cut of the critical subgraph, or None if none is finite.

        Args:
            crit_ops: The critical operations.
            ub: Their cost of being sped up (inf: they cannot be).
            lb: Their saving from being slowed down (0: they cannot be).
            prec: Mask over dependencies: on the critical subgraph.
            src: Mask over `src_ops`: critical and starting at 0.
            sink: Mask over operations: critical and ending the iteration.
        """
        n = self.n
        finite_ub = np.isfinite(ub)
        finite_vals = np.concatenate([(ub - lb)[finite_ub], lb])
        biggest = float(finite_vals.max()) if finite_vals.size else 0.0
        n_finite = max(1, finite_vals.size)
        cap_max = max(1, min(1 << 20, (_INF_CAP // 4) // n_finite))
        scale = cap_max / biggest if biggest > 0 else 1.0
        caps = self.caps
        caps[:] = 0
        caps[crit_ops] = np.where(finite_ub, np.rint((ub - lb) * scale), _INF_CAP)
        caps[self.o_prec : self.o_src][prec] = _INF_CAP
        caps[self.o_src : self.o_sink][src] = _INF_CAP
        caps[self.o_sink : self.o_lbs][sink] = _INF_CAP
        lb_cap = np.rint(lb * scale).astype(np.int64)
        caps[self.o_lbs + crit_ops] = lb_cap
        caps[self.o_lbt + crit_ops] = lb_cap
        data = caps[self.order].astype(np.int32)
        size = self.size
        graph = sp.csr_array((data, self.indices, self.indptr), shape=(size, size))
        result = maximum_flow(graph, 2 * n, 2 * n + 1)
        if result.flow_value - int(lb_cap.sum()) >= _INF_CAP // 2:
            return None
        flow = result.flow
        if flow.nnz == data.size and np.array_equal(flow.indices, self.indices):
            open_arc = (data - flow.data) > 0
            indices, row_of = self.indices, self.row_of
        else:  # A scipy that lays the flow out differently: sparse arithmetic.
            diff = (graph - flow).tocsr()
            diff.sort_indices()
            open_arc = diff.data > 0
            indices = diff.indices
            row_of = np.repeat(np.arange(size), np.diff(diff.indptr))
        open_indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(np.bincount(row_of[open_arc], minlength=size), out=open_indptr[1:])
        residual = sp.csr_array(
            (np.ones(int(open_arc.sum()), dtype=np.int8), indices[open_arc], open_indptr),
            shape=(size, size),
        )
        reached = breadth_first_order(residual, 2 * n, directed=True, return_predecessors=False)
        side = np.zeros(size, dtype=bool)
        side[reached] = True
        if side[2 * n + 1]:
            return None
        return side


def _pareto_indices(times: Sequence[float], energies: Sequence[float]) -> list[int]:
    """Indices of the points no faster-or-as-fast point beats on energy, fastest first."""
    order = np.lexsort((np.asarray(energies), np.asarray(times)))
    kept: list[int] = []
    best = math.inf
    for i in order.tolist():
        if energies[i] < best:
            kept.append(i)
            best = energies[i]
    return kept


def plan_frontier(
    profile: InstructionProfile,
    num_microbatches: int,
    num_stages: int | None = None,
    p_block_w: float = DEFAULT_P_BLOCK_W,
    unit_time: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    stats: PlannerStats | None = None,
) -> list[FrontierPoint]:
    """The iteration time-energy frontier of synchronous 1F1B over per-instruction clocks.

    Args:
        profile: The instruction profile (every stage needs "forward" and "backward" rows).
        num_microbatches: Microbatches M per iteration.
        num_stages: Pipeline stages S (default: the profile's; a one-stage profile is used for
            every stage).
        p_block_w: Power of a waiting GPU (W).
        unit_time: Time resolution (s): at most one point per `unit_time` of iteration time is
            kept (the least energy one at or below each multiple of it above the fastest).
            Default: 1/2000 of the fastest iteration time (0.05%); 0 keeps every point found.
        progress: Called with (done, total) as the sweep goes from the slowest to the fastest
            iteration time (total is 1000).
        stats: Filled in with what the run did.

    Returns:
        Frontier points, fastest first, energies strictly decreasing. The first one's time is
        the critical path with every instruction at its fastest profiled option.

    Raises:
        ValueError: Bad arguments or a profile that lacks an instruction of a stage.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not (math.isfinite(p_block_w) and p_block_w >= 0):
        raise ValueError(f"p_block_w must be >= 0, got {p_block_w}")
    if unit_time is not None and not (math.isfinite(unit_time) and unit_time >= 0):
        raise ValueError(f"unit_time must be >= 0, got {unit_time}")
    stages = profile.num_stages if num_stages is None else num_stages
    if stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {stages}")
    profile = profile.for_stages(stages)
    stats = stats if stats is not None else PlannerStats()
    dag = _schedule_dag(stages, num_microbatches)
    for node in dag.nodes:
        if (node.stage, node.instruction) not in profile.entries:
            raise ValueError(f"the profile has no {node.instruction} rows for stage {node.stage}")
    kinds = _build_kinds(profile, p_block_w)
    kind_index = {key: k for k, key in enumerate(kinds.keys)}
    kind = np.array([kind_index[(nd.stage, nd.instruction)] for nd in dag.nodes], dtype=np.int64)
    graph = _Graph(dag)
    n = graph.n

    op_times = kinds.times[kind]  # [n, P]
    op_costs = kinds.costs[kind]
    op_hull = kinds.hull_t[kind]  # [n, H]
    op_hull_n = kinds.hull_n[kind]
    op_slope = kinds.slope[kind]
    rows_n = np.arange(n)
    fastest = op_hull[:, 0].copy()
    slowest = op_hull[rows_n, op_hull_n - 1].copy()

    t_min = max(graph.forward(fastest.tolist()))
    t_max = max(graph.forward(slowest.tolist()))
    eps_t = 1e-9 * max(t_max, 1e-12)  # Criticality and snapping tolerance.

    cand_time: list[float] = []
    cand_energy: list[float] = []
    cand_plan: list[np.ndarray] = []

    def record(dur: np.ndarray, horizon: float) -> None:
        """Round `dur` to real options (never slower) and keep the plan as a candidate.

        Its iteration time is computed later, for all candidates at once (`horizon` when no
        operation was rounded).
        """
        choice = (op_times <= dur[:, None] + eps_t).sum(axis=1) - 1
        between = op_times[rows_n, choice] != dur
        cand_time.append(math.nan if between.any() else horizon)
        cand_energy.append(float(op_costs[rows_n, choice].sum()))
        cand_plan.append(choice.astype(np.int16))
        if between.any():  # Also the plan rounded the other way (a bit slower, cheaper).
            slower = choice.copy()
            slower[between] += 1
            cand_time.append(math.nan)
            cand_energy.append(float(op_costs[rows_n, slower].sum()))
            cand_plan.append(slower.astype(np.int16))

    def snap(values: np.ndarray, moved: np.ndarray) -> np.ndarray:
        """`values` with the moved operations within rounding of a hull vertex put on it."""
        # Only ever downwards: a snapped operation never lengthens a path.
        near = op_hull[moved]
        gap = values[moved][:, None] - near
        gap[(gap < 0) | (gap > eps_t)] = np.inf
        j = gap.argmin(axis=1)
        close = np.isfinite(gap[np.arange(moved.size), j])
        values[moved[close]] = near[np.arange(moved.size), j][close]
        return values

    dur = slowest.copy()
    fin_list = graph.forward(dur.tolist())
    record(dur, max(fin_list[:n]))
    max_iterations = 50 * n * int(op_hull_n.max()) + 1000
    span = max(t_max - t_min, 1e-300)
    last_report = -1
    stats.stopped = "converged"
    eu, ev = graph.eu, graph.ev
    network = _CutNetwork(graph)
    for _ in range(max_iterations):
        fin = np.array(fin_list[:n])
        horizon = float(fin.max())
        if horizon <= t_min + eps_t:
            break
        if progress is not None:
            done = min(1000, int(1000 * (t_max - horizon) / span))
            if done != last_report:
                progress(done, 1000)
                last_report = done
        d_list = dur.tolist()
        latest_start = np.array(graph.backward(d_list, horizon)[:n])
        start = fin - dur
        crit = (latest_start - start) <= eps_t
        crit_ops = np.flatnonzero(crit)
        prec = crit[eu] & crit[ev] & (start[ev] - fin[eu] <= eps_t)
        src_mask = crit & (start <= eps_t)
        sink_mask = crit & (fin >= horizon - eps_t)
        # Positions of the critical operations on their cost hulls.
        cd = dur[crit_ops]
        ch = op_hull[crit_ops]
        below = (ch < (cd - eps_t)[:, None]).sum(axis=1)  # vertices strictly faster
        upto = (ch <= (cd + eps_t)[:, None]).sum(axis=1)  # vertices at least as fast
        nh = op_hull_n[crit_ops]
        cs = op_slope[crit_ops]
        idx = np.arange(crit_ops.size)
        ub = np.where(below >= 1, cs[idx, np.maximum(below - 1, 0)], np.inf)
        lb = np.where(upto <= nh - 1, cs[idx, np.minimum(upto - 1, nh - 1)], 0.0)
        side = network.min_cut(crit_ops, ub, lb, prec, src_mask[network.src_ops], sink_mask)
        stats.iterations += 1
        if side is None:
            stats.stopped = "no finite cut"
            break
        speed = side[crit_ops] & ~side[crit_ops + n]
        slow = ~side[crit_ops] & side[crit_ops + n] & (lb > 0)
        if not speed.any() or not np.isfinite(ub[speed]).all():
            stats.stopped = "no speed-up"
            break
        sp_ops, sl_ops = crit_ops[speed], crit_ops[slow]
        step = float(np.min(dur[sp_ops] - ch[speed, below[speed] - 1]))
        if sl_ops.size:
            step = min(step, float(np.min(ch[slow, upto[slow]] - dur[sl_ops])))
        rate = np.zeros(n)
        rate[sp_ops] = -1.0
        rate[sl_ops] = 1.0
        rate_list = rate.tolist()
        moved = np.concatenate([sp_ops, sl_ops])
        # Shrink the step until no other path outgrows the shortened critical ones.
        for _ in range(1000):
            trial = snap(dur + step * rate, moved)
            fin_list, length, acc = graph.forward_tracked(trial.tolist(), rate_list)
            if length <= horizon - step + eps_t or acc <= -1.0:
                break  # (A path that shortens as fast as the iteration: rounding only.)
            shorter = (horizon - (length - step * acc)) / (acc + 1.0)
            if not shorter < step:
                break
            step = shorter
        if step <= 0:
            stats.stopped = "no progress"
            break
        # Plans on the way: wherever a moving operation passes one of its (Pareto) options.
        lo_t, hi_t = eps_t, step - eps_t
        passes = np.concatenate(
            [
                (dur[sp_ops][:, None] - op_times[sp_ops]).ravel(),
                (op_times[sl_ops] - dur[sl_ops][:, None]).ravel(),
            ]
        )
        passes = np.unique(passes[(passes > lo_t) & (passes < hi_t)])
        for k in passes.tolist():
            record(dur + k * rate, math.nan)
        dur = trial
        record(dur, max(fin_list[:n]))
    else:
        stats.stopped = "iteration limit"
    if progress is not None:
        progress(1000, 1000)
    stats.longest_path_passes = graph.passes
    stats.candidates = len(cand_time)
    pending = [i for i, t in enumerate(cand_time) if math.isnan(t)]
    for lo in range(0, len(pending), 256):
        chunk = pending[lo : lo + 256]
        choices = np.stack([cand_plan[i] for i in chunk], axis=1).astype(np.int64)  # [n, c]
        times = graph.longest_many(op_times[rows_n[:, None], choices])
        for i, t in zip(chunk, times.tolist(), strict=True):
            cand_time[i] = t
    cand_energy = [
        e + stages * t * p_block_w for e, t in zip(cand_energy, cand_time, strict=True)
    ]
    # Rounding to real options leaves slack off the critical path: reclaim it on the
    # Pareto-optimal candidates (a plan's time never grows, its energy never does).
    pareto = _pareto_indices(cand_time, cand_energy)
    for lo in range(0, len(pareto), 128):
        chunk = pareto[lo : lo + 128]
        choices = np.stack([cand_plan[i] for i in chunk], axis=1).astype(np.int64)
        new, times = graph.reclaim_many(choices, op_times, eps_t)
        costs = op_costs[rows_n[:, None], new].sum(axis=0)
        for j, i in enumerate(chunk):
            energy = float(costs[j]) + stages * float(times[j]) * p_block_w
            if energy < cand_energy[i]:
                cand_time[i], cand_energy[i] = float(times[j]), energy
                cand_plan[i] = new[:, j].astype(np.int16)

    # Pareto filter, then at most one point per unit_time.
    kept = _pareto_indices(cand_time, cand_energy)
    resolution = t_min / 2000 if unit_time is None else unit_time
    if resolution > 0 and kept:
        first = cand_time[kept[0]]
        thinned: list[int] = []
        last_cell = -1
        for i in kept:
            cell = math.ceil((cand_time[i] - first) / resolution - 1e-9)
            if thinned and cell == last_cell:
                thinned[-1] = i
            else:
                thinned.append(i)
            last_cell = cell
        kept = thinned
    points: list[FrontierPoint] = []
    names = [[dag.nodes[v].instruction for v in ids] for ids in dag.stage_nodes]
    stage_ids = [np.array(ids, dtype=np.int64) for ids in dag.stage_nodes]
    for i in kept:
        freqs = kinds.freqs[kind, cand_plan[i]]
        plan = tuple(
            tuple(zip(row_names, freqs[ids].tolist(), strict=True))
            for row_names, ids in zip(names, stage_ids, strict=True)
        )
        points.append(FrontierPoint(cand_time[i], cand_energy[i], plan))
    return points
