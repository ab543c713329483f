"""The sweep's plans: rounded to real options and timed, compiled with numba (`frontier`). Pure.

A sweep records tens of thousands of plans on 8 x 96 1F1B (hundreds of thousands interleaved):
each a row of every operation's option, rounded from the sweep's continuous durations
(`round_plans`, whose energies reproduce numpy's pairwise sums to the bit) and timed by one
longest path (`plan_times`). Compiled and cached as `kernels` says (numba's cache notices a
change to a function's own file only, so nothing here calls another module's compiled function).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from coordinator.pipeline.planner.kernels import _jit

__all__ = [
    "Memo",
    "grow",
    "memo",
    "plan_key",
    "plan_times",
    "remember",
    "round_plans",
    "zobrist_tables",
]


@_jit
def _flat(i: int, size: int) -> int:
    """A flat option index as numpy takes it (-1: the last)."""
    return i + size if i < 0 else i


LANES = 8
"""Plans timed together by `plan_times` (a row of finish times per operation, vectorized)."""


@_jit
def plan_times(preds: np.ndarray, topo: np.ndarray, plans: np.ndarray,
               flat_times: np.ndarray, width: int) -> np.ndarray:
    """The iteration time of every plan (rows of `plans`: option indices).

    Node v's option p takes `flat_times[v * width + p]`. `LANES` plans at a time, in one
    forward pass whose inner loops run over the plans (the compiler vectorizes them; ~2x
    faster than a pass per plan); each plan's finish times are those of a forward pass of its
    own (the same max and sum), its time the latest of them.
    """
    count, n = plans.shape
    size = flat_times.size
    out = np.empty(count)
    d = np.empty((n, LANES))
    fin = np.zeros((n + 1, LANES))  # (row n: the sentinel's 0)
    for c0 in range(0, count, LANES):
        for v in range(n):
            for k in range(LANES):
                c = c0 + k if c0 + k < count else count - 1  # (Spare lanes: the last plan.)
                d[v, k] = flat_times[_flat(v * width + plans[c, v], size)]
        for v in topo:
            p = preds[v, 0]
            for k in range(LANES):
                fin[v, k] = fin[p, k]
            for j in range(1, preds.shape[1]):
                p = preds[v, j]
                for k in range(LANES):
                    x, y = fin[p, k], fin[v, k]
                    fin[v, k] = x if x > y else y
            for k in range(LANES):
                fin[v, k] += d[v, k]
        for k in range(min(LANES, count - c0)):
            best = fin[0, k]
            for v in range(1, n):
                if fin[v, k] > best:
                    best = fin[v, k]
            out[c0 + k] = best
    return out


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


class Memo(NamedTuple):
    """What `round_plans` keeps of each operation between rows and calls (`memo`).

    An operation's rounding depends on its duration alone, which most rows keep: each field is
    redone only where the duration changed.
    """

    dur: np.ndarray  # [n] the last duration rounded (nan: none yet)
    choice: np.ndarray  # [n] int64, its option (the slowest at least as fast)
    cost: np.ndarray  # [n] that option's cost
    state: np.ndarray  # [n] int8: 0 on the option, 1 rounded (no slower one), 2 rounded
    up: np.ndarray  # [n] the slower option (state 2)
    extra: np.ndarray  # [n] its extra cost
    frac: np.ndarray  # [n] the duration's fraction of the way to it
    flip: np.ndarray  # [n, 2] uint64: the key's change from the option to the slower one
    key: np.ndarray  # [2] uint64: the key of the plan `choice`
    rounded: np.ndarray  # [1] int64: operations in state 1 or 2


def memo(zobrist: np.ndarray) -> Memo:
    """A fresh `Memo` for the operations of `zobrist` (every choice 0 until rounded)."""
    n = zobrist.shape[1]
    choice = np.zeros(n, dtype=np.int64)
    return Memo(np.full(n, np.nan), choice, np.zeros(n), np.zeros(n, dtype=np.int8),
                np.zeros(n, dtype=np.int64), np.zeros(n), np.zeros(n),
                np.zeros((n, 2), dtype=np.uint64), plan_key(zobrist, choice),
                np.zeros(1, dtype=np.int64))


@_jit
def _round_op(v: int, x: float, eps_t: float, ladder: np.ndarray, below: np.ndarray,
              kind: np.ndarray, flat_times: np.ndarray, flat_costs: np.ndarray, width: int,
              zobrist: np.ndarray, mo: Memo) -> None:
    """Operation v rounded anew, at duration x (`Memo`)."""
    size = flat_times.size
    mo.dur[v] = x
    c = below[kind[v], _count_upto(ladder, x + eps_t)] - 1
    if c != mo.choice[v]:
        for h in range(2):
            mo.key[h] ^= zobrist[h, v, mo.choice[v] + 1] ^ zobrist[h, v, c + 1]
        mo.choice[v] = c
    low_at = _flat(v * width + c, size)
    mo.cost[v] = flat_costs[low_at]
    state = 0
    if flat_times[low_at] != x:
        state = 1
        up = min(c + 1, width - 1)
        if up != c:
            state = 2
            high_at = _flat(v * width + up, size)
            mo.up[v] = up
            for h in range(2):
                mo.flip[v, h] = zobrist[h, v, c + 1] ^ zobrist[h, v, up + 1]
            mo.extra[v] = flat_costs[high_at] - flat_costs[low_at]
            low_t, high_t = flat_times[low_at], flat_times[high_at]
            mo.frac[v] = (x - low_t) / (high_t - low_t)
            if not np.isfinite(high_t):
                mo.frac[v] = 0.0
    mo.rounded[0] += (state > 0) - (mo.state[v] > 0)
    mo.state[v] = state


@_jit
def round_plans(durs: np.ndarray, horizons: np.ndarray, eps_t: float, ladder: np.ndarray,
                below: np.ndarray, kind: np.ndarray, flat_times: np.ndarray,
                flat_costs: np.ndarray, width: int, taus: np.ndarray, zobrist: np.ndarray,
                mo: Memo, table: np.ndarray,
                used: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of `durs` rounded to real options, and the plans rounded the other way.

    (`frontier._Candidates.record_many`.) Per row: the plan of each operation's slowest option
    at least as fast as planned (time: the row's horizon when nothing was rounded, else nan:
    timed later), then, if any was rounded, the plans where each rounded operation that has a
    slower option takes it when at least `taus` (descending) of the way there, and all of
    them, each unless the last one was the same plan. Of those, the plans never met before
    (their keys not in the hash set `table`, `used`: `remember`; the caller leaves room for
    them all), as (plans [k, n] int16, times, costs), in the plain version's order with its
    sums. `mo` (`Memo`) is kept between calls.
    """
    count, n = durs.shape
    nt = taus.size
    plans = np.empty((count * (nt + 2), n), dtype=np.int16)
    times = np.empty(count * (nt + 2))
    costs = np.empty(count * (nt + 2))
    key = np.empty((1, 2), dtype=np.uint64)  # (the plan's key)
    moved = np.empty(n, dtype=np.int64)
    picked = np.empty(n)
    k = 0
    for r in range(count):
        for v in range(n):
            if durs[r, v] != mo.dur[v]:  # (Most operations keep their duration.)
                _round_op(v, durs[r, v], eps_t, ladder, below, kind, flat_times, flat_costs,
                          width, zobrist, mo)
        energy = _np_sum(mo.cost)
        m = 0
        if mo.rounded[0]:
            for v in range(n):
                if mo.state[v] == 2:
                    moved[m] = v
                    m += 1
        key[0] = mo.key
        if _insert(table, used, key[0, 0], key[0, 1]):
            plans[k] = mo.choice
            times[k] = np.nan if mo.rounded[0] else horizons[r]
            costs[k] = energy
            k += 1
        # The mixes (a threshold each, when more than one operation can move), then all.
        # (The masks grow with t: one as large as the last is the same plan, a duplicate.)
        first = 0 if m > 1 else nt
        last_hits = 0
        for t in range(first, nt + 1 if m else first):
            hits = 0
            key[0] = mo.key
            for i in range(m):
                v = moved[i]
                if t == nt or mo.frac[v] >= taus[t]:
                    key[0, 0] ^= mo.flip[v, 0]
                    key[0, 1] ^= mo.flip[v, 1]
                    picked[hits] = mo.extra[v]
                    hits += 1
            if hits > last_hits:
                last_hits = hits
                if _insert(table, used, key[0, 0], key[0, 1]):
                    plans[k] = mo.choice
                    for i in range(m):
                        v = moved[i]
                        if t == nt or mo.frac[v] >= taus[t]:
                            plans[k, v] = mo.up[v]
                    times[k] = np.nan
                    costs[k] = energy + _np_sum(picked[:hits])
                    k += 1
    return plans[:k], times[:k], costs[:k]


