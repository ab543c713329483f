"""Adaptive on the real traces: loading, own grids, robust stopping, skips, tuning records.

No timings: every check is a deterministic replay (seeded noise or none).
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.power_limit import Adaptive, Energy, Time, WindowResult, ZeusCost
from coordinator.power_limit.search import cost_function

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("power_limit_search")
tune = _load("tune_adaptive_search")
TRACES = bench.load_trace_profiles()
REFERENCE = bench.load_reference_profiles()


def _trace(name: str):  # noqa: ANN202
    return next(p for p in TRACES if p.name == name)


def test_traces_load_with_their_own_grids() -> None:
    assert len(TRACES) == 121
    assert sum(p.gpu == "A40" for p in TRACES) == 53
    assert sum(p.gpu == "V100" for p in TRACES) == 68
    grids = {(p.gpu, p.pl_step, p.limits[0], p.limits[-1]) for p in TRACES}
    assert grids == {("A40", 25, 300, 100), ("A40", 50, 300, 100), ("V100", 25, 250, 100)}
    assert {p.family for p in TRACES + REFERENCE} == {
        "bert",
        "deepspeech2",
        "ncf",
        "resnet",
        "shufflenetv2",
    }
    # Every profile: time and energy for each limit, epoch figures scaled alike.
    for p in TRACES:
        assert set(p.time) == set(p.energy) == set(p.limits)
        assert list(p.limits) == list(range(p.limits[0], p.limits[-1] - 1, -p.pl_step))


def test_replay_uses_the_profile_grid() -> None:
    """A 50 W profile is replayed on 300, 250, ..., 100 W, never on a limit it lacks."""
    profile = next(p for p in TRACES if p.pl_step == 50)
    result = bench.replay(profile, Energy(), "exhaustive", rng=random.Random(0), sigma=0.0)
    assert result.profiled == profile.limits == (300, 250, 200, 150, 100)
    assert result.pick == Energy().select(profile.measurements())
    ours = bench.replay(profile, Energy(), Adaptive(), rng=random.Random(0), sigma=0.01)
    assert set(ours.profiled) <= set(profile.limits)


@pytest.mark.parametrize(
    "name",
    [
        "V100:librispeech/deepspeech2/bs128/adamw",
        "A40:imagenet/resnet50/bs192/adadelta",
        "A40:sentiment140/bert_base_uncased/bs256/adamw",
    ],
)
def test_trace_profile_without_noise_picks_within_1pct(name: str) -> None:
    profile = _trace(name)
    reference = profile.measurements()
    for _, selector in bench.selector_grid(1):
        result = bench.replay(profile, selector, Adaptive(), rng=random.Random(0), sigma=0.0)
        costs = cost_function(selector)(reference)  # type: ignore[misc]
        assert costs[result.pick] <= 1.01 * min(costs.values()), (selector, result)


def test_seeded_noisy_trace_replay_is_deterministic_and_close() -> None:
    profile = _trace("V100:imagenet/resnet50/bs128/adadelta")
    runs = [
        bench.replay(profile, ZeusCost(0.5), Adaptive(), rng=random.Random(7), sigma=0.01)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    costs = ZeusCost(0.5).costs(profile.measurements())
    assert costs[runs[0].pick] <= 1.01 * min(costs.values())


def _descend(search: Adaptive, rows: dict[int, float], bumps: dict[int, float]) -> list[int]:
    """Drive a search on an Energy profile, feeding exact windows (times `bumps` per limit)."""
    limits = sorted(rows, reverse=True)
    plan = search.plan(limits, 10, 40, Energy())
    results: list[WindowResult] = []
    visited: list[int] = []
    while (probe := plan.next_probe(tuple(results), len(results))) is not None:
        limit = probe.power_limit
        visited.append(limit)
        factor = bumps.pop(limit, 1.0) if probe.warmup_steps else 1.0
        energy = rows[limit] * probe.profile_steps / 40 * factor
        results.append(WindowResult(limit, probe.profile_steps, 10.0, energy))
    return visited


def test_single_noisy_bump_does_not_stop_the_descent() -> None:
    """One window reading far too high (a noise spike) does not end the descent."""
    rows = {300: 100.0, 275: 96.0, 250: 92.0, 225: 89.0, 200: 87.0, 175: 86.0, 150: 85.0}
    rows |= {125: 90.0, 100: 99.0}
    visited = _descend(Adaptive(), dict(rows), {250: 1.2})
    assert {200, 175, 150} <= set(visited)


def test_a_real_bump_in_a_rough_profile_does_not_stop_the_descent() -> None:
    """A limit 12% worse than the best, then a better one below (as in the traces): found."""
    rows = {300: 100.0, 275: 95.0, 250: 106.0, 225: 97.0, 200: 90.0, 175: 93.0, 150: 99.0}
    rows |= {125: 104.0, 100: 110.0}
    visited = _descend(Adaptive(), rows, {})
    assert 200 in visited


def test_descent_stops_once_clearly_and_steadily_worse() -> None:
    rows = {300: 100.0, 275: 95.0, 250: 91.0, 225: 93.0, 200: 99.0, 175: 108.0, 150: 120.0}
    rows |= {125: 135.0, 100: 150.0}
    visited = _descend(Adaptive(), rows, {})
    assert 100 not in visited and 250 in visited


def test_skip_is_taken_back_when_the_fall_stops() -> None:
    """While the cost falls steeply a limit may be skipped; if the fall stops, it is profiled."""
    search = Adaptive(steep=0.03)
    rows = {300: 100.0, 275: 92.0, 250: 84.0, 225: 80.0, 200: 83.0, 175: 90.0, 150: 99.0}
    rows |= {125: 110.0, 100: 125.0}
    visited = _descend(search, rows, {})
    assert 225 in visited  # The best, though a skip may have jumped over it first.


def test_budget_caps_the_steps() -> None:
    profile = _trace("V100:librispeech/deepspeech2/bs128/adamw")
    search = Adaptive(budget=0.4, max_refines=6, confirm=1.0)
    for _, selector in bench.selector_grid(1):
        plan = search.plan(list(profile.limits), 10, 40, selector)
        results: list[WindowResult] = []
        steps = 0
        while (probe := plan.next_probe(tuple(results), len(results))) is not None:
            steps += probe.warmup_steps + probe.profile_steps
            row = profile.measurements()[profile.limits.index(probe.power_limit)]
            scale = probe.profile_steps / 40
            results.append(
                WindowResult(
                    probe.power_limit, probe.profile_steps, row.time * scale, row.energy * scale
                )
            )
        assert steps <= 0.4 * len(profile.limits) * 50


def test_fast_replay_matches_the_state_machine_replay() -> None:
    """The tuning's shortcut replays exactly what the bench replays through the machine."""
    searches = [Adaptive(), Adaptive(chunk=0.125, steep=0.03, confirm=1.0), "exhaustive"]
    for profile in [*REFERENCE[:2], *TRACES[::30]]:
        for search in searches:
            for _, selector in bench.selector_grid(profile.n_gpus)[::3]:
                fast = tune.fast_replay(profile, selector, search, rng=random.Random(3), sigma=0.01)
                slow = bench.replay(profile, selector, search, rng=random.Random(3), sigma=0.01)
                assert (fast.pick, fast.windows, fast.profiled) == (
                    slow.pick,
                    slow.windows,
                    slow.profiled,
                )
                assert math.isclose(fast.profiling_time_s, slow.profiling_time_s, rel_tol=1e-12)


