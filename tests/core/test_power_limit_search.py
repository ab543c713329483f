"""Search strategies on replayed reference profiles: quality targets, no peeking, fallbacks."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.power_limit import (
    Adaptive,
    EndWindow,
    Energy,
    Exhaustive,
    MaxSlowdownConstraint,
    PowerLimitError,
    PowerLimitMeasurement,
    PowerLimitStateMachine,
    Probe,
    WindowResult,
    ZeusCost,
    aggregate,
)
from coordinator.power_limit.machine import MAX_REDOS
from coordinator.power_limit.search import resolve_search

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str = "power_limit_search") -> ModuleType:
    """Load `bench/<name>.py` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()
PROFILES = bench.load_reference_profiles()


def test_quality_targets_on_seeded_noisy_replay() -> None:
    """84 cases x 5 seeds, 1% noise per 40-step window: a regression guard.

    In-sample: the defaults were tuned (other noise seeds) on these and the trace profiles; the
    out-of-fold figures are in the bench's `cross_validation` block.
    """
    result = bench.evaluate(PROFILES, Adaptive(), seeds=range(5), sigma=0.01)
    assert result["cases"] == 84 * 5
    # 94.3% with the noise-robust defaults (exhaustive: 96.9%): a regression guard, NOT the goal
    # (exhaustive minus 1 point), which these defaults miss on the reference set.
    assert result["within_1pct"] >= 0.94, result
    assert result["worst_regret"] <= 0.05, result
    assert result["time_ratio"] <= 0.5, result


def test_exhaustive_replay_is_exact_without_noise() -> None:
    result = bench.evaluate(PROFILES, "exhaustive", seeds=[0], sigma=0.0)
    assert result["within_1pct"] == 1.0 and result["worst_regret"] == 0.0
    assert result["time_ratio"] == 1.0


def test_adaptive_does_not_peek_at_unprofiled_rows() -> None:
    """Changing rows the search never profiled changes nothing it does."""
    profile = next(p for p in PROFILES if p.name == "A40+resnet50+gpu0")
    selector = Energy()
    first = bench.replay(profile, selector, Adaptive(), rng=random.Random(1), sigma=0.01)
    profiled = set(first.profiled)
    assert len(profiled) < len(profile.limits)
    tampered = bench.Profile(
        profile.name,
        profile.n_gpus,
        profile.limits,
        {pl: (t if pl in profiled else 1e-3) for pl, t in profile.time.items()},
        {pl: (e if pl in profiled else 1e-3) for pl, e in profile.energy.items()},
    )
    second = bench.replay(tampered, selector, Adaptive(), rng=random.Random(1), sigma=0.01)
    assert second == first


def test_adaptive_falls_back_to_exhaustive_without_a_cost() -> None:
    profile = PROFILES[0]
    selector = MaxSlowdownConstraint(1.1)
    ours = bench.replay(profile, selector, "adaptive", rng=random.Random(0), sigma=0.0)
    ref = bench.replay(profile, selector, "exhaustive", rng=random.Random(0), sigma=0.0)
    assert ours == ref
    assert ours.pick == selector.select(profile.measurements())


def test_aggregate_pools_and_scales() -> None:
    results = [
        WindowResult(300, 10, 2.0, 100.0),
        WindowResult(250, 40, 9.0, 400.0),
        WindowResult(300, 30, 6.0, 300.0),
    ]
    assert aggregate(results, 40) == [
        PowerLimitMeasurement(power_limit=300, energy=400.0, time=8.0),
        PowerLimitMeasurement(power_limit=250, energy=400.0, time=9.0),
    ]


def test_adaptive_uses_short_windows_and_no_warmup_on_extension() -> None:
    plan = Adaptive(chunk=0.25, ext_ratio=math.inf).plan([300, 250, 200], 10, 40, ZeusCost(0.5))
    first = plan.next_probe([], 0)
    assert first is not None and first.power_limit == 300 and first.profile_steps == 10
    assert first.warmup_steps == 10
    second = plan.next_probe([WindowResult(300, 10, 2.5, 500.0)], 1)
    assert second is not None and second.power_limit == 250 and second.warmup_steps == 10
    # 250 W indistinguishable from 300 W: extend at the same limit, no warm-up.
    third = plan.next_probe(
        [WindowResult(300, 10, 2.5, 500.0), WindowResult(250, 10, 2.5, 500.0)], 2
    )
    assert third is not None and third.power_limit == 250 and third.warmup_steps == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"chunk": 0},
        {"noise": -1},
        {"max_steps": 0.1, "chunk": 0.5},
        {"max_refines": -1},
        {"patience": 0},
        {"settle": -0.5},
        {"k_guard": -1.0},
        {"guard_regret": -0.01},
        {"guard_extend": -0.1},
        {"k_guard_extend": -1.0},
    ],
)
def test_adaptive_validation(kw: dict) -> None:
    with pytest.raises(ValueError, match="Adaptive"):
        Adaptive(**kw)


