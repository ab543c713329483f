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

The code: this script (the descent, the folds, the record) and its helpers next to it,
`_tune_adaptive_space.py` (the settings), `_tune_adaptive_eval.py` (the replay and the
evaluators), `_tune_adaptive_score.py` (the objectives, pair moves and the tail stage) and
`_tune_adaptive_record.py` (the written record, its spread and worst cases).
"""

from __future__ import annotations

import argparse
import json
import sys
import time as wallclock
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _common import machine, now  # noqa: E402
from _tune_adaptive_eval import SIGMA, Evaluator, fast_replay, pooled  # noqa: E402
from _tune_adaptive_record import (  # noqa: E402
    CV_FILE,
    goals_met,
    restamp,
    spread,
    summary_line,
    worst_cases,
)
from _tune_adaptive_score import (  # noqa: E402
    MIN_GAIN,
    PAIR_FLAGS,
    PAIR_PARTNERS,
    PENALTY,
    TAIL4_WEIGHT,
    TAIL_WEIGHT,
    TIME_CAP,
    WORST_CAP,
    pair_moves,
    score,
    tail_stage,
)
from _tune_adaptive_score import tail_score as tail_score  # noqa: E402 - tests call it here
from _tune_adaptive_space import (  # noqa: E402
    FIXED,
    POOL_SEED,
    SPACE,
    TAIL_SPACE,
    candidate_pool,
    decode,
    encode,
    full,
    key_of,
    params_of,
)
from _tune_adaptive_space import PREVIOUS_DEFAULTS as PREVIOUS_DEFAULTS  # noqa: E402
from power_limit_search import (  # noqa: E402
    Profile,
    Tally,
    load_reference_profiles,
    load_trace_profiles,
    replay,
    tally,
)

from coordinator.power_limit import Adaptive  # noqa: E402

TUNING_SEED_BASE = 100  # Coordinate descent: seeds 100, 101, ...
SELECTION_SEED_BASE = 150  # Choosing among the finalists: seeds 150, 151, ...
OOF_SEED_BASE = 200  # Out-of-fold scoring: seeds 200, 201, ... (the bench scores 0, 1, ...)
TAIL_SEED_BASE = 600  # The tail stage: seeds 600, 601, ...
PASSES = 2
STARTS = 1
FINALISTS = 4
"""The descent's passes, its starts from the pool and the finalists scored on the selection
seeds (module globals here: `--quick` and the tests change `PASSES` and `FINALISTS`)."""


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



def _fold_of(record: dict[str, Any], family: str) -> dict[str, Any]:
    """The fold of `family` in a written record."""
    return next(f for f in record["folds"] if f["family"] == family)


def fold_key(profile: Profile, by: str) -> str:
    """The fold a profile belongs to: its workload family, or (`--folds gpu`) its GPU model."""
    return profile.family if by == "family" else profile.gpu




class Seeds(NamedTuple):
    """The four disjoint sets of noise seeds (the module's docstring says what each is for)."""

    tuning: list[int]
    selection: list[int]
    oof: list[int]
    tail: list[int]


def seeds_of(args: argparse.Namespace) -> Seeds:
    """The seeds of each stage, as many as asked for, from each stage's base."""
    return Seeds(
        tuning=[TUNING_SEED_BASE + i for i in range(args.tuning_seeds)],
        selection=[SELECTION_SEED_BASE + i for i in range(args.selection_seeds)],
        oof=[OOF_SEED_BASE + i for i in range(args.seeds)],
        tail=[TAIL_SEED_BASE + i for i in range(args.tail_seeds)],
    )


class Tuning:
    """The tuning of one set of profiles, shared by the folds and the final run: the evaluators
    (tuning, selection and tail seeds), the candidate pool, and with `--descent-from` the record
    whose descent picks stand in for the descent."""

    def __init__(
        self,
        profiles: list[Profile],
        seeds: Seeds,
        jobs: int,
        pool: list[dict[str, Any]],
        descent_from: Path | None,
    ) -> None:
        self.pool = pool
        self.evaluate = Evaluator(profiles, seeds.tuning, jobs)
        self.select = Evaluator(profiles, seeds.selection, jobs)
        self.tail_eval = Evaluator(profiles, seeds.tail, jobs)
        self.descent_from = descent_from
        self.given = json.loads(descent_from.read_text()) if descent_from else None
        self.pool_tallies: list[list[Tally]] = []

    def evaluate_pool(self) -> None:
        """Every candidate on every profile (not needed when the descent picks are given)."""
        self.pool_tallies = self.evaluate(self.pool) if self.given is None else []

    def descent(self, mask: Sequence[bool], family: str | None) -> dict[str, Any]:
        """The coordinate descent's pick on the profiles in `mask` (or the given record's)."""
        given = self.given
        if given is None:
            return tune(self.pool, self.pool_tallies, mask, self.evaluate, self.select)
        assert self.descent_from is not None
        rec = given["final"] if family is None else _fold_of(given, family)
        params = decode(rec.get("descent_params", rec["params"]))
        keep = ("pool_starts", "evaluated", "finalists")
        return {
            **{k: rec[k] for k in keep if k in rec},
            "descent_from": f"{self.descent_from.name} of {given['date']}",
            "params": {k: params[k] for k in SPACE},
        }

    def tuned(self, mask: Sequence[bool], family: str | None) -> dict[str, Any]:
        """The descent's pick, then the tail stage on top of it: its pick is `params`."""
        result = self.descent(mask, family)
        result["descent_params"] = encode(result["params"])
        result["tail_stage"] = tail_stage(result["params"], mask, self.tail_eval)
        result["params"] = result["tail_stage"]["params"]
        return result

    def close(self) -> None:
        """Stop the evaluators' worker processes."""
        self.evaluate.close()
        self.select.close()
        self.tail_eval.close()


def held_out(
    test_profiles: list[Profile],
    params: dict[str, Any],
    oof_seeds: Sequence[int],
    per_seed: dict[int, tuple[Tally, Tally]],
) -> tuple[Tally, Tally]:
    """A fold's pick and the exhaustive search on its held-out profiles, seed by seed (each
    seed's figures are added to `per_seed` too)."""
    ta, te = Tally(), Tally()
    for seed in oof_seeds:
        sa_ = tally(test_profiles, Adaptive(**full(params)), [seed], SIGMA, fast_replay)
        se_ = tally(test_profiles, "exhaustive", [seed], SIGMA, fast_replay)
        per_seed[seed][0].add(sa_)
        per_seed[seed][1].add(se_)
        ta.add(sa_)
        te.add(se_)
    return ta, te


def cross_validate(
    tuning: Tuning,
    profiles: list[Profile],
    folds_by: str,
    oof_seeds: Sequence[int],
    exhaustive_tuning: list[Tally],
    started: float,
) -> tuple[list[dict[str, Any]], Tally, Tally, dict[int, tuple[Tally, Tally]]]:
    """Each fold tuned on the other folds' profiles only, then scored on its own.

    Returns:
        The folds' records, the pooled out-of-fold tallies (adaptive, exhaustive), and the
        same per out-of-fold seed.
    """
    folds = []
    oof_adaptive, oof_exhaustive = Tally(), Tally()
    per_seed = {s: (Tally(), Tally()) for s in oof_seeds}
    for family in sorted({fold_key(p, folds_by) for p in profiles}):
        held = [fold_key(p, folds_by) == family for p in profiles]
        train = [not h for h in held]
        result = tuning.tuned(train, family)
        params = result["params"]
        test_profiles = [p for p, h in zip(profiles, held, strict=True) if h]
        ta, te = held_out(test_profiles, params, oof_seeds, per_seed)
        oof_adaptive.add(ta)
        oof_exhaustive.add(te)
        sa, se = ta.summary(), te.summary()
        folds.append(
            {
                "family": family,
                "profiles": len(test_profiles),
                **{k: v for k, v in result.items() if k != "params"},
                "params": encode(full(params)),
                "train_in_sample": pooled(tuning.evaluate([params])[0], train).summary(),
                "train_exhaustive": pooled(exhaustive_tuning, train).summary(),
                "adaptive": sa,
                "exhaustive": se,
            }
        )
        print(
            summary_line(f"fold {family:13s} ({len(test_profiles):3d} profiles)", sa, se)
            + f"  [{wallclock.perf_counter() - started:.0f} s]",
            flush=True,
        )
    return folds, oof_adaptive, oof_exhaustive, per_seed


def verify(pool: list[dict[str, Any]], profiles: list[Profile]) -> None:
    """`--verify`: `fast_replay` gives what the state machine's `replay` gives, on a sample."""
    check: list[dict[str, Any] | str] = [*pool[:3], "exhaustive"]
    for job in check:
        search = job if isinstance(job, str) else Adaptive(**full(job))
        for p in profiles[::9]:
            fast = tally([p], search, [0], SIGMA, fast_replay).summary()
            slow = tally([p], search, [0], SIGMA, replay).summary()
            assert fast == slow, (p.name, job, fast, slow)
    print(f"verified fast_replay == replay on {len(profiles[::9])} profiles x {len(check)}")


def print_outcome(
    a: dict[str, float],
    e: dict[str, float],
    oof_spread: dict[str, Any],
    final: dict[str, Any],
    final_in_sample: dict[str, float],
    exhaustive_in_sample: dict[str, float],
) -> bool:
    """The out-of-fold and final figures on stdout; whether `Adaptive()`'s defaults are the
    final pick."""
    print(summary_line("out-of-fold pooled", a, e))
    print(
        f"  per seed: difference {oof_spread['difference_range']}, worst "
        f"{oof_spread['worst_regret_range']}, time {oof_spread['time_ratio_range']}"
    )
    print(f"tuned on all profiles: {encode(final['params'])}")
    print(summary_line("  in-sample (tuning seeds)", final_in_sample, exhaustive_in_sample))
    matches = Adaptive(**full(final["params"])) == Adaptive()
    print(
        f"Adaptive() defaults {'match' if matches else 'DIFFER FROM'} this result"
        + ("" if matches else " (copy final.params into Adaptive, then re-stamp with --restamp)")
    )
    return matches


def rule() -> dict[str, object]:
    """The objective and the search, as the record states them (with this run's `PASSES` and
    `FINALISTS`)."""
    return {
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
    }


def record(
    args: argparse.Namespace,
    seeds: Seeds,
    pool: list[dict[str, Any]],
    folds: list[dict[str, Any]],
    oof: dict[str, object],
    final: dict[str, Any],
    final_in_sample: dict[str, float],
    matches: bool,
    started: float,
) -> dict[str, object]:
    """The run's JSON (the last line; with `--write`, `CV_FILE`)."""
    return {
        "bench": "tune_adaptive_search",
        "machine": machine(),
        "date": now(),
        "rule": rule(),
        "sigma": SIGMA,
        "folds_by": "workload family (network)" if args.folds == "family" else "GPU model",
        "fixed": encode(FIXED),
        "space": {k: [encode({k: v})[k] for v in vs] for k, vs in SPACE.items()},
        "tail_space": {k: list(vs) for k, vs in TAIL_SPACE.items()},
        "candidates": len(pool),
        "pool_seed": POOL_SEED,
        "tuning_seeds": seeds.tuning,
        "selection_seeds": seeds.selection,
        "scoring_seeds": seeds.oof,
        "tail_seeds": seeds.tail,
        "folds": folds,
        "out_of_fold": oof,
        "final": {
            **{k: v for k, v in final.items() if k != "params"},
            "params": encode(full(final["params"])),
            "in_sample": final_in_sample,
        },
        "shipped_defaults_match": matches,
        "elapsed_s": round(wallclock.perf_counter() - started, 1),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
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
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    """Tune, cross-validated, and print the record; or only `--restamp` or `--worst` it."""
    args = parse_args(argv)
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
    seeds = seeds_of(args)
    pool = candidate_pool(args.candidates)
    if args.verify:
        verify(pool, profiles)
    print(
        f"{len(profiles)} profiles ({len(reference)} reference + {len(traces)} traces), "
        f"{len(pool)} candidates, tuning seeds {seeds.tuning}, selection seeds "
        f"{seeds.selection}, out-of-fold seeds {seeds.oof}, tail seeds "
        f"{seeds.tail[0]}-{seeds.tail[-1]}",
        flush=True,
    )
    tuning = Tuning(profiles, seeds, args.jobs, pool, args.descent_from)
    try:
        tuning.evaluate_pool()
        exhaustive_tuning = tuning.evaluate(["exhaustive"])[0]
        print(f"pool evaluated in {wallclock.perf_counter() - started:.0f} s", flush=True)
        folds, oof_adaptive, oof_exhaustive, per_seed = cross_validate(
            tuning, profiles, args.folds, seeds.oof, exhaustive_tuning, started
        )
        everything = [True] * len(profiles)
        final = tuning.tuned(everything, None)
        final_in_sample = pooled(tuning.evaluate([final["params"]])[0], everything).summary()
    finally:
        tuning.close()
    a, e = oof_adaptive.summary(), oof_exhaustive.summary()
    oof_spread = spread(list(per_seed.values()))
    exhaustive_in_sample = pooled(exhaustive_tuning, everything).summary()
    matches = print_outcome(a, e, oof_spread, final, final_in_sample, exhaustive_in_sample)
    oof = {"adaptive": a, "exhaustive": e, "goals_met": goals_met(a, e), "spread": oof_spread}
    out = record(args, seeds, pool, folds, oof, final, final_in_sample, matches, started)
    if args.write and args.folds == "family":
        CV_FILE.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {CV_FILE.relative_to(ROOT)}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