def test_shipped_defaults_are_the_cross_validated_pick() -> None:
    """Adaptive()'s defaults are what the tuning selected on all profiles; folds are valid; the
    record names every setting; the seeds of the tuning, of the choice among its finalists, of the
    out-of-fold scoring, of the tail stage and of the bench are five disjoint sets."""
    cv = json.loads(tune.CV_FILE.read_text())
    assert Adaptive() == Adaptive(**tune.decode(cv["final"]["params"]))
    assert cv["shipped_defaults_match"] is True  # The record says so too.
    fields = set(Adaptive.__dataclass_fields__)
    assert set(cv["final"]["params"]) == fields
    assert {f["family"] for f in cv["folds"]} == {p.family for p in TRACES + REFERENCE}
    for fold in cv["folds"]:
        assert set(fold["params"]) == fields
        Adaptive(**tune.decode(fold["params"]))  # Valid settings.
    tuning, selection = set(cv["tuning_seeds"]), set(cv["selection_seeds"])
    scoring, tail, bench_seeds = set(cv["scoring_seeds"]), set(cv["tail_seeds"]), set(range(10))
    assert len(tuning) >= 3 and len(selection) >= 3 and len(scoring) >= 5 and len(tail) >= 20
    sets = [tuning, selection, scoring, tail]
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            assert a.isdisjoint(b)
    assert (tuning | selection | scoring | tail).isdisjoint(bench_seeds)
    # The tail stage ran on top of the descent's pick: the pick is one of its grid's settings.
    for record in [cv["final"], *cv["folds"]]:
        stage = record["tail_stage"]
        chosen = {k: tune.decode(record["params"])[k] for k in tune.TAIL_SPACE}
        assert chosen in [tune.decode(g["settings"]) for g in stage["grid"]]
        assert len(stage["grid"]) == math.prod(len(v) for v in tune.TAIL_SPACE.values())


