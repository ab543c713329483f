"""The least-cost cut's max flow and capacities, compiled with numba (`cut.CutNetwork`). Pure.

One max flow a sweep step over the cut network's ~20,000 arcs (8 x 96 1F1B; twice that
interleaved), started from the last step's flow: its capacities (`cut_caps`), the last flow
carried over to them (`carry`) or, at a new capacity scale, scaled and rebalanced
(`rebalance`), then augmented by Dinic's algorithm (`max_flow`). Integer capacities: exact.
Compiled and cached as `kernels` says (numba's cache notices a change to a function's own file
only, so nothing here calls another module's compiled function).
"""

from __future__ import annotations

import numpy as np

from coordinator.pipeline.planner.kernels import _jit

__all__ = ["carry", "cut_caps", "max_flow", "rebalance", "solve"]


@_jit
def max_flow(indptr: np.ndarray, heads: np.ndarray, reverse: np.ndarray,
             residual: np.ndarray, source: int, sink: int) -> np.ndarray:
    """Augment `residual` (in place) to a maximum flow's; the nodes the source still reaches.

    Dinic's algorithm over the fixed arc layout (arcs sorted by tail: `indptr`, `heads`; each
    arc's reverse): breadth-first levels, then shortest augmenting paths by depth-first search
    with a current arc per node, until the sink is out of reach. Integer capacities: exact.
    """
    size = indptr.size - 1
    level = np.empty(size, dtype=np.int64)
    queue = np.empty(size, dtype=np.int64)
    current = np.empty(size, dtype=np.int64)
    path = np.empty(size, dtype=np.int64)
    while True:
        level[:] = -1
        level[source] = 0
        queue[0] = source
        head, tail = 0, 1
        while head < tail:
            u = queue[head]
            head += 1
            if level[sink] >= 0 and level[u] >= level[sink]:
                break  # (No shortest augmenting path goes further.)
            for a in range(indptr[u], indptr[u + 1]):
                if residual[a] > 0 and level[heads[a]] < 0:
                    level[heads[a]] = level[u] + 1
                    queue[tail] = heads[a]
                    tail += 1
        if level[sink] < 0:
            return level >= 0
        current[:] = indptr[:-1]
        _blocking_flow(indptr, heads, reverse, residual, level, current, path, source, sink)


@_jit
def _blocking_flow(indptr: np.ndarray, heads: np.ndarray, reverse: np.ndarray,
                   residual: np.ndarray, level: np.ndarray, current: np.ndarray,
                   path: np.ndarray, source: int, sink: int) -> None:
    """Push shortest augmenting paths along the levels until none is left.

    Depth-first from the source over each node's current arc; a dead end is dropped for the
    rest of the phase, and after each push the search resumes at the first saturated arc.
    """
    depth = 0
    u = source
    while True:
        if u == sink:
            bottleneck = residual[path[0]]
            for i in range(1, depth):
                bottleneck = min(bottleneck, residual[path[i]])
            first = depth
            for i in range(depth):
                residual[path[i]] -= bottleneck
                residual[reverse[path[i]]] += bottleneck
                if residual[path[i]] == 0 and i < first:
                    first = i
            depth = first
            u = heads[reverse[path[first]]]
            continue
        end = indptr[u + 1]
        a = current[u]
        while a < end and not (residual[a] > 0 and level[heads[a]] == level[u] + 1):
            a += 1
        current[u] = a
        if a < end:
            path[depth] = a
            depth += 1
            u = heads[a]
        elif u == source:
            return
        else:  # A dead end: never again this phase; back up, the tail tries its next arc.
            level[u] = -1
            depth -= 1
            u = heads[reverse[path[depth]]]
            current[u] += 1


