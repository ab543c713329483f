"""The frontier planner's pieces written plainly, as they were before they were made fast.

Each stands in for a faster one with the same answers (`tests/core/test_frontier_fast_paths.py`
patches them in and compares the frontiers bit for bit): rounding one plan at a time,
placing every operation on its hull at every step, counting fitting options by comparing
every option, summing a longest path's rate in a tracked forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coordinator.pipeline.planner import frontier
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
    """`_OnHull.update` placing every operation anew, whichever moved."""
    ORIGINAL_PLACE(self, dur, self.ops.rows)


ORIGINAL_PLACE = frontier._OnHull.update


def fitting_by_comparison(self: OptionTable, nodes: np.ndarray,
                          limit: np.ndarray) -> np.ndarray:
    """`OptionTable.fitting` comparing every option of every node with its limit."""
    times = self.times[nodes].reshape(nodes.shape + (1,) * (limit.ndim - 1) + (-1,))
    return (times <= limit[..., None]).sum(axis=-1)


def tracked_rate(self: Graph, fin: list[float], rate: list[float], end: int) -> float:
    """`Graph.path_rate` from a pass that carries every longest path's summed rate forward.

    As the sweep's forward pass did before: each operation extends the path of its first
    predecessor (in index order) that finishes last.
    """
    acc = [0.0] * (self.n + 1)
    for row in self.fwd_rows:
        v = row[0]
        acc[v] = acc[max(row[1:], key=fin.__getitem__)] + rate[v]
    return acc[end]
