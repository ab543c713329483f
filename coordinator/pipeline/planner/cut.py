"""The least-cost cut of the critical subgraph, as one integer maximum flow. Pure.

One step of the frontier planner's Phillips-Dessouky sweep (`coordinator.pipeline.planner.
frontier`) needs the cheapest way to shorten every critical path: a minimum s-t cut with lower
bounds over the critical subgraph, found with a maximum flow on a network whose layout is built
once per DAG (`CutNetwork`); a step only gives the arcs of its critical subgraph their
capacities (late in a sweep that is nearly every arc). Consecutive steps change few
capacities, so each max flow starts from the last one: made feasible for the new capacities by
moving flow between an operation's arcs, or, where that cannot fit them (a new capacity scale:
14% of 8 x 96 1F1B's steps), scaled to the new scale, cut to them and rebalanced, the flow the
new capacities cut sent on from the source or to the sink where an arc has room
(`kernels_flow.rebalance`). The rest is augmented by Dinic's algorithm compiled
(`kernels_flow.max_flow`: usually nothing or one path, tens of microseconds; a rebalanced flow
~1.4 ms on 8 x 2 x 96 interleaved, where from zero it took 3 ms and scipy's `maximum_flow`
2.4-6 ms); the whole warm start and max flow is one compiled call (`kernels_flow.solve`).
Whichever flow is found, the cut is the same: the least source side of every maximum flow
(scipy's max flow, with `CutNetwork.compiled` off, is the plain stand-in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from coordinator.pipeline.planner.graph import Graph
from coordinator.pipeline.planner.lazy import lazy_module

if TYPE_CHECKING:
    from coordinator.pipeline.planner import kernels_flow
else:  # (numba loaded at the first plan: `lazy`)
    kernels_flow = lazy_module("coordinator.pipeline.planner.kernels_flow")

__all__ = ["INF_CAP", "CutNetwork"]


INF_CAP = 1 << 28
"""An uncuttable arc's capacity in the integer max-flow (scipy's flows are 32-bit)."""


class CutNetwork:
    """The flow network of the least-cost cut, with a fixed arc layout.

    Node i is operation i's start, n + i its end, 2n the source, 2n + 1 the sink. Arcs (each
    with its reverse, of capacity 0): each operation's arc i -> n + i; each dependency u -> v as
    n + u -> v; source -> i for operations without predecessors; n + i -> sink for every
    operation; and per operation the two arcs source -> n + i and i -> sink that carry its lower
    bound. The layout (sorted by tail, then head) is computed once; a step gives capacities to
    the arcs of its critical subgraph (the others have none).

    The cut with lower bounds (forward operation arcs count ub, backward ones -lb) is found with
    one max flow: operation arcs get capacity ub - lb and each operation's lb is moved onto its
    source and sink arcs (every cut's value shifts by the sum of the lbs).
    """

    warm = True
    """Start each max flow from the last one (`False`: from zero; the same cuts, slower)."""

    compiled = True
    """Find each max flow with the compiled Dinic's algorithm (`False`: scipy's, slower)."""

    def __init__(self, graph: Graph) -> None:
        n = self.n = graph.n
        s, t = 2 * n, 2 * n + 1
        ops = np.arange(n)
        src_ops = np.flatnonzero(~graph.has_pred)
        self.src_ops = src_ops
        e = graph.eu.size
        rows = np.concatenate(
            [ops, graph.eu + n, np.full(src_ops.size, s), ops + n, np.full(n, s), ops]
        )
        cols = np.concatenate(
            [ops + n, graph.ev, src_ops, np.full(n, t), ops + n, np.full(n, t)]
        )
        size = self.size = 2 * n + 2
        all_rows = np.concatenate([rows, cols])
        all_cols = np.concatenate([cols, rows])
        key = all_rows * size + all_cols
        order = np.argsort(key, kind="stable")
        self.key = key[order]
        if np.any(self.key[1:] == self.key[:-1]):
            raise AssertionError("duplicate arcs in the cut network")
        self.indices = all_cols[order].astype(np.int32)
        self.row_of = all_rows[order]
        # Each arc group's positions in the sorted layout, and every position's reverse.
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        self.reverse = inverse[(order + rows.size) % (2 * rows.size)]
        o_src = n + e
        o_sink = o_src + src_ops.size
        self.op_arcs = inverse[np.stack([ops, o_sink + n + ops, o_sink + 2 * n + ops])]
        """Each operation's three arcs: itself, its lower bound's source and sink arcs."""
        self.edge_arcs = inverse[n + np.arange(e)]
        self.src_arcs = inverse[o_src + np.arange(src_ops.size)]
        self.sink_arcs = inverse[o_sink + ops]
        self._forward_arc = np.zeros(2 * rows.size, dtype=bool)
        self._forward_arc[inverse[: rows.size]] = True
        self._order = np.concatenate([[s], np.stack([graph.topo, graph.topo + n], axis=1).ravel(),
                                      [t]]).astype(np.int64)
        """The network's nodes in an order its arcs all follow (the DAG's, start before end)."""
        self.flow = np.zeros(2 * rows.size, dtype=np.int64)
        """The last maximum flow, antisymmetric, over the sorted layout (0: none)."""
        self.caps = np.zeros(2 * rows.size, dtype=np.int64)
        self._residual = np.zeros(2 * rows.size, dtype=np.int64)
        self.starts = [0, 0, 0]
        """Max flows started from zero, from the last one carried, rebalanced (warm, compiled)."""
        self.from_source = np.flatnonzero(self.row_of == s)
        self.scale = 0.0
        """The capacity scale the last flow is in."""
        # The layout as one sparse matrix whose column indices each search replaces (no
        # validation or conversion on every step).
        self.row_of = self.row_of.astype(np.int32)
        self._to_head = self.indices - self.row_of
        indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(np.bincount(self.row_of, minlength=size), out=indptr[1:])
        self._indptr = indptr.astype(np.int64)
        self._heads = self.indices.astype(np.int64)
        import scipy.sparse as sp  # here: a replica that never plans never imports scipy

        self._open = sp.csr_array((np.ones(self.indices.size), self.indices.copy(), indptr),
                                  shape=(size, size))

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
        # A slowdown saves one unit less than it is worth: among cuts of (nearly) equal cost
        # the one that slows fewer operations wins. Without it, two operations of one kind
        # a few ulps apart on the same hull segment can be traded (one sped up, one slowed
        # down, at no net cost) step after step, each step only as long as their distance:
        # the sweep stalled for minutes on interleaved 1F1B (bloom A40, 8 x 2 x 16).
        caps = self.caps
        own = self.op_arcs[:, crit_ops]
        scale, lb_sum = kernels_flow.cut_caps(caps, own, ub, lb, self.edge_arcs, prec,
                                              self.src_arcs, src, self.sink_arcs, sink, INF_CAP)
        if self.warm and self.compiled:  # (The same as below, in one compiled call.)
            ratio = scale / self.scale if self.scale > 0 else 0.0
            side, total, how = kernels_flow.solve(
                self.flow, caps, own, self._residual, self._forward_arc, self._order,
                self._indptr, self._heads, self.reverse, scale == self.scale, ratio,
                self.from_source, 2 * self.n, 2 * self.n + 1)
            self.starts[how] += 1
        else:
            flow = self._carried(caps, own, scale)
            if self.warm and self.scale > 0 and not flow.any():
                # (A new scale: the last flow scaled to it, rounded down, loses little.)
                flow = kernels_flow.rebalance(self.flow, caps, self._forward_arc, self._order,
                                              self._indptr, self._heads, self.reverse,
                                              scale / self.scale)
            residual = caps - flow
            side = self._max_flow(residual)
            self.flow = caps - residual
            total = int(self.flow[self.from_source].sum())
        self.scale = scale
        if total - lb_sum >= INF_CAP // 2:
            self.scale = 0.0
            return None
        return side

    def _carried(self, caps: np.ndarray, own: np.ndarray, scale: float) -> np.ndarray:
        """The last step's max flow made feasible for capacities `caps`, or zero.

        A max flow's residual has one least source side (every max flow's), so starting the
        flow from any feasible flow finds the same cut; from the last step's, little is left
        to augment. The capacities change on the operations that moved: each operation's flow
        can be shifted between its own arc (`own[0]`) and its two lower-bound arcs (`own[1]`,
        `own[2]`; one unit less on the first, one more on both others keeps every node
        balanced). Where that cannot fit the new capacities (a dependency that is no longer
        critical but carries flow, a new scale), the flow starts from zero.
        """
        if not self.warm or scale != self.scale:
            return np.zeros_like(self.flow)
        return kernels_flow.carry(self.flow, caps, own, self.reverse)

    def _max_flow(self, residual: np.ndarray) -> np.ndarray:
        """Augment `residual` (in place) to a maximum flow's; the source side of its cut.

        The compiled Dinic's algorithm (`kernels_flow.max_flow`) from whatever flow `residual`
        carries; with `compiled` off, scipy's maximum flow and breadth-first search (the plain
        stand-in: the same side, as every maximum flow has).
        """
        n = self.n
        if self.compiled:
            return kernels_flow.max_flow(self._indptr, self._heads, self.reverse, residual,
                                    2 * n, 2 * n + 1)
        residual -= _augment(residual, self.key, self.size)
        return self._search(residual)

    def _search(self, residual: np.ndarray) -> np.ndarray:
        """The nodes the source reaches over arcs with residual capacity (scipy's search)."""
        from scipy.sparse.csgraph import breadth_first_order

        graph = self._open
        # An arc without residual capacity becomes a loop on its tail: the layout stays, no
        # arcs to filter out or count, and a loop leads nowhere new.
        graph.indices = self.row_of + (residual > 0) * self._to_head
        reached = breadth_first_order(graph, self.size - 2, directed=True,
                                      return_predecessors=False)
        side = np.zeros(self.size, dtype=bool)
        side[reached] = True
        return side


def _augment(residual: np.ndarray, key: np.ndarray, size: int) -> np.ndarray:
    """A maximum flow over the residual capacities of the layout's arcs, by arc.

    `key` is each arc's tail * size + head, ascending. scipy is given the arcs with residual
    capacity only.
    """
    import scipy.sparse as sp
    from scipy.sparse.csgraph import maximum_flow

    open_arc = np.flatnonzero(residual > 0)
    tails, heads = np.divmod(key[open_arc], size)
    indptr = np.zeros(size + 1, dtype=np.int32)
    np.cumsum(np.bincount(tails, minlength=size), out=indptr[1:])
    graph = sp.csr_array((residual[open_arc].astype(np.int32), heads.astype(np.int32), indptr),
                         shape=(size, size))
    flow = maximum_flow(graph, size - 2, size - 1).flow.tocoo()
    # (scipy adds the reverse arcs it lacks: every one is in the layout.)
    where = np.searchsorted(key, flow.row.astype(np.int64) * size + flow.col)
    added = np.zeros(residual.size, dtype=np.int64)
    added[where] = flow.data
    return added