def zobrist_tables(n: int, width: int) -> np.ndarray:
    """Random 64-bit words [2, n, width + 1]: entry (h, v, c + 1) for operation v at option c.

    A plan's key (`plan_key`) is the exclusive or, per half, of its operations' words: equal
    plans have equal keys, and two plans that differ anywhere have equal keys with probability
    2^-128 (the words are independent and uniform), as with the 128-bit blake2b digest it
    replaces. Seeded: the same keys in every run.
    """
    rng = np.random.default_rng(0x7E25E05)
    return rng.integers(0, np.iinfo(np.uint64).max, size=(2, n, width + 1), dtype=np.uint64,
                        endpoint=True)


def plan_key(zobrist: np.ndarray, plan: np.ndarray) -> np.ndarray:
    """The key [2] (uint64) of one plan (option indices), in numpy (`round_plans` updates it)."""
    words = zobrist[:, np.arange(plan.size), plan.astype(np.int64) + 1]
    return np.bitwise_xor.reduce(words, axis=1)


@_jit
def _insert(table: np.ndarray, used: np.ndarray, k0: np.uint64, k1: np.uint64) -> bool:
    """Add key (k0, k1) to the hash set (`remember`): whether it was not there."""
    mask = used.size - 1
    i = np.int64(k0 & np.uint64(mask))
    while used[i] and not (table[i, 0] == k0 and table[i, 1] == k1):
        i = (i + 1) & mask
    if used[i]:
        return False
    used[i] = True
    table[i, 0], table[i, 1] = k0, k1
    return True


@_jit
def remember(table: np.ndarray, used: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Which rows of `keys` are new, each then added to the hash set (`table`, `used`).

    Open addressing on the first half, probing linearly; the caller keeps the set at most
    half full (`grow`). A key repeated within `keys` is new once.
    """
    fresh = np.zeros(keys.shape[0], dtype=np.bool_)
    for r in range(keys.shape[0]):
        fresh[r] = _insert(table, used, keys[r, 0], keys[r, 1])
    return fresh


@_jit
def grow(table: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hash set of `remember` in twice the room."""
    bigger = np.zeros((2 * used.size, 2), dtype=np.uint64)
    taken = np.zeros(2 * used.size, dtype=np.bool_)
    remember(bigger, taken, table[used])
    return bigger, taken