def test_resolve_search() -> None:
    assert isinstance(resolve_search("exhaustive"), Exhaustive)
    assert isinstance(resolve_search("adaptive"), Adaptive)
    strategy = Adaptive(noise=0.02)
    assert resolve_search(strategy) is strategy
    with pytest.raises(ValueError, match="Unknown search"):
        resolve_search("fast")


def _drive(search: Adaptive, rows: dict[int, float]) -> list[WindowResult]:
    """Run a search on an Energy profile with exact windows (energy per 40 steps per limit)."""
    plan = search.plan(sorted(rows, reverse=True), 10, 40, Energy())
    results: list[WindowResult] = []
    while (probe := plan.next_probe(tuple(results), len(results))) is not None:
        scale = probe.profile_steps / 40
        results.append(
            WindowResult(
                probe.power_limit,
                probe.profile_steps,
                10.0 * scale,
                rows[probe.power_limit] * scale,
            )
        )
    return results


def test_best_is_confirmed_even_without_refinements() -> None:
    """With `focused_refinement`, confirmation windows do not use up `max_refines`: with none
    left, the best is still profiled for `confirm` x profile_steps before the search ends."""
    rows = {300: 100.0, 275: 97.0, 250: 95.0, 225: 94.0, 200: 96.0, 175: 99.0, 150: 103.0}
    results = _drive(
        Adaptive(max_refines=0, confirm=1.0, k_ambiguous=0.0, focused_refinement=True), rows
    )
    best = min(rows, key=rows.__getitem__)
    assert sum(r.steps for r in results if r.power_limit == best) >= 40


def test_refinement_goes_to_the_best_and_its_most_ambiguous_rival() -> None:
    """With `focused_refinement`, refinement windows re-profile only the best and the rival
    closest to it in sigmas (here 250 W, 0.2% away), never one farther off (200 W, 1.5%)."""
    rows = {300: 110.0, 275: 104.0, 250: 100.2, 225: 100.0, 200: 101.5, 175: 108.0, 150: 118.0}
    search = Adaptive(
        max_refines=2,
        confirm=0.0,
        k_ambiguous=0.0,
        k_refine=3.0,
        steep=math.inf,
        focused_refinement=True,
        k_guard=0.0,  # No guard windows: refinement only.
        guard_extend=0.0,
    )
    results = _drive(search, rows)
    descent = len(rows)  # k_ambiguous=0: one window per limit on the way down, no extension.
    assert [r.power_limit for r in results[:descent]] == sorted(rows, reverse=True)
    refined = [r.power_limit for r in results[descent:]]
    assert refined and set(refined) <= {225, 250}


def test_a_close_pick_is_settled_on_a_full_window() -> None:
    """With `settle`, a best that rests on a short window while a rival is close (250 W, 0.3%
    away) is profiled up to settle x profile_steps in one window before the search ends, even with
    no refinements left; without `settle` it is not."""
    rows = {300: 110.0, 275: 104.0, 250: 100.3, 225: 100.0, 200: 101.5, 175: 108.0, 150: 118.0}
    kw = {"max_refines": 0, "confirm": 0.0, "k_ambiguous": 0.0, "steep": math.inf}
    kw |= {"chunk": 0.125, "max_steps": 1.5, "focused_refinement": False, "settle": 0.0}
    kw |= {"k_guard": 0.0}  # No guard windows: settling only.
    plain = _drive(Adaptive(**kw), rows)
    settled = _drive(Adaptive(**(kw | {"settle": 1.0})), rows)
    assert settled[: len(plain)] == plain
    extra = settled[len(plain) :]
    assert [(r.power_limit, r.steps) for r in extra] == [(225, 35)]
    assert sum(r.steps for r in settled if r.power_limit == 225) == 40
    assert sum(r.steps for r in plain if r.power_limit == 225) < 40


