"""The iteration DAG as padded index arrays, for fast longest-path passes. Pure.

The frontier planner (`coordinator.pipeline.planner.frontier`) runs thousands of forward
(earliest finish) and backward (latest start) passes over one DAG; `Graph` lays the DAG out
once as arrays (every node's predecessors and successors padded to one width, a topological
order) that the compiled loops of `coordinator.pipeline.planner.kernels` walk: one pass over
8 x 96 1F1B's 1,536 operations takes microseconds, where a Python loop took ~0.3 ms and numpy
by topological level no less (206 levels of 7 nodes; scipy has no exact DAG longest path).
The plain Python and by-level versions stay in `tests/core/planner_reference_kit.py`, and the
planner's plans are theirs bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from coordinator.pipeline.planner.dag import PipelineDAG
from coordinator.pipeline.planner.lazy import lazy_module

if TYPE_CHECKING:
    from coordinator.pipeline.planner import kernels, kernels_plans
else:  # (numba loaded at the first plan: `lazy`)
    kernels = lazy_module("coordinator.pipeline.planner.kernels")
    kernels_plans = lazy_module("coordinator.pipeline.planner.kernels_plans")

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
    """The DAG as padded index arrays for the compiled longest-path passes.

    Every node's predecessors (`preds`) and successors (`succs`) are padded to the same count
    with a sentinel node `n` whose finish time is 0 (whose latest start is the horizon).
    """

    def __init__(self, dag: PipelineDAG) -> None:
        self.dag = dag
        n = self.n = len(dag.nodes)
        width_p = max(1, max((len(p) for p in dag.preds), default=1))
        width_s = max(1, max((len(s) for s in dag.succs), default=1))
        self.width = max(width_p, width_s)
        self.preds = np.array([list(p) + [n] * (self.width - len(p)) for p in dag.preds],
                              dtype=np.int64).reshape(n, self.width)
        self.succs = np.array([list(s) + [n] * (self.width - len(s)) for s in dag.succs],
                              dtype=np.int64).reshape(n, self.width)
        self.topo = np.array(dag.topo_order, dtype=np.int64)
        edges = list(dag.edges())
        self.eu = np.array([u for u, _ in edges], dtype=np.int64)
        self.ev = np.array([v for _, v in edges], dtype=np.int64)
        self.has_pred = np.array([bool(p) for p in dag.preds])
        self.passes = 0

    def forward(self, d: np.ndarray) -> np.ndarray:
        """Earliest finish times (index n is the sentinel)."""
        self.passes += 1
        return kernels.forward(self.preds, self.topo, d)

    def backward(self, d: np.ndarray, horizon: float) -> np.ndarray:
        """Latest start times for the iteration to end by `horizon` (index n: the horizon)."""
        self.passes += 1
        return kernels.backward(self.succs, self.topo, d, horizon)

    def path_rate(self, fin: np.ndarray, rate: np.ndarray, end: int) -> float:
        """The summed `rate` along the longest path to `end` that `forward` finishes found.

        Walking back from `end`, each operation's predecessor on it is its first (in index
        order) that finishes last; `rate` holds small integers, so the sum is exact in any
        order.
        """
        return float(kernels.path_rate(self.preds, fin, rate, end))

    def plan_times(self, plans: np.ndarray, flat_times: np.ndarray, width: int) -> np.ndarray:
        """Iteration times of plans (rows of option indices).

        Node v's option p takes `flat_times[v * width + p]`.
        """
        return kernels_plans.plan_times(self.preds, self.topo, plans, flat_times, width)

    def reclaim_many(
        self, choices: np.ndarray, op_times: np.ndarray, tol: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slow operations down into their slack, for many plans at once.

        `choices` is [n, count] option indices into `op_times` ([n, P], ascending in time,
        +inf padding). Each plan keeps its iteration time: a backward pass gives every
        operation's latest finish, then in topological order every operation takes its slowest
        option that still finishes by then (starting after its predecessors' new finish
        times). Returns the new choices and iteration times.
        """
        return kernels.reclaim(self.preds, self.succs, self.topo, choices, op_times, tol)
