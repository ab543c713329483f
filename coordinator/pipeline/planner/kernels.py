"""The frontier planner's per-step loops, compiled with numba. Pure (numba's cache aside).

A sweep runs thousands of steps, each a few passes over the DAG (about 1,500 operations on 8 x
96 1F1B, 3,000 interleaved) and one max flow over its ~20,000 arcs: as Python loops or many small
numpy calls they took ~4 ms a step. Here each is one compiled loop. Every float operation is
the one the plain version does, in the same order (numba without fastmath contracts nothing),
so the plans are the plain version's bit for bit (`tests/core/test_frontier_fast_paths.py`
compares them with the plain stand-ins in `tests/core/planner_reference_kit.py`). The max flow's
loops are in `kernels_flow`, rounding, recording and timing plans in `kernels_plans`; a compiled
function here calls only functions of its own module (numba's cache notices a change to the
caller's file only).

Only the planner imports this module (numba takes ~0.3 s to import), and only when a plan first
needs it (`lazy`): the coordinator's service imports the planner at start, not numba. Compiling
every kernel takes ~22 CPU-s on the CI VM, once (`warm`, which `make install` runs, does it
ahead of a first plan): `cache=True` keeps the machine code in
`NUMBA_CACHE_DIR` if set, else beside this file, else (read-only) in numba's user cache; with none
writable, the kernels are compiled in every process. A fresh process with the cache compiles
nothing. A cached function must not call itself (numba's cache segfaulted on reloading the
recursive pairwise sum), hence the explicit stack in `kernels_plans._pairwise`.

Layout: `preds` / `succs` are [n, width] node indices padded with the sentinel n (finish time 0,
latest start the horizon); `topo` a topological order.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = [
    "backward",
    "critical",
    "cut_moves",
    "forward",
    "on_the_way",
    "path_rate",
    "place",
    "reclaim",
    "shrink",
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


LANES = 8
"""Plans reclaimed together by `reclaim` (a row of times per operation, vectorized)."""


@_jit
def reclaim(preds: np.ndarray, succs: np.ndarray, topo: np.ndarray, choices: np.ndarray,
            op_times: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Every plan's slack reclaimed (`Graph.reclaim_many`; `choices` is [n, count]).

    `LANES` plans at a time: the passes' inner loops run over the plans (each plan's numbers
    those of passes of its own: the same max, min and sums).
    """
    n, count = choices.shape
    new = choices.copy()
    times = np.empty(count)
    d = np.empty((n, LANES))
    fin = np.zeros((n + 1, LANES))  # (row n: the sentinel's 0)
    ls = np.empty((n + 1, LANES))  # latest starts (row n: the iteration's time)
    latest = np.empty((n, LANES))  # each operation's latest finish
    start = np.empty(LANES)
    for c0 in range(0, count, LANES):
        for v in range(n):
            for k in range(LANES):
                d[v, k] = op_times[v, choices[v, min(c0 + k, count - 1)]]
        _lanes_forward(preds, topo, d, fin)
        for k in range(LANES):
            ls[n, k] = _lane_max(fin, k, n)
        for i in range(n - 1, -1, -1):
            v = topo[i]
            for k in range(LANES):
                latest[v, k] = ls[succs[v, 0], k]
            for j in range(1, succs.shape[1]):
                for k in range(LANES):
                    x, y = ls[succs[v, j], k], latest[v, k]
                    latest[v, k] = x if x < y else y
            for k in range(LANES):
                ls[v, k] = latest[v, k] - d[v, k]
        for v in topo:
            for k in range(LANES):
                start[k] = fin[preds[v, 0], k]
            for j in range(1, preds.shape[1]):
                for k in range(LANES):
                    x = fin[preds[v, j], k]
                    start[k] = x if x > start[k] else start[k]
            for k in range(LANES):
                c = min(c0 + k, count - 1)
                room = latest[v, k] - start[k] + tol
                # Its slowest option at most `room` long, or its own if faster (ascending).
                pick = choices[v, c]
                while pick + 1 < op_times.shape[1] and op_times[v, pick + 1] <= room:
                    pick += 1
                new[v, c] = pick
                fin[v, k] = start[k] + op_times[v, pick]
        for k in range(min(LANES, count - c0)):
            times[c0 + k] = _lane_max(fin, k, n)
    return new, times


@_jit
def _lanes_forward(preds: np.ndarray, topo: np.ndarray, d: np.ndarray, fin: np.ndarray) -> None:
    """Each lane's earliest finish times (`forward`, lanes as columns of `d`, `fin`)."""
    lanes = d.shape[1]
    for v in topo:
        p = preds[v, 0]
        for k in range(lanes):
            fin[v, k] = fin[p, k]
        for j in range(1, preds.shape[1]):
            p = preds[v, j]
            for k in range(lanes):
                x, y = fin[p, k], fin[v, k]
                fin[v, k] = x if x > y else y
        for k in range(lanes):
            fin[v, k] += d[v, k]


@_jit
def _lane_max(fin: np.ndarray, k: int, n: int) -> float:
    """The latest of lane k's first n finish times."""
    best = fin[0, k]
    for v in range(1, n):
        if fin[v, k] > best:
            best = fin[v, k]
    return best


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