def test_a_clear_pick_is_not_settled() -> None:
    """Every rival far off (>= 30%): `settle` costs nothing."""
    rows = {300: 150.0, 275: 140.0, 250: 130.0, 225: 100.0, 200: 130.0, 175: 140.0, 150: 150.0}
    kw = {"max_refines": 0, "confirm": 0.0, "k_ambiguous": 0.0, "steep": math.inf}
    assert _drive(Adaptive(**kw, settle=1.0), rows) == _drive(Adaptive(**kw, settle=0.0), rows)


def test_a_skipped_limit_next_to_a_rival_is_profiled() -> None:
    """A limit skipped while the cost fell steeply is profiled at the end when it lies next to a
    rival of the best (200 W, next to 175 W, 0.5% off the best 150 W), not only next to the best;
    one next to a limit clearly worse (250 W, next to 225 W, 6.7% off) stays skipped."""
    rows = {300: 140.0, 275: 125.0, 250: 112.0, 225: 104.0, 200: 100.0, 175: 98.0, 150: 97.5}
    rows |= {125: 105.0, 100: 115.0}
    no_extension = {"k_ambiguous": 0.0, "guard_extend": 0.0}
    results = _drive(Adaptive(steep=0.03, confirm=0.0, max_refines=0, **no_extension), rows)
    visited = [r.power_limit for r in results]
    assert visited[:6] == [300, 275, 225, 175, 125, 150]  # 250, 200 skipped; 150 taken back.
    assert 200 in visited and 250 not in visited


def test_no_skip_after_a_skip_was_taken_back() -> None:
    """Once the fall stopped across a skip (taken back at once), the descent skips no more: on a
    rough profile a skipped limit can hide a dip that neither neighbour hints at (the out-of-fold
    cases whose optimum was never profiled). Here 250 W is skipped and taken back (225 W is not
    3% below 275 W); skipping on from 225 W would step over the optimum, 200 W, whose neighbours
    (225 W, 175 W) are 12-18% costlier, neither a rival of the best found elsewhere (125 W)."""
    rows = {300: 130.0, 275: 120.0, 250: 125.0, 225: 118.0, 200: 100.0, 175: 112.0}
    rows |= {150: 108.0, 125: 104.0, 100: 115.0}
    results = _drive(Adaptive(k_ambiguous=0.0, guard_extend=0.0), rows)
    visited = [r.power_limit for r in results]
    assert visited[:5] == [300, 275, 225, 250, 200]  # 250 skipped, taken back; then no skips.
    assert set(visited) == set(rows)
    assert Energy().select(aggregate(results, 40)) == 200


def _drive_with_outlier(
    search: Adaptive, rows: dict[int, float], outlier: int, high: float
) -> list[WindowResult]:
    """Like `_drive`, but the first window at `outlier` reads `high` x its true energy."""
    plan = search.plan(sorted(rows, reverse=True), 10, 40, Energy())
    results: list[WindowResult] = []
    while (probe := plan.next_probe(tuple(results), len(results))) is not None:
        scale = probe.profile_steps / 40
        first = probe.power_limit == outlier and all(r.power_limit != outlier for r in results)
        energy = rows[probe.power_limit] * scale * (high if first else 1.0)
        results.append(WindowResult(probe.power_limit, probe.profile_steps, 10.0 * scale, energy))
    return results