@_jit
def cut_caps(caps: np.ndarray, own: np.ndarray, ub: np.ndarray, lb: np.ndarray,
             edge_arcs: np.ndarray, prec: np.ndarray, src_arcs: np.ndarray, src: np.ndarray,
             sink_arcs: np.ndarray, sink: np.ndarray, inf_cap: int) -> tuple[float, int]:
    """Fill `caps` for one step's cut (`cut.CutNetwork.min_cut`): (scale, sum of lb caps).

    The largest finite capacity is scaled to `(inf_cap // 4) // count` (at most 2^20), each
    capacity rounded to the nearest integer (half to even, as `np.rint`); a slowdown's one
    unit less (see `min_cut`).
    """
    biggest = -np.inf
    count = 0
    for i in range(ub.size):
        if np.isfinite(ub[i]):
            biggest = max(biggest, ub[i] - lb[i])
            count += 1
    for i in range(lb.size):
        biggest = max(biggest, lb[i])
        count += 1
    if count == 0:
        biggest = 0.0
    cap_max = max(1, min(1 << 20, (inf_cap // 4) // max(1, count)))
    scale = cap_max / biggest if biggest > 0 else 1.0
    caps[:] = 0
    lb_sum = 0
    for i in range(ub.size):
        lb_cap = max(int(np.rint(lb[i] * scale)) - 1, 0)
        lb_sum += lb_cap
        if np.isfinite(ub[i]):
            caps[own[0, i]] = int(np.rint(ub[i] * scale)) - lb_cap
        else:
            caps[own[0, i]] = inf_cap
        caps[own[1, i]] = lb_cap
        caps[own[2, i]] = lb_cap
    for i in range(prec.size):
        if prec[i]:
            caps[edge_arcs[i]] = inf_cap
    for i in range(src.size):
        if src[i]:
            caps[src_arcs[i]] = inf_cap
    for i in range(sink.size):
        if sink[i]:
            caps[sink_arcs[i]] = inf_cap
    return scale, lb_sum


@_jit
def carry(flow: np.ndarray, caps: np.ndarray, own: np.ndarray,
          reverse: np.ndarray) -> np.ndarray:
    """`flow` with each operation's flow shifted to fit `caps` (`CutNetwork._carried`), or 0."""
    out = flow.copy()
    if not _carry_into(out, caps, own, reverse):
        out[:] = 0
    return out


@_jit
def _carry_into(out: np.ndarray, caps: np.ndarray, own: np.ndarray, reverse: np.ndarray) -> bool:
    """Shift each operation's flow in `out` (in place) to fit `caps`: whether it fits them."""
    for i in range(own.shape[1]):
        a, b, c = own[0, i], own[1, i], own[2, i]
        low = max(out[a] - caps[a], max(-out[b], -out[c]))
        high = min(out[a], min(caps[b] - out[b], caps[c] - out[c]))
        shift = min(max(low, 0), high)
        if shift != 0:
            out[a] -= shift
            out[reverse[a]] += shift
            out[b] += shift
            out[reverse[b]] -= shift
            out[c] += shift
            out[reverse[c]] -= shift
    fits = True
    for i in range(out.size):
        fits = fits and out[i] <= caps[i]
    return fits


@_jit
def solve(flow: np.ndarray, caps: np.ndarray, own: np.ndarray, residual: np.ndarray,
          forward_arc: np.ndarray, order: np.ndarray, indptr: np.ndarray, heads: np.ndarray,
          reverse: np.ndarray, same_scale: bool, ratio: float, from_source: np.ndarray,
          source: int, sink: int) -> tuple[np.ndarray, int, int]:
    """One step's max flow from the last one (`flow`, updated in place), in one call.

    `CutNetwork.min_cut`'s warm start: the last flow carried to `caps` (`carry`) where the
    scale is the same; where it is not, or that fails or leaves no flow, and `ratio` (the new
    scale over the last) is positive, rebalanced (`rebalance`); else from zero. Then augmented
    by `max_flow` (`residual` is a work buffer). Returns (the source side, the flow out of the
    source, how it started: 1 carried, 2 rebalanced, 0 from zero).
    """
    how = 0
    if same_scale:
        residual[:] = flow
        if _carry_into(residual, caps, own, reverse):
            for i in range(residual.size):
                if residual[i] != 0:
                    how = 1
                    break
    if how == 0 and ratio > 0:
        residual[:] = rebalance(flow, caps, forward_arc, order, indptr, heads, reverse, ratio)
        how = 2
    elif how == 0:
        residual[:] = 0
    for i in range(residual.size):
        residual[i] = caps[i] - residual[i]
    side = max_flow(indptr, heads, reverse, residual, source, sink)
    total = 0
    for i in range(residual.size):
        flow[i] = caps[i] - residual[i]
    for i in range(from_source.size):
        total += flow[from_source[i]]
    return side, total, how


@_jit
def rebalance(flow: np.ndarray, caps: np.ndarray, forward_arc: np.ndarray,
              order: np.ndarray, indptr: np.ndarray, heads: np.ndarray,
              reverse: np.ndarray, ratio: float) -> np.ndarray:
    """A feasible flow near `flow` times `ratio` within capacities `caps` (a change of scale).

    Every forward arc's flow is scaled by `ratio` (rounded down) and cut to its capacity; then,
    in the network's topological `order` (its arcs all go forward in it), a node that sends
    more than it receives gets more from the source where it has an arc from it, else sends
    less, and one that receives more than it sends sends more where its arcs have room (to the
    sink first); in reverse order, one that still receives more than it sends receives less.
    No arc's flow leaves [0, capacity]; the flow lost to the new capacities is mostly sent on
    around them (the max flow then has less to augment).
    """
    size = indptr.size - 1
    f = np.zeros(flow.size, dtype=np.int64)
    inflow = np.zeros(size, dtype=np.int64)
    outflow = np.zeros(size, dtype=np.int64)
    for u in range(size):
        for a in range(indptr[u], indptr[u + 1]):
            if forward_arc[a] and flow[a] > 0:
                x = min(int(flow[a] * ratio) if ratio != 1.0 else flow[a], caps[a])
                if x > 0:
                    f[a] = x
                    outflow[u] += x
                    inflow[heads[a]] += x
    source, sink = order[0], order[-1]
    for v in order[1:-1]:
        lo, hi = indptr[v], indptr[v + 1]
        excess = outflow[v] - inflow[v]
        for b in range(lo, hi):  # Short of inflow: more straight from the source.
            a = reverse[b]
            if excess > 0 and heads[b] == source and forward_arc[a] and caps[a] > f[a]:
                give = min(caps[a] - f[a], excess)
                f[a] += give
                inflow[v] += give
                outflow[source] += give
                excess -= give
        for a in range(lo, hi):  # Still short: send less.
            if excess > 0 and forward_arc[a] and f[a] > 0:
                take = min(f[a], excess)
                f[a] -= take
                outflow[v] -= take
                inflow[heads[a]] -= take
                excess -= take
        for step in range(2):  # Too much inflow: send more, to the sink first.
            for a in range(lo, hi):
                if (excess < 0 and forward_arc[a] and caps[a] > f[a]
                        and (heads[a] == sink) == (step == 0)):
                    give = min(caps[a] - f[a], -excess)
                    f[a] += give
                    outflow[v] += give
                    inflow[heads[a]] += give
                    excess += give
    for i in range(order.size - 2, 0, -1):
        v = order[i]
        excess = inflow[v] - outflow[v]
        b = indptr[v]
        while excess > 0 and b < indptr[v + 1]:
            a = reverse[b]
            if forward_arc[a] and f[a] > 0:
                take = min(f[a], excess)
                f[a] -= take
                inflow[v] -= take
                outflow[heads[b]] -= take
                excess -= take
            b += 1
    for a in range(f.size):
        if forward_arc[a]:
            f[reverse[a]] = -f[a]
    return f

