"""The least-cost cut of the critical subgraph, as one integer maximum flow. Pure.

One step of the frontier planner's Phillips-Dessouky sweep (`coordinator.pipeline.planner.
frontier`) needs the cheapest way to shorten every critical path: a minimum s-t cut with lower
bounds over the critical subgraph, found with `scipy.sparse.csgraph.maximum_flow` on a network
whose layout is built once per DAG (`CutNetwork`). Consecutive steps change few capacities, so
each max flow starts from the last one (made feasible for the new capacities): the cut is the
one a flow from zero finds, and on 8 x 96 1F1B the max flows take about a third of the time.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from coordinator.pipeline.planner.graph import Graph

__all__ = ["INF_CAP", "CutNetwork"]


INF_CAP = 1 << 28
"""An uncuttable arc's capacity in the integer max-flow (scipy's flows are 32-bit)."""


class CutNetwork:
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

    warm = True
    """Start each max flow from the last one (`False`: from zero; the same cuts, slower)."""

    def __init__(self, graph: Graph) -> None:
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
        self.row_of = all_rows[order]
        # Each sorted arc's reverse, also sorted: an arc kept for the flow keeps its reverse.
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        self.reverse = inverse[(order + rows.size) % (2 * rows.size)]
        self.caps = np.zeros(2 * rows.size, dtype=np.int64)
        # Each operation's three arcs (itself, its lower bound's source and sink arcs), as
        # positions in the sorted layout, for carrying a flow over to the next step.
        self.op_arcs = inverse[np.stack([ops, self.o_lbs + ops, self.o_lbt + ops])]
        self.from_source = np.flatnonzero(self.row_of == s)
        self.flow = np.zeros(2 * rows.size, dtype=np.int64)
        """The last maximum flow, antisymmetric, over the sorted layout (0: none)."""
        self.scale = 0.0
        """The capacity scale the last flow is in."""

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
        finite_ub = np.isfinite(ub)
        finite_vals = np.concatenate([(ub - lb)[finite_ub], lb])
        biggest = float(finite_vals.max()) if finite_vals.size else 0.0
        n_finite = max(1, finite_vals.size)
        cap_max = max(1, min(1 << 20, (INF_CAP // 4) // n_finite))
        scale = cap_max / biggest if biggest > 0 else 1.0
        caps = self.caps
        caps[:] = 0
        # A slowdown saves one unit less than it is worth: among cuts of (nearly) equal cost
        # the one that slows fewer operations wins. Without it, two operations of one kind
        # a few ulps apart on the same hull segment can be traded (one sped up, one slowed
        # down, at no net cost) step after step, each step only as long as their distance:
        # the sweep stalled for minutes on interleaved 1F1B (bloom A40, 8 x 2 x 16).
        lb_cap = np.maximum(np.rint(lb * scale).astype(np.int64) - 1, 0)
        ub_cap = np.rint(np.where(finite_ub, ub, 0.0) * scale).astype(np.int64)
        caps[crit_ops] = np.where(finite_ub, ub_cap - lb_cap, INF_CAP)
        caps[self.o_prec : self.o_src][prec] = INF_CAP
        caps[self.o_src : self.o_sink][src] = INF_CAP
        caps[self.o_sink : self.o_lbs][sink] = INF_CAP
        caps[self.o_lbs + crit_ops] = lb_cap
        caps[self.o_lbt + crit_ops] = lb_cap
        # Only the arcs with capacity (and their reverses) go to the flow: Dinic's phases walk
        # every arc given, and off the critical subgraph most have none.
        full = caps[self.order]
        flow = self._carried(full, scale)
        kept = full > 0
        kept |= kept[self.reverse]
        # (Gathers by index: a boolean mask this irregular indexes several times slower.)
        at = np.flatnonzero(kept)
        residual = full.take(at) - flow.take(at)
        indices, rows = self.indices.take(at), self.row_of.take(at)
        # A carried flow is often already maximum (the sink out of reach): no max flow to run.
        side = self._source_side(residual, indices, rows) if flow.any() else None
        if side is None:
            added = self._augment(residual, indices, rows)
            flow[at] += added
            residual -= added
            side = self._source_side(residual, indices, rows)
        self.flow, self.scale = flow, scale
        if int(flow[self.from_source].sum()) - int(lb_cap.sum()) >= INF_CAP // 2:
            self.scale = 0.0
            return None
        return side

    def _augment(self, residual: np.ndarray, indices: np.ndarray,
                 rows: np.ndarray) -> np.ndarray:
        """A maximum flow over the residual capacities of the kept arcs (`indices`, `rows`)."""
        size = self.size
        indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(np.bincount(rows, minlength=size), out=indptr[1:])
        graph = sp.csr_array((residual.astype(np.int32), indices, indptr), shape=(size, size))
        flow = maximum_flow(graph, size - 2, size - 1).flow
        if flow.nnz == residual.size and np.array_equal(flow.indices, indices):
            return flow.data.astype(np.int64)
        # A scipy that lays the flow out differently: look each arc up.
        coo = flow.tocoo()
        where = np.searchsorted(rows * size + indices, coo.row.astype(np.int64) * size + coo.col)
        added = np.zeros(residual.size, dtype=np.int64)
        added[where] = coo.data
        return added

    def _source_side(self, residual: np.ndarray, indices: np.ndarray,
                     row_of: np.ndarray) -> np.ndarray | None:
        """The nodes the source reaches over the arcs with residual capacity (None: the sink)."""
        size = self.size
        open_arc = np.flatnonzero(residual > 0)
        open_indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(np.bincount(row_of.take(open_arc), minlength=size), out=open_indptr[1:])
        # (float64 data: the traversal's validation would otherwise copy it into that type.)
        graph = sp.csr_array(
            (np.ones(open_arc.size), indices.take(open_arc), open_indptr), shape=(size, size)
        )
        reached = breadth_first_order(graph, size - 2, directed=True,
                                      return_predecessors=False)
        side = np.zeros(size, dtype=bool)
        side[reached] = True
        if side[size - 1]:
            return None
        return side

    def _carried(self, full: np.ndarray, scale: float) -> np.ndarray:
        """The last step's max flow made feasible for capacities `full`, or zero.

        A max flow's residual has one least source side (every max flow's), so starting the
        flow from any feasible flow finds the same cut; from the last step's, little is left
        to augment. The capacities change on the operations that moved: each operation's flow
        can be shifted between its own arc and its two lower-bound arcs (one unit less on the
        first, one more on both others keeps every node balanced). Where that cannot fit the
        new capacities (a dependency that is no longer critical but carries flow, a new scale),
        the flow starts from zero.
        """
        flow = self.flow
        if not self.warm or scale != self.scale:
            return np.zeros_like(flow)
        flow = flow.copy()
        pos = self.op_arcs
        f, c = flow[pos], full[pos]
        low = np.maximum(f[0] - c[0], np.maximum(-f[1], -f[2]))
        high = np.minimum(f[0], np.minimum(c[1] - f[1], c[2] - f[2]))
        shift = np.minimum(np.maximum(low, 0), high)
        moves = np.flatnonzero(shift)
        if moves.size:
            d = shift[moves]
            for row, sign in ((0, -1), (1, 1), (2, 1)):
                flow[pos[row, moves]] += sign * d
                flow[self.reverse[pos[row, moves]]] -= sign * d
        if np.any(flow > full):
            return np.zeros_like(flow)
        return flow