def test_guard_reprofiles_an_optimum_hidden_by_one_high_short_window() -> None:
    """The out-of-fold worst case (A40 bert, ZeusCost(1)): the optimum (200 W) is read once, in
    a 4-step window that came out 9% high (under 3 sigmas of such a window), the next limit
    (175 W, 5.1% costlier) looks best and is confirmed. 200 W lies beyond `k_refine` sigmas (it
    guards against 1% misjudgements), so without the guard the search ends on 175 W: a 5.1%
    regret. The guard profiles 200 W once more (it could still be >3% cheaper within `k_guard`
    sigmas); the pick is then the optimum."""
    rows = {300: 128.3, 275: 121.5, 250: 113.4, 225: 107.0, 200: 100.0, 175: 105.1}
    rows |= {150: 121.4, 125: 153.9, 100: 202.2}
    # One window per limit on the way down (no skip, no extension), as in that case around 200 W.
    kw = {"chunk": 0.1, "confirm": 0.75, "k_refine": 1.25, "steep": math.inf, "k_ambiguous": 0.0}
    kw |= {"guard_extend": 0.0}
    previous, guarded = Adaptive(k_guard=0.0, **kw), Adaptive(k_guard=2.5, **kw)

    def pick(results: list[WindowResult]) -> int:
        return Energy().select(aggregate(results, 40))

    plain = _drive_with_outlier(previous, rows, outlier=200, high=1.09)
    assert sum(r.steps for r in plain if r.power_limit == 200) == 4  # One short window...
    assert pick(plain) == 175  # ...and the pick is off by 5.1%.
    fixed = _drive_with_outlier(guarded, rows, outlier=200, high=1.09)
    assert fixed[: len(plain)] == plain  # The guard acts only once the old rule would stop.
    assert fixed[len(plain)] == WindowResult(200, 4, 1.0, 10.0)  # 200 W once more, a chunk.
    assert pick(fixed) == 200
    assert sum(r.steps for r in fixed if r.power_limit == 200) >= 30  # Then confirmed.
    assert pick(_drive(guarded, rows)) == 200  # Without the outlier: the same pick.


def test_guard_extension_reprofiles_a_high_reading_in_place() -> None:
    """The same case, caught while the limit is still set: 200 W reads 9% high in its first
    4-step window and looks costlier than 225 W, but could be >3% cheaper at 3 sigmas, so it is
    extended in place (no warm-up, unlike the guard's visit after the descent) until the pooled
    reading rules that out or it reaches `guard_extend` x profile_steps. With the end guard off,
    the pick is the optimum only with the extension."""
    rows = {300: 128.3, 275: 121.5, 250: 113.4, 225: 107.0, 200: 100.0, 175: 105.1}
    rows |= {150: 121.4, 125: 153.9, 100: 202.2}
    kw = {"chunk": 0.1, "confirm": 0.75, "k_refine": 1.25, "steep": math.inf, "k_ambiguous": 0.0}
    kw |= {"k_guard": 0.0}

    def pick(results: list[WindowResult]) -> int:
        return Energy().select(aggregate(results, 40))

    plain = _drive_with_outlier(Adaptive(guard_extend=0.0, **kw), rows, outlier=200, high=1.09)
    assert pick(plain) == 175
    extended = _drive_with_outlier(Adaptive(guard_extend=0.5, **kw), rows, outlier=200, high=1.09)
    first = next(i for i, r in enumerate(extended) if r.power_limit == 200)
    assert extended[first + 1] == WindowResult(200, 4, 1.0, 10.0)  # In place, the next window.
    assert pick(extended) == 200
    # The extension stops at guard_extend x profile_steps, however suspicious the limit stays.
    capped = _drive_with_outlier(Adaptive(guard_extend=0.2, **kw), rows, outlier=200, high=1.09)
    run = [r.power_limit for r in capped[first : first + 3]]
    assert run == [200, 200, 175]


def test_tuner_pairs_a_change_over_the_time_cap_with_a_cheaper_one() -> None:
    tuner = _bench("tune_adaptive_search")
    cap = tuner.TIME_CAP

    def summary(within: float, time: float) -> dict[str, float]:
        return {"within_1pct": within, "tail_3pct": 0.0, "worst_regret": 0.04, "time_ratio": time}

    current = dict(tuner.PREVIOUS_DEFAULTS)
    guard = {**current, "k_guard": 2.5}  # better, but over the time cap: flagged
    cheap = {**current, "confirm": 0.5}  # a little worse, cheaper: a partner
    slow = {**current, "settle": 1.0}  # worse and dearer: neither
    singles = [
        ("k_guard", guard, summary(0.95, cap + 0.01)),
        ("confirm", cheap, summary(0.935, cap - 0.02)),
        ("settle", slow, summary(0.93, cap + 0.01)),
    ]
    pairs = tuner.pair_moves(current, summary(0.94, cap - 0.005), singles)
    assert pairs == [{**current, "k_guard": 2.5, "confirm": 0.5}]
    # Nothing is flagged when no change is held back by the time alone.
    assert tuner.pair_moves(current, summary(0.96, cap - 0.005), singles) == []


