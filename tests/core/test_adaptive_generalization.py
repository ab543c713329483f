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
    """Adaptive()'s defaults are what the tuning selected on all profiles; folds are valid."""
    cv = json.loads(tune.CV_FILE.read_text())
    assert Adaptive() == Adaptive(**tune.decode(cv["final"]["params"]))
    assert cv["shipped_defaults_match"] is True  # The record says so too.
    assert {f["family"] for f in cv["folds"]} == {p.family for p in TRACES + REFERENCE}
    for fold in cv["folds"]:
        Adaptive(**tune.decode(fold["params"]))  # Valid settings.
    assert set(cv["tuning_seeds"]).isdisjoint(range(cv["scoring_seeds"][-1] + 1))


def test_candidate_pool_is_data_independent_and_reproducible() -> None:
    assert tune.candidate_pool(20) == tune.candidate_pool(20)
    assert tune.candidate_pool(5)[0] == tune.PREVIOUS_DEFAULTS
    for params in tune.candidate_pool(50):
        Adaptive(**params)
        assert params.get("patience", 2) >= 2
        assert set(params) == set(tune.SPACE)
        assert all(params[name] == value for name, value in tune.POOL_FIXED.items())
    assert tune.SPACE["focused_refinement"] == (False, True)  # Tuned by the coordinate descent.


def test_time_selector_on_flat_top_profile() -> None:
    """Time on a profile whose top limits are within noise: the pick is within 1%."""
    profile = _trace("V100:librispeech/deepspeech2/bs192/adamw")
    worst = 0.0
    for seed in range(5):
        result = bench.replay(profile, Time(), Adaptive(), rng=random.Random(seed), sigma=0.01)
        worst = max(worst, profile.time[result.pick] / min(profile.time.values()) - 1)
    assert worst <= 0.03
