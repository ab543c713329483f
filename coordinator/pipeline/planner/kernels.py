"""The frontier planner's per-step loops, compiled with numba. Pure (numba's cache aside).

A sweep runs thousands of steps, each a few passes over the DAG (about 1,500 operations on 8 x
96 1F1B, 3,000 interleaved) and one max flow over its ~20,000 arcs: as Python loops or many small
numpy calls they took ~4 ms a step. Here each is one compiled loop. Every float operation is
the one the plain version does, in the same order (numba without fastmath contracts nothing),
so the plans are the plain version's bit for bit (`tests/core/test_frontier_fast_paths.py`
compares them with the plain stand-ins in `tests/core/planner_reference_kit.py`).

Only the planner imports this module (numba takes ~0.3 s to import), and only when a plan first
needs it (`lazy`): the coordinator's service imports the planner at start, not numba. Compiling
every kernel takes ~13 CPU-s on the CI VM, once: `cache=True` keeps the machine code in
`NUMBA_CACHE_DIR` if set, else beside this file, else (read-only) in numba's user cache; with none
writable, the kernels are compiled in every process. A fresh process with the cache compiles
nothing. A cached function must not call itself (numba's cache segfaulted on reloading the
recursive pairwise sum), hence the explicit stack in `_pairwise`.

Layout: `preds` / `succs` are [n, width] node indices padded with the sentinel n (finish time 0,
latest start the horizon); `topo` a topological order.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = [
    "backward",
    "forward",
    "max_flow",
    "path_rate",
    "plan_times",
    "reclaim",
    "round_plans",
]


def _jit(func: Any) -> Any:
    """Compiled, cached; a float division by zero gives inf or nan as in numpy, not an error.

    Where numba finds no folder to write its cache to (a read-only install, no writable home,
    no `NUMBA_CACHE_DIR`) it raises at decoration: then compiled in each process, uncached.
    """
    try:
        return numba.njit(cache=True, error_model="numpy")(func)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(error_model="numpy")(func)


@_jit
def forward(preds: np.ndarray, topo: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Earliest finish times (index n: the sentinel's 0)."""
    fin = np.zeros(topo.size + 1)
    width = preds.shape[1]
    for v in topo:
        best = fin[preds[v, 0]]
        for j in range(1, width):
            x = fin[preds[v, j]]
            if x > best:
                best = x
        fin[v] = best + d[v]
    return fin


@_jit
def backward(succs: np.ndarray, topo: np.ndarray, d: np.ndarray, horizon: float) -> np.ndarray:
    """Latest start times for the iteration to end by `horizon` (index n: the horizon)."""
    ls = np.full(topo.size + 1, horizon)
    width = succs.shape[1]
    for i in range(topo.size - 1, -1, -1):
        v = topo[i]
        best = ls[succs[v, 0]]
        for j in range(1, width):
            x = ls[succs[v, j]]
            if x < best:
                best = x
        ls[v] = best - d[v]
    return ls


@_jit
def path_rate(preds: np.ndarray, fin: np.ndarray, rate: np.ndarray, end: int) -> float:
    """The summed `rate` along the longest path to `end` (`Graph.path_rate`)."""
    n = preds.shape[0]
    total = 0.0
    v = end
    while v != n:
        total += rate[v]
        best = preds[v, 0]
        for j in range(1, preds.shape[1]):
            u = preds[v, j]
            if fin[u] > fin[best]:
                best = u
        v = best
    return total


@_jit
def _flat(i: int, size: int) -> int:
    """A flat option index as numpy takes it (-1: the last)."""
    return i + size if i < 0 else i


@_jit
def plan_times(preds: np.ndarray, topo: np.ndarray, plans: np.ndarray,
               flat_times: np.ndarray, width: int) -> np.ndarray:
    """The iteration time of every plan (rows of `plans`: option indices).

    Node v's option p takes `flat_times[v * width + p]`.
    """
    count, n = plans.shape
    out = np.empty(count)
    d = np.empty(n)
    for c in range(count):
        for v in range(n):
            d[v] = flat_times[_flat(v * width + plans[c, v], flat_times.size)]
        fin = forward(preds, topo, d)
        best = fin[0]
        for v in range(1, n):
            if fin[v] > best:
                best = fin[v]
        out[c] = best
    return out