def test_tuner_tail_stage_weighs_cases_above_4_percent() -> None:
    """The tail stage scores every `TAIL_SPACE` combination on the training profiles only and
    prefers fewer near misses of the 5% goal at the same within-1% share and time."""
    tuner = _bench("tune_adaptive_search")
    grid_size = math.prod(len(v) for v in tuner.TAIL_SPACE.values())

    def tally(tail4: int, time: float, cases: int = 1000) -> bench.Tally:
        return bench.Tally(
            cases=cases, within=950, tail=5, tail4=tail4, spent=time, spent_exhaustive=1.0
        )

    class FakeEvaluator:
        calls: list[list[dict]] = []

        def __call__(self, settings: list[dict]) -> list[list[bench.Tally]]:
            self.calls.append(settings)
            out = []
            for s in settings:
                # Held-out profile (index 1) would favour 0.3; training (index 0) the 0.5.
                train = tally(1 if s["guard_extend"] == 0.5 else 4, 0.45)
                held = tally(0 if s["guard_extend"] == 0.3 else 9, 0.45)
                if s["guard_extend"] == 0.6:
                    train = tally(0, 0.49)  # Fewest near misses, but over the time cap.
                out.append([train, held])
            return out

    evaluate = FakeEvaluator()
    base = {"k_refine": 1.5, "k_guard": 2.5, "chunk": 0.1}
    result = tuner.tail_stage(base, [True, False], evaluate)
    assert len(evaluate.calls[0]) == len(result["grid"]) == grid_size
    assert result["params"]["guard_extend"] == 0.5 and result["params"]["chunk"] == 0.1
    first = tuner.tail_score(
        {
            "within_1pct": 0.95,
            "tail_3pct": 0.0,
            "tail_4pct": 0.0,
            "worst_regret": 0.04,
            "time_ratio": 0.4,
        }
    )
    second = tuner.tail_score(
        {
            "within_1pct": 0.95,
            "tail_3pct": 0.0,
            "tail_4pct": 0.001,
            "worst_regret": 0.04,
            "time_ratio": 0.4,
        }
    )
    assert first[0] - second[0] == pytest.approx(tuner.TAIL4_WEIGHT * 0.001)


# Windows the machine leaves out (discarded, or redone MAX_REDOS times) ---------------------------
def _drive_leaving_out(
    search: Adaptive, rows: dict[int, float], leave: Callable[[int, Probe], bool]
) -> tuple[list[Probe], list[bool], list[WindowResult]]:
    """Like `_drive`, but a window `leave(index, probe)` says is left out closes and is never
    recorded (`started` counts it, as the machine's does). Returns the probes, whether each was
    recorded, and the results."""
    plan = search.plan(sorted(rows, reverse=True), 10, 40, Energy())
    probes: list[Probe] = []
    recorded: list[bool] = []
    results: list[WindowResult] = []
    while (probe := plan.next_probe(tuple(results), len(probes))) is not None:
        probes.append(probe)
        assert len(probes) < 200, "the search does not end"
        recorded.append(not leave(len(probes) - 1, probe))
        if recorded[-1]:
            scale = probe.profile_steps / 40
            results.append(
                WindowResult(
                    probe.power_limit,
                    probe.profile_steps,
                    10.0 * scale,
                    rows[probe.power_limit] * scale,
                )
            )
    return probes, recorded, results


def test_a_left_out_descent_limit_is_passed_over_not_read() -> None:
    """Defect: the machine left out the 275 W window (redone too often) and the adaptive
    search, still descending at 275 W, read its cost: KeyError 275 out of `machine.redo`. The
    descent goes on past it; 275 W is never profiled again."""
    plan = Adaptive().plan([300, 275, 250, 225], 10, 40, Energy())
    first = plan.next_probe((), 0)
    assert first == Probe(300, 10, 4)
    results = (WindowResult(300, 4, 1.0, 100.0),)
    assert plan.next_probe(results, 1) == Probe(275, 10, 4)
    assert plan.next_probe(results, 2) == Probe(250, 10, 4)  # 275 W was left out
    rows = {300: 100.0, 275: 97.0, 250: 95.0, 225: 94.0, 200: 96.0, 175: 99.0, 150: 103.0}
    probes, _, results = _drive_leaving_out(Adaptive(), rows, lambda i, p: p.power_limit == 250)
    assert [p.power_limit for p in probes].count(250) == 1
    assert Energy().select(aggregate(results, 40)) == 225


