"""Tune `Adaptive`'s defaults by K-fold cross-validation across workloads, robust to the noise.

Profiles: the 12 reference profiles (`data/reference-profiles/`) and the 121 Zeus NSDI '23 traces
(`data/power-traces/`), replayed exactly as `bench/power_limit_search.py` does (same selector grid,
1% Gaussian noise per 40-step window on time and on energy). Four disjoint sets of noise seeds,
none of which the bench scores (it uses 0, 1, ...):
* tuning seeds (100, 101, ...): every candidate is scored over all of them (each seed is one noise
  draw of every case), and the coordinate descent moves on these scores;
* selection seeds (150, 151, ...): the `FINALISTS` best settings of the descent are scored again
  on these and the best there is the pick. A pick made on the tuning seeds alone is the setting
  that best fits THOSE draws (the previous tuning lost ~0.5 point between its tuning seeds and
  fresh ones); fresh seeds judge the finalists without that bias;
* out-of-fold seeds (200, 201, ...): the held-out fold is scored on these only;
* tail seeds (600, 601, ...): the tail stage (step 3) scores its grid on these.

Procedure (all of it runs inside every fold, so the out-of-fold figures are honest):

1. Candidate pool, independent of the data: the previous defaults (`PREVIOUS_DEFAULTS`) and
   `--candidates` settings drawn from `SPACE` with a fixed random seed; replayed on every profile.
   Settings outside `SPACE` are `FIXED`.
2. Folds by workload family (the network: bert, deepspeech2, ncf, resnet, shufflenetv2), reference
   profiles and traces together (`--folds gpu`: by GPU model instead, reported only). For each
   fold, `tune` uses ONLY the other folds' profiles: from the `STARTS` best settings of the pool,
   coordinate descent over `SPACE` (`PASSES` passes, tuning seeds), then the finalists on the
   selection seeds. A pass that keeps no single change tries pair moves (`pair_moves`): each of the
   `PAIR_FLAGS` best changes that beat the score but for the time cap (e.g. the guard `k_guard`)
   together with each of the `PAIR_PARTNERS` changes of another setting that cut the time (e.g.
   `confirm` 0.5) whose pair would score best if the effects added up: a dozen pairs instead of the
   ~350 of every pair. "Best" is `score`: the within-1% share minus `TAIL_WEIGHT` x the share of
   cases with a regret above 3% (a smooth stand-in for the worst regret, whose maximum over a few
   seeds is mostly noise), with steep penalties beyond a time ratio of `TIME_CAP` and a worst
   regret of `WORST_CAP` (`TIME_CAP` with a margin under the goal 0.5, for profiles never seen;
   `WORST_CAP` at the goal, 5%: with a 4.5% cap, tried on 2026-11-23, the tuner's out-of-fold
   worst fell to 4.83% but the bench's replay of the folds with other seeds read 5.1%, and the
   final pick lost 0.9 point within 1% on the traces: the maximum is noise at this level, and
   the within-1% share is not). The descent tunes `k_guard` too, but the tail stage has the last
   word on it (below): fixing it at 2.5 before the descent (tried twice) made the descent's
   other choices worse (93.85% and 93.69% within 1% out of fold, worst 5.21% both times).
3. The tail stage (`tail_stage`), on the same training profiles: every combination of
   `TAIL_SPACE` (the guard extension `guard_extend`, off in the descent, `k_refine` and
   `tolerance`, which it trades time against, and the guard `k_guard` on or off: the descent
   turned it off in one fold, which left that fold's worst case at 6.3% over 100 seeds) on top
   of the descent's pick, scored on the tail
   seeds (600, 601, ...; 20 by default, 4x the descent's) by `tail_score`: `score` minus
   `TAIL4_WEIGHT` x the share of cases with a regret above 4%. The descent's 5 seeds hold a
   handful of such cases per setting, too few to see what the guard extension does to them (over
   100 seeds of every profile it halves them, at ~0.018 of the exhaustive time), while the time
   it costs shows on any seed: without this stage the descent never takes it.
4. The fold's pick is scored on the held-out fold with the out-of-fold seeds, next to the noisy
   exhaustive search on the same cases. Pooled over folds, these are the out-of-fold
   (generalization) figures, also per seed (`spread`).
5. The shipped defaults are `tune` and `tail_stage` run on all profiles. `--write` stores the
   folds' settings, their out-of-fold figures and the final settings (with the descent's pick
   before the tail stage and the stage's grid) in `data/power-traces/adaptive_search_cv.json`;
   `bench/power_limit_search.py` replays each fold's settings on its held-out profiles through the
   state machine in its `cross_validation` block (with its own seeds).

The replay here (`fast_replay`) calls the search directly instead of driving
`PowerLimitStateMachine` step by step; with records arriving at once and no epoch ends it is the
same replay (same probes, same noise draws, same pick, same time; `--verify` checks it on a sample
and a test does too).

`--descent-from JSON` skips steps 1-2: each fold's (and the final) descent pick is read from an
earlier record and only the tail stage runs on it. The current record was made so, from the
descent picks of the previous one (commit 6f6bbd3, made by the full procedure); its folds keep
their `descent_params` and `tail_stage` grid.

Cost: about 1 s per candidate per seed on one core (931 cases per seed); with two workers the
default run takes ~40 minutes (the descent ~17, the tail stage ~3-4 per fold), with
`--descent-from` ~19.

Usage: python bench/tune_adaptive_search.py [--candidates N] [--tuning-seeds N]
       [--selection-seeds N] [--seeds N] [--tail-seeds N] [--jobs N] [--folds family|gpu]
       [--descent-from JSON] [--quick] [--verify]
       [--write] [--restamp] [--worst N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time as wallclock
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _common import machine, now  # noqa: E402
from power_limit_search import (  # noqa: E402
    REFERENCE_STEPS,
    WARMUP_STEPS,
    Profile,
    Replay,
    Tally,
    load_reference_profiles,
    load_trace_profiles,
    replay,
    selector_grid,
    tally,
)

from coordinator.power_limit import Adaptive, OptimumSelector, SearchStrategy  # noqa: E402
from coordinator.power_limit.search import (  # noqa: E402
    WindowResult,
    aggregate,
    cost_function,
    resolve_search,
)

CV_FILE = ROOT / "data" / "power-traces" / "adaptive_search_cv.json"
SIGMA = 0.01
TUNING_SEED_BASE = 100  # Coordinate descent: seeds 100, 101, ...
SELECTION_SEED_BASE = 150  # Choosing among the finalists: seeds 150, 151, ...
OOF_SEED_BASE = 200  # Out-of-fold scoring: seeds 200, 201, ... (the bench scores 0, 1, ...)
TAIL_SEED_BASE = 600  # The tail stage: seeds 600, 601, ...
TIME_CAP = 0.46  # The goal is 0.5; the margin is for profiles the tuning never saw.
WORST_CAP = 0.05  # The goal, 5%; a guard only (the max of a few seeds is too noisy to tune on).
TAIL_WEIGHT = 3.0  # Within-1% points lost per point of cases with a regret above 3%.
TAIL4_WEIGHT = 20.0  # The tail stage: within-1% points lost per point of cases above 4%.
PENALTY = 10.0  # Within-1% points lost per unit over a cap: the caps act as constraints.
MIN_GAIN = 0.001  # Smallest score gain that moves the coordinate descent.
PASSES = 2
STARTS = 1
FINALISTS = 4
PAIR_FLAGS = 2  # Flagged single changes (better but over the time cap) paired up.
PAIR_PARTNERS = 6  # Cheaper changes of other settings each flagged change is paired with.
POOL_SEED = 2025

FIXED: dict[str, Any] = {
    "noise": 0.01,
    "tolerance": 0.01,
    "k_stop": 4.0,
    "rel_stop": 0.02,
    "patience": 3,
    "big_rise": 0.3,
    "budget": 0.0,
    "guard_regret": 0.03,
    "k_guard_extend": 3.0,
    "guard_extend": 0.0,
}
"""Settings the descent does not tune: `noise` (the assumed 1%), the stop rule (`k_stop`,
`rel_stop`, `patience`, `big_rise`: the descent almost never stops on the wrong side of the
optimum, and they barely move the time), `tolerance` (1%, the goal's own; the tail stage may
loosen it), `budget` (none: a per-case cap starves the cases that need the time) and
`guard_regret` (3%: the tail the score counts; `k_guard`, whether and how hard the guard looks,
is tuned)."""

PREVIOUS_DEFAULTS: dict[str, Any] = {
    "chunk": 0.1,
    "ext_ratio": 2.0,
    "max_steps": 2.0,
    "refine_steps": 0.25,
    "k_ambiguous": 1.5,
    "steep": 0.03,
    "k_refine": 1.5,
    "max_refines": 6,
    "confirm": 0.5,
    "focused_refinement": True,
    "settle": 0.75,
    "k_guard": 2.5,
}
"""Adaptive's defaults before this tuning (the previous cross-validated pick, 6f6bbd3)."""

