"""The iteration DAG as flat lists and numpy arrays, for fast longest-path passes. Pure.

The frontier planner (`coordinator.pipeline.planner.frontier`) runs thousands of forward
(earliest finish) and backward (latest start) passes over one DAG; `Graph` lays the DAG out
once so that each pass is a tight loop, or one numpy operation per topological level over
many duration vectors at once. (For one vector the loop is as fast as numpy by level: 8 x 96
1F1B has 206 levels of 7 nodes, and each numpy call costs about what 7 loop turns do; no
compiled routine here computes a longest path exactly: scipy's Bellman-Ford takes 30 ms.)
"""

from __future__ import annotations

import numpy as np

from coordinator.pipeline.planner.dag import PipelineDAG

__all__ = ["Graph", "OptionTable"]


class OptionTable:
    """Every operation's options counted by time, for rounding many durations at once.

    `ladder` holds every option time of every kind, ascending; `below[k, r]` counts kind k's
    options among the first r of them. So the options of operation v's kind at most x long
    number `below[kind[v], searchsorted(ladder, x, "right")]` (x on an option: counted).
    """

    def __init__(self, kind: np.ndarray, times: np.ndarray) -> None:
        kinds, first = np.unique(kind, return_index=True)
        kind_times = times[first]
        self.kind, self.times = kind, times
        self.ladder = np.unique(kind_times[np.isfinite(kind_times)])
        self.below = np.zeros((int(kinds.max()) + 1, self.ladder.size + 1), dtype=np.int64)
        for k, row in zip(kinds.tolist(), kind_times, strict=True):
            self.below[k, 1:] = np.searchsorted(row, self.ladder, side="right")

    def fitting(self, nodes: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """How many of each node's options take at most `limit` (rows: `nodes`)."""
        rank = np.searchsorted(self.ladder, limit, side="right")
        return self.below[self.kind[nodes].reshape((-1,) + (1,) * (limit.ndim - 1)), rank]


class Graph:
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
        if self.width == 2:
            for nodes, preds, _ in self.levels:
                fin[nodes] = np.maximum(fin[preds[:, 0]], fin[preds[:, 1]]) + durations[nodes]
        else:
            for nodes, preds, _ in self.levels:
                fin[nodes] = fin[preds].max(axis=1) + durations[nodes]
        return fin[: self.n].max(axis=0)

    def reclaim_many(
        self, choices: np.ndarray, op_times: np.ndarray, tol: float, options: OptionTable
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slow operations down into their slack, for many plans at once.

        `choices` is [n, count] option indices into `op_times` ([n, P], ascending; `options`
        counts them by time). Each plan keeps its iteration time: a backward pass gives every
        operation's latest finish, then in topological order every operation takes its slowest
        option that still finishes by then (starting after its predecessors' new finish
        times). Returns the new choices and iteration times.
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
            pick = np.maximum(options.fitting(nodes, room) - 1, choices[nodes])
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

    def path_rate(self, fin: list[float], rate: list[float], end: int) -> float:
        """The summed `rate` along the longest path to `end` that `forward` finishes found.

        Walking back from `end`, each operation's predecessor on it is its first (in index
        order) that finishes last; `rate` holds small integers, so the sum is exact in any
        order.
        """
        total = 0.0
        n = self.n
        v = end
        while v != n:
            total += rate[v]
            row = self.pad_preds[v]
            best = row[0]
            for u in row[1:]:
                if fin[u] > fin[best]:
                    best = u
            v = best
        return total