@_jit
def _count_upto(ladder: np.ndarray, x: float) -> int:
    """How many of `ladder` (ascending) are <= x (numpy's searchsorted, side "right")."""
    lo, hi = 0, ladder.size
    while lo < hi:
        mid = (lo + hi) // 2
        if ladder[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def reclaim(preds: np.ndarray, succs: np.ndarray, topo: np.ndarray, choices: np.ndarray,
            op_times: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Every plan's slack reclaimed (`Graph.reclaim_many`; `choices` is [n, count])."""
    n, count = choices.shape
    new = choices.copy()
    times = np.empty(count)
    dur = np.empty(n)
    latest = np.empty(n)  # each operation's latest finish
    for c in range(count):
        for v in range(n):
            dur[v] = op_times[v, choices[v, c]]
        fin = forward(preds, topo, dur)
        ls = np.full(n + 1, fin[:n].max())
        for i in range(n - 1, -1, -1):
            v = topo[i]
            best = ls[succs[v, 0]]
            for j in range(1, succs.shape[1]):
                if ls[succs[v, j]] < best:
                    best = ls[succs[v, j]]
            latest[v] = best
            ls[v] = best - dur[v]
        fin[:] = 0.0
        for v in topo:
            start = fin[preds[v, 0]]
            for j in range(1, preds.shape[1]):
                if fin[preds[v, j]] > start:
                    start = fin[preds[v, j]]
            room = latest[v] - start + tol
            # Its slowest option at most `room` long, or its own if faster (options ascend).
            pick = choices[v, c]
            while pick + 1 < op_times.shape[1] and op_times[v, pick + 1] <= room:
                pick += 1
            new[v, c] = pick
            fin[v] = start + op_times[v, pick]
        times[c] = fin[:n].max()
    return new, times


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
def _block(a: np.ndarray, lo: int, n: int) -> float:
    """The pairwise sum numpy takes of a block of at most 128 (8 accumulators from 8 on)."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        j = lo + i
        r0, r1, r2, r3 = r0 + a[j], r1 + a[j + 1], r2 + a[j + 2], r3 + a[j + 3]
        r4, r5, r6, r7 = r4 + a[j + 4], r5 + a[j + 5], r6 + a[j + 6], r7 + a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_jit
def _pairwise(a: np.ndarray) -> float:
    """The pairwise sum numpy takes of `a` (its `sum` of a contiguous array, to the bit).

    Above 128 numpy halves the range (the first half a multiple of 8) and adds the two sums:
    the same tree here with an explicit stack (a cached numba function must not recurse).
    """
    if a.size <= 128:
        return _block(a, 0, a.size)
    los = np.empty(64, dtype=np.int64)
    ns = np.empty(64, dtype=np.int64)
    state = np.zeros(64, dtype=np.int64)  # 0: new, 1: left half pending, 2: right half
    left = np.empty(64)
    top, los[0], ns[0] = 0, 0, a.size
    while True:
        if state[top] == 0 and ns[top] > 128:
            state[top] = 1
            half = ns[top] // 2 - (ns[top] // 2) % 8
            top += 1
            los[top], ns[top], state[top] = los[top - 1], half, 0
            continue
        val = _block(a, los[top], ns[top])
        top -= 1
        while top >= 0 and state[top] == 2:
            val = left[top] + val
            top -= 1
        if top < 0:
            return val
        left[top], state[top] = val, 2
        half = ns[top] // 2 - (ns[top] // 2) % 8
        top += 1
        los[top], ns[top], state[top] = los[top - 1] + half, ns[top - 1] - half, 0


@_jit
def _np_sum(a: np.ndarray) -> float:
    """`float(a.sum())` for a contiguous 1-d array (numpy adds its pairwise sum to 0.0)."""
    return 0.0 + _pairwise(a)


@_jit
def round_plans(durs: np.ndarray, horizons: np.ndarray, eps_t: float, ladder: np.ndarray,
                below: np.ndarray, kind: np.ndarray, flat_times: np.ndarray,
                flat_costs: np.ndarray, width: int, taus: np.ndarray,
                memo_d: np.ndarray,
                memo_c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of `durs` rounded to real options, and the plans rounded the other way.

    (`frontier._Candidates.record_many`.) Per row: the plan of each operation's slowest option
    at least as fast as planned (time: the row's horizon when nothing was rounded, else nan:
    timed later), then, if any was rounded, the plans where each rounded operation that has a
    slower option takes it when at least `taus` (descending) of the way there, and all of
    them, each unless the last one was the same plan. Returns (plans [k, n] int16, times,
    costs), in the plain version's order with its sums.
    `memo_d` / `memo_c` hold each operation's last rounded duration and its option (nan: none
    yet), kept between calls.
    """
    count, n = durs.shape
    size = flat_times.size
    nt = taus.size
    plans = np.empty((count * (nt + 2), n), dtype=np.int16)
    times = np.empty(count * (nt + 2))
    costs = np.empty(count * (nt + 2))
    choice = np.empty(n, dtype=np.int64)
    cost_row = np.empty(n)
    moved = np.empty(n, dtype=np.int64)
    slower = np.empty(n, dtype=np.int64)
    extra = np.empty(n)
    frac = np.empty(n)
    picked = np.empty(n)
    k = 0
    for r in range(count):
        rounded = False
        m = 0
        for v in range(n):
            if durs[r, v] != memo_d[v]:  # (Most operations keep their duration.)
                memo_d[v] = durs[r, v]
                memo_c[v] = below[kind[v], _count_upto(ladder, durs[r, v] + eps_t)] - 1
            c = memo_c[v]
            choice[v] = c
            low_at = _flat(v * width + c, size)
            cost_row[v] = flat_costs[low_at]
            if flat_times[low_at] != durs[r, v]:
                rounded = True
                up = min(c + 1, width - 1)
                if up != c:
                    high_at = _flat(v * width + up, size)
                    moved[m], slower[m] = v, up
                    extra[m] = flat_costs[high_at] - flat_costs[low_at]
                    low_t, high_t = flat_times[low_at], flat_times[high_at]
                    frac[m] = (durs[r, v] - low_t) / (high_t - low_t)
                    if not np.isfinite(high_t):
                        frac[m] = 0.0
                    m += 1
        energy = _np_sum(cost_row)
        plans[k] = choice
        times[k] = np.nan if rounded else horizons[r]
        costs[k] = energy
        k += 1
        # The mixes (a threshold each, when more than one operation can move), then all.
        # (The masks grow with t: one as large as the last is the same plan, a duplicate.)
        first = 0 if m > 1 else nt
        last_hits = 0
        for t in range(first, nt + 1 if m else first):
            hits = 0
            plans[k] = choice
            for i in range(m):
                if t == nt or frac[i] >= taus[t]:
                    plans[k, moved[i]] = slower[i]
                    picked[hits] = extra[i]
                    hits += 1
            if hits > last_hits:
                last_hits = hits
                times[k] = np.nan
                costs[k] = energy + _np_sum(picked[:hits])
                k += 1
    return plans[:k], times[:k], costs[:k]


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
    for i in range(out.size):
        if out[i] > caps[i]:
            return np.zeros_like(out)
    return out


@_jit
def critical(ls: np.ndarray, dur: np.ndarray, fin: np.ndarray, horizon: float, eps_t: float,
             eu: np.ndarray, ev: np.ndarray,
             src_ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The critical subgraph of a step (`frontier._cut_step`).

    Returns (operations, mask over the dependencies (eu, ev), mask over the starting
    operations `src_ops`, mask over all operations: ending the iteration). `ls` is the latest
    starts; an operation is critical when it cannot start later, a
    dependency when both ends are and the second starts as the first ends (within eps_t).
    """
    n = dur.size
    start = np.empty(n)
    crit = np.empty(n, dtype=np.bool_)
    count = 0
    for v in range(n):
        start[v] = fin[v] - dur[v]
        crit[v] = (ls[v] - start[v]) <= eps_t
        count += crit[v]
    crit_ops = np.empty(count, dtype=np.int64)
    k = 0
    sink = np.empty(n, dtype=np.bool_)
    for v in range(n):
        if crit[v]:
            crit_ops[k] = v
            k += 1
        sink[v] = crit[v] and fin[v] >= horizon - eps_t
    prec = np.empty(eu.size, dtype=np.bool_)
    for i in range(eu.size):
        u, w = eu[i], ev[i]
        prec[i] = crit[u] and crit[w] and start[w] - fin[u] <= eps_t
    src = np.empty(src_ops.size, dtype=np.bool_)
    for i in range(src_ops.size):
        src[i] = crit[src_ops[i]] and start[src_ops[i]] <= eps_t
    return crit_ops, prec, src, sink


@_jit
def cut_moves(side: np.ndarray, crit_ops: np.ndarray, ub: np.ndarray, lb: np.ndarray,
              dur: np.ndarray, hull: np.ndarray, below: np.ndarray,
              upto: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The cut's moves: (sped up, slowed down, the longest step on their hulls).

    An operation whose start is on the source side and end is not is sped up; the other way
    round (with a saving) slowed down. No operation sped up, or one that cannot be: step nan.
    """
    n = dur.size
    speed = np.empty(crit_ops.size, dtype=np.int64)
    slow = np.empty(crit_ops.size, dtype=np.int64)
    ns = nl = 0
    for i in range(crit_ops.size):
        v = crit_ops[i]
        if side[v] and not side[v + n]:
            speed[ns] = v
            ns += 1
            if not np.isfinite(ub[i]):
                return speed[:0], slow[:0], np.nan
        elif not side[v] and side[v + n] and lb[i] > 0:
            slow[nl] = v
            nl += 1
    if ns == 0:
        return speed[:0], slow[:0], np.nan
    step = np.inf
    for i in range(ns):
        v = speed[i]
        step = min(step, dur[v] - hull[v, below[v] - 1])
    for i in range(nl):
        v = slow[i]
        step = min(step, hull[v, upto[v]] - dur[v])
    return speed[:ns], slow[:nl], step


@_jit
def rebalance(flow: np.ndarray, caps: np.ndarray, forward_arc: np.ndarray,
              order: np.ndarray, indptr: np.ndarray, heads: np.ndarray,
              reverse: np.ndarray, ratio: float) -> np.ndarray:
    """A feasible flow near `flow` times `ratio` within capacities `caps` (a change of scale).

    Every forward arc's flow is scaled by `ratio` (rounded down) and cut to its capacity; then,
    in the
    network's topological `order` (its arcs all go forward in it), a node that sends more than
    it receives sends less, and in reverse order one that receives more than it sends
    receives less: flow is only ever taken away, so every arc stays within its capacity.
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
    for v in order[1:-1]:
        excess = outflow[v] - inflow[v]
        a = indptr[v]
        while excess > 0 and a < indptr[v + 1]:
            if forward_arc[a] and f[a] > 0:
                take = min(f[a], excess)
                f[a] -= take
                outflow[v] -= take
                inflow[heads[a]] -= take
                excess -= take
            a += 1
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


@_jit
def place(hull: np.ndarray, hull_n: np.ndarray, slope: np.ndarray, dur: np.ndarray,
          moved: np.ndarray, eps_t: float, below: np.ndarray, upto: np.ndarray,
          ub: np.ndarray, lb: np.ndarray) -> None:
    """Place the operations `moved` on their hulls anew (`frontier._OnHull.update`)."""
    width = hull.shape[1]
    for i in range(moved.size):
        v = moved[i]
        lo, hi = dur[v] - eps_t, dur[v] + eps_t
        b = u = 0
        for j in range(width):
            b += hull[v, j] < lo  # vertices strictly faster
            u += hull[v, j] <= hi  # vertices at least as fast
        ub[v] = slope[v, max(b - 1, 0)] if b >= 1 else np.inf
        at = min(u - 1, hull_n[v] - 1)
        lb[v] = slope[v, at + width if at < 0 else at] if u <= hull_n[v] - 1 else 0.0
        below[v], upto[v] = b, u


@_jit
def shrink(preds: np.ndarray, topo: np.ndarray, hull: np.ndarray, dur: np.ndarray,
           rate: np.ndarray, moved: np.ndarray, horizon: float, step: float,
           eps_t: float) -> tuple[np.ndarray, np.ndarray, float, int]:
    """`frontier._shrink`: (durations after the step, their finish times, step, passes).

    Each try snaps the moved operations within `eps_t` above a hull vertex onto it (the
    nearest such vertex, the first of equals) and times the durations with a forward pass.
    """
    trial = np.empty(dur.size)
    fin = np.zeros(0)
    passes = 0
    for _ in range(1000):
        for v in range(dur.size):
            trial[v] = dur[v] + step * rate[v]
        for i in range(moved.size):
            v = moved[i]
            best, at = np.inf, -1
            for j in range(hull.shape[1]):
                gap = trial[v] - hull[v, j]
                if not (gap < 0 or gap > eps_t) and gap < best:
                    best, at = gap, j
            if at >= 0:
                trial[v] = hull[v, at]
        fin = forward(preds, topo, trial)
        passes += 1
        end = int(fin.argmax())  # (The sentinel's 0 is no finish time's better.)
        length = fin[end]
        if length <= horizon - step + eps_t:
            break
        acc = path_rate(preds, fin, rate, end)
        if acc <= -1.0:
            break  # (A path that shortens as fast as the iteration: rounding only.)
        shorter = (horizon - (length - step * acc)) / (acc + 1.0)
        if not shorter < step:
            break
        step = shorter
    return trial, fin, step, passes


@_jit
def on_the_way(dur: np.ndarray, trial: np.ndarray, rate: np.ndarray, times: np.ndarray,
               sp_ops: np.ndarray, sl_ops: np.ndarray, step: float,
               eps_t: float) -> np.ndarray:
    """A step's plans as rows of durations (`frontier._sweep`).

    Wherever a moving operation passes one of its options (ascending, once each), then the
    step's end (`trial`).
    """
    width = times.shape[1]
    found = np.empty((sp_ops.size + sl_ops.size) * width)
    k = 0
    for i in range(sp_ops.size + sl_ops.size):
        v = sp_ops[i] if i < sp_ops.size else sl_ops[i - sp_ops.size]
        for j in range(width):
            x = dur[v] - times[v, j] if i < sp_ops.size else times[v, j] - dur[v]
            if x > eps_t and x < step - eps_t:
                found[k] = x
                k += 1
    found = np.sort(found[:k])
    rows = np.empty((k + 1, dur.size))
    m = 0
    for i in range(k):
        if i == 0 or found[i] != found[i - 1]:
            for v in range(dur.size):
                rows[m, v] = dur[v] + found[i] * rate[v]
            m += 1
    rows[m] = trial
    return rows[: m + 1]