TAIL_SPACE: dict[str, tuple[Any, ...]] = {
    "guard_extend": (0.3, 0.5, 0.6),
    "k_refine": (1.0, 1.25),
    "tolerance": (0.01, 0.0125),
    "k_guard": (0.0, 2.5),
}
"""The tail stage's grid: the guard extension, the refinement and tolerance it trades time
against, and the guard on or off (every combination, 24, on top of the coordinate descent's
pick). The guard is here because the descent's 5 seeds cannot see what it is for: the bert
fold's descent turned it off (it costs time on every seed), and out of fold over 100 seeds
(800-899) that fold then had the worst case, 6.31%; over the tail seeds every fold keeps it
(2026-11-24). Left out to bound the grid: `k_refine` 1.5 (over the time cap in most folds) and
no extension (0.0, which an earlier grid picked in two folds, leaving their tail as it was)."""

INF = math.inf
SPACE: dict[str, tuple[Any, ...]] = {
    "chunk": (0.1, 0.125, 0.15, 0.2),
    "ext_ratio": (1.5, 2.0, 3.0),
    "max_steps": (1.0, 1.5, 2.0),
    "refine_steps": (0.25, 0.375),
    "k_ambiguous": (1.5, 2.0, 2.5),
    "steep": (INF, 0.03, 0.05, 0.08),
    "k_refine": (1.0, 1.25, 1.5, 1.75, 2.0),
    "max_refines": (2, 3, 4, 5, 6),
    "confirm": (0.5, 0.75),
    "focused_refinement": (False, True),
    "settle": (0.0, 0.75, 1.0, 1.25),
    "k_guard": (0.0, 2.5, 3.0),
}
"""Values each tuned setting may take (a smaller space than the first tuning's: fewer chances to
fit the noise of the tuning seeds)."""