def test_candidate_pool_is_data_independent_and_reproducible() -> None:
    assert tune.candidate_pool(20) == tune.candidate_pool(20)
    assert tune.candidate_pool(5)[0] == tune.PREVIOUS_DEFAULTS
    assert set(tune.FIXED).isdisjoint(tune.SPACE)
    assert set(tune.FIXED) | set(tune.SPACE) == set(Adaptive.__dataclass_fields__)
    for params in tune.candidate_pool(50):
        Adaptive(**tune.full(params))
        assert set(params) == set(tune.SPACE)
        assert all(params[name] in values for name, values in tune.SPACE.items())


def _fake_tally(within: int, time: float = 0.4, tail: int = 0) -> object:
    return bench.Tally(
        cases=100, within=within, worst=0.02, spent=time, spent_exhaustive=1.0, tail=tail
    )


class _FakeEvaluator:
    """Stands in for `tune.Evaluator`: one profile, a score that is a function of the settings."""

    def __init__(self, within) -> None:  # noqa: ANN001
        self.within = within
        self.calls: list[str] = []

    def __call__(self, settings):  # noqa: ANN001, ANN204
        keys = [s if isinstance(s, str) else tune.key_of(s) for s in settings]
        self.calls += keys
        return [[_fake_tally(self.within(tune.params_of(k)))] for k in keys]


def test_tune_picks_among_finalists_on_the_selection_seeds(monkeypatch) -> None:  # noqa: ANN001
    """The descent's best setting on the tuning seeds is not the pick when fresh (selection)
    seeds rank another finalist higher: the pick is the best on the selection seeds."""
    monkeypatch.setattr(tune, "PASSES", 1)
    monkeypatch.setattr(tune, "FINALISTS", 3)
    pool = tune.candidate_pool(0)
    start = pool[0]

    def changed(p: dict) -> int:
        return sum(p[k] != start[k] for k in p if k != "max_refines")

    # Tuning seeds: more refinements look ever better (6 best); any other change is worse.
    # Selection seeds: 4 refinements are best.
    tuning = _FakeEvaluator(lambda p: 50 + 5 * p["max_refines"] - 20 * changed(p))
    selection = _FakeEvaluator(lambda p: 90 - abs(p["max_refines"] - 4))
    result = tune.tune(pool, tuning(pool), [True], tuning, selection)
    finalists = result["finalists"]
    assert len(finalists) == 3 and len(selection.calls) == 3
    assert finalists[0]["params"]["max_refines"] == 6  # Best on the tuning seeds...
    assert result["params"]["max_refines"] == 4  # ...but the pick is the selection seeds' best.
    assert max(f["selection_score"] for f in finalists) == pytest.approx(0.90)


def test_score_penalizes_time_over_the_cap_and_a_heavy_tail() -> None:
    base = tune.score(_fake_tally(90).summary())  # type: ignore[attr-defined]
    slow = tune.score(_fake_tally(90, time=tune.TIME_CAP + 0.02).summary())  # type: ignore[attr-defined]
    tail = tune.score(_fake_tally(90, tail=2).summary())  # type: ignore[attr-defined]
    assert slow[0] < base[0] - 0.1
    assert tail[0] == pytest.approx(base[0] - tune.TAIL_WEIGHT * 0.02)


def test_time_selector_on_flat_top_profile() -> None:
    """Time on a profile whose top limits are within noise: the pick is within 1%."""
    profile = _trace("V100:librispeech/deepspeech2/bs192/adamw")
    worst = 0.0
    for seed in range(5):
        result = bench.replay(profile, Time(), Adaptive(), rng=random.Random(seed), sigma=0.01)
        worst = max(worst, profile.time[result.pick] / min(profile.time.values()) - 1)
    assert worst <= 0.03
