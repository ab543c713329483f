"""The tuner's written record (`data/power-traces/adaptive_search_cv.json`) and its figures:
per-seed spread, the goals, re-stamping the record, and its worst out-of-fold cases.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from _tune_adaptive_eval import fast_replay
from _tune_adaptive_space import decode
from power_limit_search import (
    REFERENCE_STEPS,
    Tally,
    load_reference_profiles,
    load_trace_profiles,
    selector_grid,
)

from coordinator.power_limit import Adaptive
from coordinator.power_limit.search import WindowResult, aggregate, cost_function

ROOT = Path(__file__).resolve().parent.parent
CV_FILE = ROOT / "data" / "power-traces" / "adaptive_search_cv.json"


def summary_line(label: str, a: dict[str, float], e: dict[str, float]) -> str:
    """One line of figures, adaptive next to exhaustive."""
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
    """The goals: within 1 point of exhaustive within 1%, worst regret 5%, half the time."""
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
        print_case(c)
    return cases[:n]


def print_case(c: dict[str, object]) -> None:
    """One case of `worst_cases`: regret, optimum and pick; true and measured costs relative to
    the optimum's (with each limit's steps); the windows in order."""
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