def test_an_extension_in_place_follows_only_a_recorded_window() -> None:
    """275 W reads as 300 W: the search extends it in place (no warm-up). When that window is
    left out, 275 W is not profiled again (before, it was extended "in place" again and again)
    and the descent goes on, warming up at its next limit."""
    rows = {300: 100.0, 275: 100.0, 250: 120.0, 225: 140.0}
    probes, _, _ = _drive_leaving_out(Adaptive(), rows, lambda i, p: False)
    assert probes[2:4] == [Probe(275, 0, 4), Probe(275, 0, 4)]
    probes, _, _ = _drive_leaving_out(Adaptive(), rows, lambda i, p: i == 2)
    assert probes[3] == Probe(250, 10, 4)
    assert [p.power_limit for p in probes[3:]].count(275) == 0


def test_left_out_windows_are_never_profiled_again_nor_extended_in_place() -> None:
    """Random profiles and left-out windows: the search ends, never profiles a limit again
    once a window of it was left out, and opens a window without warm-up only right after a
    recorded window of that limit."""
    rng = random.Random(5)
    limits = list(range(300, 99, -25))
    for _ in range(300):
        shape = rng.random()
        if shape < 0.3:
            rows = {pl: rng.uniform(80.0, 120.0) for pl in limits}
        elif shape < 0.6:  # nearly flat: windows are extended in place
            rows = {pl: rng.uniform(99.0, 101.0) for pl in limits}
        else:  # a valley, steep on the way down (skips)
            low = rng.choice(limits)
            rows = {
                pl: 100.0 * (1 + 0.004 * abs(pl - low) / 25 * rng.uniform(1, 12)) for pl in limits
            }
        p_leave = rng.choice([0.0, 0.1, 0.3, 1.0])
        search = Adaptive(steep=rng.choice([0.03, 0.0, math.inf]), confirm=rng.choice([0.5, 1.0]))
        leave = lambda i, p, q=p_leave: rng.random() < q  # noqa: E731
        probes, recorded, _ = _drive_leaving_out(search, rows, leave)
        for i, probe in enumerate(probes):
            assert all(recorded[j] for j in range(i) if probes[j].power_limit == probe.power_limit)
            if probe.warmup_steps == 0:
                assert i > 0 and recorded[i - 1] and probes[i - 1].power_limit == probe.power_limit
        if p_leave == 1.0:
            assert [p.power_limit for p in probes] == limits


def test_the_machine_goes_on_after_the_adaptive_search_s_window_is_redone_too_often() -> None:
    """The crash's path: `redo` of the 275 W window, MAX_REDOS times, then it is discarded and
    the machine asks the search for the next probe (KeyError 275 before)."""
    machine = PowerLimitStateMachine(
        250, 300, Energy(), wait_steps=0, warmup_steps=1, profile_steps=10, search="adaptive"
    )
    machine.start()
    windows: list[int] = []
    for _ in range(500):
        for effect in machine.on_step_begin():
            if isinstance(effect, EndWindow):
                limit = int(effect.name.rsplit("_", 1)[1])
                windows.append(limit)
                if limit == 275:
                    machine.redo(effect.name)
                else:
                    machine.record(effect.name, 1.0, {300: 100.0, 250: 90.0}[limit])
        if machine.optimal_power_limit is not None:
            break
    assert machine.optimal_power_limit == 250
    assert windows.count(275) == MAX_REDOS + 1 and machine.redos() == {275: MAX_REDOS}
    assert [m.power_limit for m in machine.measurements] == [300, 250]


def test_when_every_adaptive_window_is_left_out_the_machine_has_nothing_to_choose() -> None:
    """Before, the adaptive search proposed the first limit again and again (no result yet):
    a job whose GPUs measure no energy never gave up. Each limit is tried once."""
    machine = PowerLimitStateMachine(
        250, 300, Energy(), wait_steps=0, warmup_steps=0, profile_steps=10, search="adaptive"
    )
    machine.start()
    windows: list[int] = []
    with pytest.raises(PowerLimitError, match="no window was measured"):
        for _ in range(500):
            for effect in machine.on_step_begin():
                if isinstance(effect, EndWindow):
                    windows.append(int(effect.name.rsplit("_", 1)[1]))
                    machine.discard(effect.name)
    assert windows == [300, 275, 250]