def candidate_pool(n: int, seed: int = POOL_SEED) -> list[dict[str, Any]]:
    """The previous defaults and `n` distinct settings drawn from `SPACE` (no data involved)."""
    rng = random.Random(seed)
    pool = [dict(PREVIOUS_DEFAULTS)]
    seen = {json.dumps(encode(pool[0]), sort_keys=True)}
    while len(pool) < n + 1:
        params = {name: rng.choice(values) for name, values in SPACE.items()}
        if params["max_steps"] < params["chunk"]:
            continue
        key = json.dumps(encode(params), sort_keys=True)
        if key not in seen:
            seen.add(key)
            pool.append(params)
    return pool


def full(params: dict[str, Any]) -> dict[str, Any]:
    """All of `Adaptive`'s settings: the tuned ones and `FIXED`."""
    return {**FIXED, **params}


def encode(params: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe settings: infinity as the string "inf"."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in params.items()}


def decode(params: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `encode`."""
    return {k: (math.inf if v == "inf" else v) for k, v in params.items()}


def fast_replay(
    profile: Profile,
    selector: OptimumSelector,
    search: str | SearchStrategy,
    *,
    rng: random.Random,
    sigma: float,
    windows: list[WindowResult] | None = None,
) -> Replay:
    """The bench's replay without the state machine (records at once, no epoch ends).

    Same probes, same noise draws (time then energy per window), same pick and same spent time
    as `power_limit_search.replay`. The recorded windows are appended to `windows` if given.
    """
    strategy = resolve_search(search)
    plan = strategy.plan(list(profile.limits), WARMUP_STEPS, REFERENCE_STEPS, selector)
    results: list[WindowResult] = []
    spent = 0.0
    while (probe := plan.next_probe(tuple(results), len(results))) is not None:
        limit, steps = probe.power_limit, probe.profile_steps
        for _ in range(probe.warmup_steps + steps):
            spent += profile.time[limit] / REFERENCE_STEPS
        scale = steps / REFERENCE_STEPS
        noise = sigma * math.sqrt(REFERENCE_STEPS / steps)
        t = profile.time[limit] * scale * (1 + rng.gauss(0, noise))
        e = profile.energy[limit] * scale * (1 + rng.gauss(0, noise))
        results.append(WindowResult(limit, steps, t, e))
    if windows is not None:
        windows.extend(results)
    pick = selector.select(aggregate(results, REFERENCE_STEPS))
    profiled = tuple(sorted({r.power_limit for r in results}, reverse=True))
    return Replay(pick, spent, len(results), profiled)


# Parallel evaluation ------------------------------------------------------------------------------

_PROFILES: list[Profile] = []


def _init(profiles: list[Profile]) -> None:
    global _PROFILES
    _PROFILES = profiles


def _per_profile(job: tuple[str, tuple[int, ...]]) -> list[Tally]:
    key, seeds = job
    search: str | SearchStrategy = key if key == "exhaustive" else Adaptive(**full(params_of(key)))
    return [tally([p], search, seeds, SIGMA, fast_replay) for p in _PROFILES]


def key_of(params: dict[str, Any]) -> str:
    return json.dumps(encode(params), sort_keys=True)


def params_of(key: str) -> dict[str, Any]:
    return decode(json.loads(key))


class Evaluator:
    """Per-profile tallies of settings on every profile (tuning seeds), memoized."""

    def __init__(self, profiles: list[Profile], seeds: Sequence[int], workers: int) -> None:
        self.profiles = profiles
        self.seeds = tuple(seeds)
        self.memo: dict[str, list[Tally]] = {}
        self.pool = (
            ProcessPoolExecutor(workers, initializer=_init, initargs=(profiles,))
            if workers > 1
            else None
        )
        _init(profiles)

    def __call__(self, settings: Sequence[dict[str, Any] | str]) -> list[list[Tally]]:
        keys = [s if isinstance(s, str) else key_of(s) for s in settings]
        todo = [k for k in dict.fromkeys(keys) if k not in self.memo]
        jobs = [(k, self.seeds) for k in todo]
        done = self.pool.map(_per_profile, jobs) if self.pool else map(_per_profile, jobs)
        self.memo.update(zip(todo, done, strict=True))
        return [self.memo[k] for k in keys]

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()


def pooled(tallies: Sequence[Tally], mask: Sequence[bool]) -> Tally:
    out = Tally()
    for t, keep in zip(tallies, mask, strict=True):
        if keep:
            out.add(t)
    return out


def score(summary: dict[str, float]) -> tuple[float, float]:
    """Training objective, higher is better: the within-1% share, minus `TAIL_WEIGHT` x the share
    of cases with a regret above 3%, minus steep penalties beyond `TIME_CAP` and `WORST_CAP` (so
    the caps act as constraints); ties go to less time."""
    over = max(0.0, summary["time_ratio"] - TIME_CAP) + max(
        0.0, summary["worst_regret"] - WORST_CAP
    )
    return (
        summary["within_1pct"] - TAIL_WEIGHT * summary["tail_3pct"] - PENALTY * over,
        -summary["time_ratio"],
    )


def quality(summary: dict[str, float]) -> float:
    """`score` without its time penalty: what a setting would score if its time were free."""
    return (
        summary["within_1pct"]
        - TAIL_WEIGHT * summary["tail_3pct"]
        - PENALTY * max(0.0, summary["worst_regret"] - WORST_CAP)
    )


def pair_moves(
    current: dict[str, Any],
    current_summary: dict[str, float],
    singles: Sequence[tuple[str, dict[str, Any], dict[str, float]]],
) -> list[dict[str, Any]]:
    """Pairs of one-setting changes worth trying once the one-at-a-time moves are stuck.

    `singles` are the single changes just tried from `current` (setting name, settings, summary).
    A change is *flagged* when it would have been kept but for the time cap (its `quality` beats
    the current one's by more than `MIN_GAIN`, its `score` does not). Each is paired with the
    `PAIR_PARTNERS` changes of OTHER settings that cut the time (a cheaper setting may pay for
    the flagged one) whose pair would score best if the two changes' effects added up (quality
    and time); the `PAIR_FLAGS` flagged changes (at most one per setting) with the best such
    guess are tried. So a stuck descent tries at most `PAIR_FLAGS` x `PAIR_PARTNERS` pairs, not
    every pair.
    """
    base_quality = quality(current_summary)
    base_score = score(current_summary)[0]

    def guess(flag: dict[str, float], partner: dict[str, float]) -> float:
        # The pair's score if the two changes added up (quality and time).
        keys = ("within_1pct", "tail_3pct", "worst_regret", "time_ratio")
        return score({k: flag[k] + partner[k] - current_summary[k] for k in keys})[0]

    # Per flagged change: its partners, best guessed pair first.
    options: list[tuple[float, str, dict[str, Any], list[tuple[str, dict[str, Any]]]]] = []
    for name, trial, summary in singles:
        held_back = score(summary)[0] <= base_score + MIN_GAIN
        if not (held_back and quality(summary) > base_quality + MIN_GAIN):
            continue
        partners = sorted(
            (
                (guess(summary, other), other_name, other_trial)
                for other_name, other_trial, other in singles
                if other_name != name and other["time_ratio"] < current_summary["time_ratio"]
            ),
            key=lambda x: x[0],
            reverse=True,
        )[:PAIR_PARTNERS]
        if partners:
            options.append((partners[0][0], name, trial, [(n, t) for _, n, t in partners]))
    # The `PAIR_FLAGS` flagged changes (one per setting) with the best guessed pairs.
    options.sort(key=lambda x: x[0], reverse=True)
    pairs: list[dict[str, Any]] = []
    seen: set[str] = set()
    flagged: set[str] = set()
    for _, name, trial, partners in options:
        if name in flagged or len(flagged) >= PAIR_FLAGS:
            continue
        flagged.add(name)
        for partner_name, partner in partners:
            pair = {**trial, partner_name: partner[partner_name]}
            key = key_of(pair)
            if pair["max_steps"] >= pair["chunk"] and key not in seen:
                seen.add(key)
                pairs.append(pair)
    return pairs


def coordinate_descent(
    start: dict[str, Any], mask: Sequence[bool], evaluate: Evaluator
) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    """Improve settings one at a time over `SPACE`, scored on the profiles in `mask` only, with
    pair moves (`pair_moves`) when one-at-a-time moves are stuck.

    A change is kept if it raises the score by more than `MIN_GAIN`; at most `PASSES` passes.
    A pass that keeps no single change tries the pairs of its flagged changes (better but over
    the time cap) with cheaper changes of other settings; if one is kept, the next pass starts
    from it.

    Returns:
        The settings, and every setting evaluated (by key) with its score.
    """
    current = dict(start)
    current_summary = pooled(evaluate([current])[0], mask).summary()
    current_score = score(current_summary)
    seen = {key_of(current): current_score}
    for _ in range(PASSES):
        moved = False
        singles: list[tuple[str, dict[str, Any], dict[str, float]]] = []
        for name, values in SPACE.items():
            trials = [{**current, name: v} for v in values if v != current[name]]
            trials = [t for t in trials if t["max_steps"] >= t["chunk"]]
            if not trials:
                continue
            summaries = [pooled(r, mask).summary() for r in evaluate(trials)]
            scores = [score(s) for s in summaries]
            seen.update(zip(map(key_of, trials), scores, strict=True))
            singles.extend((name, t, s) for t, s in zip(trials, summaries, strict=True))
            i = max(range(len(trials)), key=lambda j: scores[j])
            if scores[i][0] > current_score[0] + MIN_GAIN:
                current, current_summary, current_score = trials[i], summaries[i], scores[i]
                moved = True
        if not moved:
            # Every single change was tried from `current` (it did not move): pairs.
            pairs = pair_moves(current, current_summary, singles)
            if pairs:
                summaries = [pooled(r, mask).summary() for r in evaluate(pairs)]
                scores = [score(s) for s in summaries]
                seen.update(zip(map(key_of, pairs), scores, strict=True))
                i = max(range(len(pairs)), key=lambda j: scores[j])
                if scores[i][0] > current_score[0] + MIN_GAIN:
                    current, current_summary, current_score = pairs[i], summaries[i], scores[i]
                    moved = True
        if not moved:
            break
    return current, seen


def tune(
    pool: list[dict[str, Any]],
    pool_tallies: list[list[Tally]],
    mask: Sequence[bool],
    evaluate: Evaluator,
    select: Evaluator,
) -> dict[str, Any]:
    """The whole tuning on the profiles in `mask`.

    Coordinate descent (tuning seeds) from each of the `STARTS` best settings of the pool; then
    the `FINALISTS` best settings it evaluated are scored again on other seeds (selection seeds)
    and the best there wins, so the pick is not the one that happened to fit the tuning seeds'
    noise best.

    Returns:
        starts (pool indices), finalists (key, tuning score, selection score), the pick, and the
        number of settings evaluated.
    """
    ranked = sorted(
        range(len(pool)),
        key=lambda i: score(pooled(pool_tallies[i], mask).summary()),
        reverse=True,
    )
    starts = ranked[:STARTS]
    seen: dict[str, tuple[float, float]] = {}
    for i in starts:
        _, trials = coordinate_descent(pool[i], mask, evaluate)
        seen.update(trials)
    finalists = sorted(seen, key=lambda k: seen[k], reverse=True)[:FINALISTS]
    again = [score(pooled(t, mask).summary()) for t in select(finalists)]
    pick = max(range(len(finalists)), key=lambda i: again[i])
    return {
        "pool_starts": starts,
        "evaluated": len(seen),
        "finalists": [
            {"params": json.loads(k), "tuning_score": seen[k][0], "selection_score": again[i][0]}
            for i, k in enumerate(finalists)
        ],
        "params": params_of(finalists[pick]),
    }


def tail_score(summary: dict[str, float]) -> tuple[float, float]:
    """The tail stage's objective: `score`, minus `TAIL4_WEIGHT` x the share of cases with a
    regret above 4% (near misses of the 5% goal, which only many seeds count reliably)."""
    first, time = score(summary)
    return first - TAIL4_WEIGHT * summary["tail_4pct"], time


def tail_stage(params: dict[str, Any], mask: Sequence[bool], evaluate: Evaluator) -> dict[str, Any]:
    """Every combination of `TAIL_SPACE` on top of `params`, scored by `tail_score` on the
    profiles in `mask` with the tail seeds; returns the grid's figures and the best settings.

    The coordinate descent's few seeds hold ~20 cases above 3% and a handful above 4%: too few to
    see the guard extension's effect (it halves the cases above 4% in-sample, over 100 seeds),
    while its time is plain on any seed. Hence this stage, with 4x the seeds on a small grid.
    """
    grid = [
        {**params, **dict(zip(TAIL_SPACE, values, strict=True))}
        for values in itertools.product(*TAIL_SPACE.values())
    ]
    summaries = [pooled(t, mask).summary() for t in evaluate(grid)]
    scores = [tail_score(sm) for sm in summaries]
    pick = max(range(len(grid)), key=lambda i: scores[i])
    keys = ("within_1pct", "tail_3pct", "tail_4pct", "worst_regret", "time_ratio")
    return {
        "grid": [
            {
                "settings": {k: g[k] for k in TAIL_SPACE},
                "score": round(sc[0], 5),
                **{k: sm[k] for k in keys},
            }
            for g, sc, sm in zip(grid, scores, summaries, strict=True)
        ],
        "params": grid[pick],
    }


def _fold_of(record: dict[str, Any], family: str) -> dict[str, Any]:
    """The fold of `family` in a written record."""
    return next(f for f in record["folds"] if f["family"] == family)


def fold_key(profile: Profile, by: str) -> str:
    """The fold a profile belongs to: its workload family, or (`--folds gpu`) its GPU model."""
    return profile.family if by == "family" else profile.gpu


def _line(label: str, a: dict[str, float], e: dict[str, float]) -> str:
    return (
        f"{label}: within {a['within_1pct']:.2%} (exhaustive {e['within_1pct']:.2%})  "
        f"worst {a['worst_regret']:.1%}  time {a['time_ratio']:.1%} "
        f"(per case {a['mean_case_time_ratio']:.1%})"
    )


def spread(per_seed: Sequence[tuple[Tally, Tally]]) -> dict[str, object]:
    """Per-seed figures (adaptive vs exhaustive on the same cases) and their range."""
    rows = []
    for a, e in per_seed:
        sa, se = a.summary(), e.summary()
        rows.append(
            {
                "within_1pct": sa["within_1pct"],
                "exhaustive_within_1pct": se["within_1pct"],
                "difference": round(sa["within_1pct"] - se["within_1pct"], 4),
                "worst_regret": sa["worst_regret"],
                "time_ratio": sa["time_ratio"],
            }
        )
    return {
        "per_seed": rows,
        "difference_range": [
            min(r["difference"] for r in rows),
            max(r["difference"] for r in rows),
        ],
        "worst_regret_range": [
            min(r["worst_regret"] for r in rows),
            max(r["worst_regret"] for r in rows),
        ],
        "time_ratio_range": [
            min(r["time_ratio"] for r in rows),
            max(r["time_ratio"] for r in rows),
        ],
    }


def goals_met(a: dict[str, float], e: dict[str, float]) -> dict[str, bool]:
    return {
        "within_1pct": a["within_1pct"] >= e["within_1pct"] - 0.01 - 1e-9,
        "worst_regret": a["worst_regret"] <= 0.05,
        "time_ratio": a["time_ratio"] <= 0.5,
    }


def restamp(path: Path = CV_FILE) -> dict[str, object]:
    """Set `shipped_defaults_match` in the written record to whether `Adaptive()`'s defaults
    are its `final.params` now (after they were copied into the code); nothing else changes."""
    record: dict[str, object] = json.loads(path.read_text())
    final = record["final"]
    assert isinstance(final, dict)
    record["shipped_defaults_match"] = Adaptive(**decode(final["params"])) == Adaptive()
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{path.relative_to(ROOT)}: shipped_defaults_match = {record['shipped_defaults_match']}")
    return record


def worst_cases(n: int, path: Path = CV_FILE) -> list[dict[str, object]]:
    """The `n` out-of-fold cases of the written record with the largest regret.

    Each fold's settings replayed on its held-out profiles with the record's scoring seeds (as
    the tuning scored them): profile, selector, seed, regret, the optimum and the pick, the true
    and the measured cost of every profiled limit (relative to the optimum's, with its steps),
    and the windows in order (limit/steps). Prints them and returns them.
    """
    record = json.loads(path.read_text())
    profiles = load_reference_profiles() + load_trace_profiles()
    cases: list[dict[str, object]] = []
    for fold in record["folds"]:
        search = Adaptive(**decode(fold["params"]))
        for profile in (p for p in profiles if p.family == fold["family"]):
            truth = profile.measurements()
            for label, selector in selector_grid(profile.n_gpus):
                cost = cost_function(selector)
                assert cost is not None
                true_costs = cost(truth)
                optimum = selector.select(truth)
                for seed in record["scoring_seeds"]:
                    rng = random.Random(f"{profile.name}|{label}|{seed}|{record['sigma']}")
                    windows: list[WindowResult] = []
                    result = fast_replay(
                        profile, selector, search, rng=rng, sigma=record["sigma"], windows=windows
                    )
                    regret = true_costs[result.pick] / true_costs[optimum] - 1
                    cases.append(
                        {
                            "regret": regret,
                            "profile": profile.name,
                            "selector": label,
                            "seed": seed,
                            "optimum": optimum,
                            "pick": result.pick,
                            "windows": windows,
                            "true": true_costs,
                            "measured": cost(aggregate(windows, REFERENCE_STEPS)),
                        }
                    )
    cases.sort(key=lambda c: -float(c["regret"]))  # type: ignore[arg-type]
    for c in cases[:n]:
        windows = c["windows"]
        true, measured = c["true"], c["measured"]
        assert isinstance(windows, list) and isinstance(true, dict) and isinstance(measured, dict)
        base = true[c["optimum"]]
        steps: dict[int, int] = {}
        for w in windows:
            steps[w.power_limit] = steps.get(w.power_limit, 0) + w.steps
        print(
            f"{c['regret']:.2%}  {c['profile']}  {c['selector']}  seed {c['seed']}: optimum "
            f"{c['optimum']} W, pick {c['pick']} W"
        )
        print("  true:     " + " ".join(f"{pl}:{true[pl] / base - 1:+.1%}" for pl in true))
        print(
            "  measured: "
            + " ".join(
                f"{pl}:{measured[pl] / base - 1:+.1%}({steps[pl]})"
                for pl in sorted(measured, reverse=True)
            )
        )
        print("  windows:  " + " ".join(f"{w.power_limit}/{w.steps}" for w in windows))
    return cases[:n]


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=24, help="random settings in the pool")
    parser.add_argument("--tuning-seeds", type=int, default=5, help="seeds of the descent")
    parser.add_argument("--selection-seeds", type=int, default=5, help="seeds of the finalists")
    parser.add_argument("--seeds", type=int, default=10, help="out-of-fold scoring seeds")
    parser.add_argument("--jobs", type=int, default=1, help="processes")
    parser.add_argument("--tail-seeds", type=int, default=20, help="seeds of the tail stage")
    parser.add_argument(
        "--descent-from",
        type=Path,
        metavar="JSON",
        help="skip the pool and the coordinate descent: take each fold's and the final descent "
        "pick from this record (an earlier --write), then run the tail stage on them",
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 candidates, 1 pass, 1+1+2 seeds, 2 tail seeds"
    )
    parser.add_argument("--verify", action="store_true", help="check fast_replay == replay")
    parser.add_argument("--write", action="store_true", help=f"write {CV_FILE.name}")
    parser.add_argument(
        "--folds",
        choices=("family", "gpu"),
        default="family",
        help="fold by workload family (the default, the one written) or by GPU model",
    )
    parser.add_argument(
        "--restamp",
        action="store_true",
        help=f"only re-check shipped_defaults_match in {CV_FILE.name} against Adaptive()",
    )
    parser.add_argument(
        "--worst",
        type=int,
        metavar="N",
        help=f"only print the N worst out-of-fold cases of {CV_FILE.name} (no tuning)",
    )
    args = parser.parse_args(argv)
    if args.restamp:
        return restamp()
    if args.worst:
        keep = ("regret", "profile", "selector", "seed", "optimum", "pick")
        return {"worst": [{k: c[k] for k in keep} for c in worst_cases(args.worst)]}
    global PASSES, FINALISTS
    if args.quick:
        args.candidates, args.tuning_seeds, args.selection_seeds, args.seeds = 8, 1, 1, 2
        args.tail_seeds = 2
        PASSES, FINALISTS = 1, 2
    started = wallclock.perf_counter()
    reference, traces = load_reference_profiles(), load_trace_profiles()
    profiles = reference + traces
    tuning_seeds = [TUNING_SEED_BASE + i for i in range(args.tuning_seeds)]
    selection_seeds = [SELECTION_SEED_BASE + i for i in range(args.selection_seeds)]
    oof_seeds = [OOF_SEED_BASE + i for i in range(args.seeds)]
    tail_seeds = [TAIL_SEED_BASE + i for i in range(args.tail_seeds)]
    pool = candidate_pool(args.candidates)
    if args.verify:
        check: list[dict[str, Any] | str] = [*pool[:3], "exhaustive"]
        for job in check:
            search = job if isinstance(job, str) else Adaptive(**full(job))
            for p in profiles[::9]:
                fast = tally([p], search, [0], SIGMA, fast_replay).summary()
                slow = tally([p], search, [0], SIGMA, replay).summary()
                assert fast == slow, (p.name, job, fast, slow)
        print(f"verified fast_replay == replay on {len(profiles[::9])} profiles x {len(check)}")
    print(
        f"{len(profiles)} profiles ({len(reference)} reference + {len(traces)} traces), "
        f"{len(pool)} candidates, tuning seeds {tuning_seeds}, selection seeds "
        f"{selection_seeds}, out-of-fold seeds {oof_seeds}, tail seeds "
        f"{tail_seeds[0]}-{tail_seeds[-1]}",
        flush=True,
    )
    evaluate = Evaluator(profiles, tuning_seeds, args.jobs)
    select = Evaluator(profiles, selection_seeds, args.jobs)
    tail_eval = Evaluator(profiles, tail_seeds, args.jobs)
    given = json.loads(args.descent_from.read_text()) if args.descent_from else None

    def descent(mask: Sequence[bool], family: str | None) -> dict[str, Any]:
        """The coordinate descent's pick on the profiles in `mask` (or the given record's)."""
        if given is None:
            return tune(pool, pool_tallies, mask, evaluate, select)
        rec = given["final"] if family is None else _fold_of(given, family)
        params = decode(rec.get("descent_params", rec["params"]))
        keep = ("pool_starts", "evaluated", "finalists")
        return {
            **{k: rec[k] for k in keep if k in rec},
            "descent_from": f"{args.descent_from.name} of {given['date']}",
            "params": {k: params[k] for k in SPACE},
        }

    try:
        pool_tallies = evaluate(pool) if given is None else []
        exhaustive_tuning = evaluate(["exhaustive"])[0]
        print(f"pool evaluated in {wallclock.perf_counter() - started:.0f} s", flush=True)
        folds = []
        oof_adaptive, oof_exhaustive = Tally(), Tally()
        per_seed = {s: (Tally(), Tally()) for s in oof_seeds}
        for family in sorted({fold_key(p, args.folds) for p in profiles}):
            held = [fold_key(p, args.folds) == family for p in profiles]
            train = [not h for h in held]
            result = descent(train, family)
            result["descent_params"] = encode(result["params"])
            result["tail_stage"] = tail_stage(result["params"], train, tail_eval)
            params = result["params"] = result["tail_stage"]["params"]
            test_profiles = [p for p, h in zip(profiles, held, strict=True) if h]
            ta, te = Tally(), Tally()
            for seed in oof_seeds:
                sa_ = tally(test_profiles, Adaptive(**full(params)), [seed], SIGMA, fast_replay)
                se_ = tally(test_profiles, "exhaustive", [seed], SIGMA, fast_replay)
                per_seed[seed][0].add(sa_)
                per_seed[seed][1].add(se_)
                ta.add(sa_)
                te.add(se_)
            oof_adaptive.add(ta)
            oof_exhaustive.add(te)
            sa, se = ta.summary(), te.summary()
            folds.append(
                {
                    "family": family,
                    "profiles": len(test_profiles),
                    **{k: v for k, v in result.items() if k != "params"},
                    "params": encode(full(params)),
                    "train_in_sample": pooled(evaluate([params])[0], train).summary(),
                    "train_exhaustive": pooled(exhaustive_tuning, train).summary(),
                    "adaptive": sa,
                    "exhaustive": se,
                }
            )
            print(
                _line(f"fold {family:13s} ({len(test_profiles):3d} profiles)", sa, se)
                + f"  [{wallclock.perf_counter() - started:.0f} s]",
                flush=True,
            )
        everything = [True] * len(profiles)
        final = descent(everything, None)
        final["descent_params"] = encode(final["params"])
        final["tail_stage"] = tail_stage(final["params"], everything, tail_eval)
        final["params"] = final["tail_stage"]["params"]
        final_in_sample = pooled(evaluate([final["params"]])[0], everything).summary()
    finally:
        evaluate.close()
        select.close()
        tail_eval.close()
    a, e = oof_adaptive.summary(), oof_exhaustive.summary()
    oof_spread = spread(list(per_seed.values()))
    print(_line("out-of-fold pooled", a, e))
    print(
        f"  per seed: difference {oof_spread['difference_range']}, worst "
        f"{oof_spread['worst_regret_range']}, time {oof_spread['time_ratio_range']}"
    )
    print(f"tuned on all profiles: {encode(final['params'])}")
    print(
        _line(
            "  in-sample (tuning seeds)",
            final_in_sample,
            pooled(exhaustive_tuning, everything).summary(),
        )
    )
    matches = Adaptive(**full(final["params"])) == Adaptive()
    print(
        f"Adaptive() defaults {'match' if matches else 'DIFFER FROM'} this result"
        + ("" if matches else " (copy final.params into Adaptive, then re-stamp with --restamp)")
    )
    out: dict[str, object] = {
        "bench": "tune_adaptive_search",
        "machine": machine(),
        "date": now(),
        "rule": {
            "maximize": "within_1pct - tail_weight * tail_3pct",
            "tail_weight": TAIL_WEIGHT,
            "penalty_per_unit_over": PENALTY,
            "caps": {"time_ratio": TIME_CAP, "worst_regret": WORST_CAP},
            "ties": "lower time_ratio",
            "search": (
                f"coordinate descent over SPACE ({PASSES} passes, tuning seeds) from the "
                f"{STARTS} best of the pool, with pair moves when stuck (the {PAIR_FLAGS} best "
                "single changes kept out only by the time cap, each with the "
                f"{PAIR_PARTNERS} time-cutting changes of other settings whose pair scores best if "
                "their effects add up); of the "
                f"{FINALISTS} best settings it evaluated, the best on the selection seeds"
            ),
            "tail_stage": (
                "then every combination of TAIL_SPACE on top of that pick, the best by "
                "score - tail4_weight * tail_4pct on the tail seeds"
            ),
            "tail4_weight": TAIL4_WEIGHT,
        },
        "sigma": SIGMA,
        "folds_by": "workload family (network)" if args.folds == "family" else "GPU model",
        "fixed": encode(FIXED),
        "space": {k: [encode({k: v})[k] for v in vs] for k, vs in SPACE.items()},
        "tail_space": {k: list(vs) for k, vs in TAIL_SPACE.items()},
        "candidates": len(pool),
        "pool_seed": POOL_SEED,
        "tuning_seeds": tuning_seeds,
        "selection_seeds": selection_seeds,
        "scoring_seeds": oof_seeds,
        "tail_seeds": tail_seeds,
        "folds": folds,
        "out_of_fold": {
            "adaptive": a,
            "exhaustive": e,
            "goals_met": goals_met(a, e),
            "spread": oof_spread,
        },
        "final": {
            **{k: v for k, v in final.items() if k != "params"},
            "params": encode(full(final["params"])),
            "in_sample": final_in_sample,
        },
        "shipped_defaults_match": matches,
        "elapsed_s": round(wallclock.perf_counter() - started, 1),
    }
    if args.write and args.folds == "family":
        CV_FILE.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {CV_FILE.relative_to(ROOT)}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
