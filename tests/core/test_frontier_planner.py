"""The Perseus frontier planner: profiles, evaluation, choice, and answers vs lowtime 0.3.0."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from coordinator.pipeline.planner import (
    DEFAULT_P_BLOCK_W,
    FrontierPoint,
    InstructionProfile,
    choose,
    evaluate,
    max_frequency_plan,
    plan_frontier,
)
from coordinator.pipeline.planner.dag import Synchronous1F1B, build_dag
from coordinator.pipeline.planner.profile_file import load_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "data" / "perseus" / "stage_profiles"
FRONTIERS = ROOT / "data" / "perseus" / "frontiers" / "a100_sxm"
P = DEFAULT_P_BLOCK_W


def fastest_critical_path(profile: InstructionProfile, m: int, quantum: float = 0.0) -> float:
    dag = build_dag(Synchronous1F1B(profile.num_stages, m))
    fastest = {key: min(t for _, t, _ in rows) for key, rows in profile.entries.items()}
    times = [fastest[(n.stage, n.instruction)] for n in dag.nodes]
    if quantum:
        times = [math.floor(t / quantum + 1e-9) * quantum for t in times]
    return dag.longest_path(times)


def stored_frontier(model: str, m: int) -> list[tuple[float, float]]:
    with gzip.open(FRONTIERS / f"{model}_bf16_mb{m}.csv.gz", "rt") as f:
        next(f)
        return [(float(a), float(b)) for a, b in (line.split(",") for line in f if line.strip())]


def check_frontier(profile: InstructionProfile, frontier: list[FrontierPoint], m: int) -> None:
    assert frontier
    times = [p.time for p in frontier]
    energies = [p.energy for p in frontier]
    assert times == sorted(times)
    assert all(a > b for a, b in itertools.pairwise(energies))
    assert times[0] == pytest.approx(fastest_critical_path(profile, m), rel=1e-9)
    dag = build_dag(Synchronous1F1B(profile.num_stages, m))
    for point in frontier[:: max(1, len(frontier) // 7)] + [frontier[-1]]:
        for stage, row in enumerate(point.plan):
            assert [name for name, _ in row] == [
                dag.nodes[v].instruction for v in dag.stage_nodes[stage]
            ]
        t, e = evaluate(profile, point.plan, m, P)
        assert t == pytest.approx(point.time, rel=1e-9)
        assert e == pytest.approx(point.energy, rel=1e-9)


# ---------------------------------------------------------------------------------- profiles


def test_load_lowtime_format() -> None:
    profile = load_profile(PROFILES / "gpt3-175b+a100_sxm_bf16.csv")
    assert profile.num_stages == 8
    assert profile.instructions(7) == ["backward", "forward"]
    rows = profile.entries[(0, "forward")]
    assert rows[0][0] == 1410 and len(rows) == 38
    assert profile.lookup(0, "forward", 1410) == pytest.approx((0.05016166687011708, 23.805472))


def test_load_zeus_format_merges_ranks(tmp_path: Path) -> None:
    path = tmp_path / "profile.csv"
    path.write_text(
        "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
        "0,0,0,0,0,forward,1410,0.010,3.0\n"
        "0,0,0,0,0,backward,1410,0.020,6.0\n"
        "1,1,0,0,0,forward,1410,0.012,5.0\n"
        "1,1,0,0,0,backward,1410,0.018,4.0\n"
        "2,0,1,0,1,forward,1410,0.011,3.5\n"
        "2,0,1,0,1,backward,1410,0.021,6.5\n"
    )
    profile = load_profile(path)
    assert profile.num_stages == 2
    assert profile.lookup(0, "forward", 1410) == pytest.approx((0.012, 4.0))  # max time, mean E
    assert profile.lookup(0, "backward", 1410) == pytest.approx((0.020, 5.0))
    frontier = plan_frontier(profile, 3)
    assert len(frontier) == 1 and frontier[0].plan[1][0] == ("forward", 1410)


def test_bad_profiles(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text("stage,instruction,frequency,time\n0,forward,1410,0.1\n")
    with pytest.raises(ValueError, match="energy"):
        load_profile(path)
    for row in [
        (0, "forward", 1410, 0.0, 1.0),
        (0, "forward", 1410, 0.1, -1.0),
        (0, "forward", 1410, math.nan, 1.0),
        (0, "forward", 14.5, 0.1, 1.0),
        (1, "forward", 1410, 0.1, 1.0),  # Stage 0 missing.
    ]:
        with pytest.raises(ValueError):
            InstructionProfile.from_rows([row])
    with pytest.raises(ValueError):
        InstructionProfile.from_rows([])
    one_stage = InstructionProfile.from_rows([(0, "forward", 1410, 0.1, 1.0)])
    with pytest.raises(ValueError, match="no backward"):
        plan_frontier(one_stage, 2)
    two = InstructionProfile.from_rows(
        [(s, i, 1410, 0.1, 1.0) for s in range(2) for i in ("forward", "backward")]
    )
    with pytest.raises(ValueError, match="stages"):
        plan_frontier(two, 2, num_stages=3)
    with pytest.raises(ValueError):
        plan_frontier(two, 0)


def test_one_stage_profile_serves_every_stage() -> None:
    rows = [(0, "forward", f, t, e) for f, t, e in [(1410, 0.01, 3.0), (1200, 0.012, 2.4)]]
    rows += [(0, "backward", f, t, e) for f, t, e in [(1410, 0.02, 6.0), (1200, 0.024, 4.9)]]
    profile = InstructionProfile.from_rows(rows)
    frontier = plan_frontier(profile, 4, num_stages=3)
    assert len(frontier[0].plan) == 3
    check_frontier(profile.for_stages(3), frontier, 4)


def test_evaluate_refuses_plans_that_do_not_fit() -> None:
    profile = load_profile(PROFILES / "bloom+a100_sxm_bf16.csv")
    plan = [list(row) for row in max_frequency_plan(profile, 2)]
    evaluate(profile, plan, 2, P)
    with pytest.raises(ValueError):
        evaluate(profile, plan, 3, P)
    swapped = [list(row) for row in plan]
    swapped[0][0], swapped[0][-1] = swapped[0][-1], swapped[0][0]
    with pytest.raises(ValueError):
        evaluate(profile, swapped, 2, P)
    plan[0][0] = ("forward", 1411)
    with pytest.raises(KeyError):
        evaluate(profile, plan, 2, P)


# ------------------------------------------------------------------------- real profiles


@pytest.mark.parametrize("model", ["gpt3-175b", "bloom"])
def test_a100_frontier_vs_lowtime_stored(model: str) -> None:
    profile = load_profile(PROFILES / f"{model}+a100_sxm_bf16.csv")
    m = 12
    frontier = plan_frontier(profile, m)
    check_frontier(profile, frontier, m)
    # T_min: lowtime's is the floor-quantized (1 ms) critical path at the fastest options.
    stored = stored_frontier(model, m)
    stored_tmin = min(t for t, _ in stored)
    assert round(stored_tmin * 1000) == round(fastest_critical_path(profile, m, 1e-3) * 1000)
    # Energies: lowtime's times are quantized down, so align the fastest points (and add the
    # blocking energy of that shift); then ours is never worse by more than 1%.
    shift = frontier[0].time - stored_tmin
    assert 0 <= shift < 2 * m * 8 * 1e-3
    compared = 0
    for t, e in stored:
        t, e = t + shift, e + 8 * P * shift
        ours = min(p.energy for p in frontier if p.time <= t * (1 + 1e-12))
        assert ours <= 1.01 * e, (t, ours, e)
        compared += 1
    assert compared == len(stored)
    # Savings at T_min at least lowtime's published ones (README: 15.2% and 10.5%).
    all_max = evaluate(profile, max_frequency_plan(profile, m), m, P)
    saving = 1 - frontier[0].energy / all_max[1]
    assert saving >= {"gpt3-175b": 0.152, "bloom": 0.105}[model]


@pytest.mark.parametrize("model", ["gpt3-175b", "bloom"])
@pytest.mark.parametrize("m", [12, 24, 48, 96])
def test_tmin_quantized_matches_stored(model: str, m: int) -> None:
    # The planner's fastest point is this critical path (checked above for M = 12 and in
    # bench/perseus_planner.py for every M); floor-quantized it is lowtime's stored T_min.
    profile = load_profile(PROFILES / f"{model}+a100_sxm_bf16.csv")
    stored_tmin = min(t for t, _ in stored_frontier(model, m))
    assert round(stored_tmin * 1000) == round(fastest_critical_path(profile, m, 1e-3) * 1000)


def test_small_real_frontier_and_choices() -> None:
    profile = load_profile(PROFILES / "gpt3-175b+a40_bf16.csv")
    frontier = plan_frontier(profile, 4, unit_time=0)
    check_frontier(profile, frontier, 4)
    coarse = plan_frontier(profile, 4, unit_time=0.05)
    assert len(coarse) < len(frontier)
    check_frontier(profile, coarse, 4)
    assert all(b.time - a.time > 0 for a, b in itertools.pairwise(coarse))
    all_max_time, all_max_energy = evaluate(profile, max_frequency_plan(profile, 4), 4, P)
    default = choose(frontier, all_max_time=all_max_time)
    assert default.time <= all_max_time and default.energy < all_max_energy
    assert default == min((p for p in frontier if p.time <= all_max_time), key=lambda p: p.energy)
    slow = choose(frontier, max_slowdown=0.05, all_max_time=all_max_time)
    assert slow.time <= 1.05 * all_max_time and slow.energy <= default.energy
    assert choose(frontier, target_time=0.0) == frontier[0]
    assert choose(frontier, target_time=math.inf) == frontier[-1]
    assert choose(frontier, eta_knob=1.0) == frontier[-1]
    assert choose(frontier, eta_knob=0.0) == frontier[0]
    with pytest.raises(ValueError):
        choose(frontier, eta_knob=0.5, target_time=1.0)
    with pytest.raises(ValueError):
        choose([])


def test_exact_on_tiny_pipelines() -> None:
    # Brute force over every clock combination: our frontier is never below the true one
    # (its points are real plans) and the fastest point is the true fastest. It is not the
    # exact discrete frontier (that problem is NP-hard; the planner follows the convex
    # relaxation and rounds): on this 4-instruction chain it is within 2.1% of it.
    rows = []
    for stage in range(2):
        for name, base in (("forward", 0.010), ("backward", 0.020)):
            for j, f in enumerate((1410, 1300, 1200, 1100)):
                t = base * (1 + 0.1 * j)
                rows.append((stage, name, f, t, 10 - 2.5 * j + 0.3 * j * j + P * t))
    profile = InstructionProfile.from_rows(rows)
    dag = build_dag(Synchronous1F1B(2, 1))
    options = [profile.entries[(n.stage, n.instruction)] for n in dag.nodes]
    truth = []
    for combo in itertools.product(*[range(len(o)) for o in options]):
        d = [options[i][c][1] for i, c in enumerate(combo)]
        t = dag.longest_path(d)
        e = sum(options[i][c][2] for i, c in enumerate(combo)) + P * (2 * t - sum(d))
        truth.append((t, e))
    frontier = plan_frontier(profile, 1, unit_time=0)
    assert frontier[0].time == pytest.approx(min(t for t, _ in truth))
    for point in frontier:
        assert min(e for t, e in truth if t <= point.time * (1 + 1e-12)) <= point.energy + 1e-9
    best = math.inf
    for t, e in sorted(truth):
        if e < best - 1e-9:
            best = e
            ours = min(p.energy for p in frontier if p.time <= t * (1 + 1e-12))
            assert ours <= e * 1.03, (t, ours, e)


# ------------------------------------------------------------------ against lowtime 0.3.0


def _bench() -> ModuleType:
    path = ROOT / "bench" / "perseus_planner.py"
    spec = importlib.util.spec_from_file_location("bench_perseus_planner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_perseus_planner", module)
    spec.loader.exec_module(module)
    return module


def random_profile(seed: int, num_stages: int) -> InstructionProfile:
    """Pareto options >= 2 ms apart (>= 4 per instruction, as lowtime's cost fit needs),
    costs not always convex, plus dominated options (time not monotone in the clock)."""
    rng = random.Random(seed)
    rows = []
    for stage in range(num_stages):
        bases = (("forward", rng.uniform(0.01, 0.03)), ("backward", rng.uniform(0.02, 0.06)))
        for name, base in bases:
            t, cost = base, rng.uniform(2, 10)
            freqs = sorted(rng.sample(range(900, 1500, 15), rng.randint(4, 8)), reverse=True)
            for j, f in enumerate(freqs):
                rows.append((stage, name, f, t, cost + P * t))
                t += rng.uniform(0.002, 0.008)
                cost -= rng.uniform(0.05, 1.0) * (0.6**j if rng.random() < 0.7 else 1)
            for _ in range(rng.randint(0, 2)):
                f = rng.choice(range(905, 1500, 15))
                rows.append((stage, name, f, base + rng.uniform(0, 0.03), cost + 5 + P * base * 2))
    return InstructionProfile.from_rows(rows)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    num_stages=st.integers(2, 4),
    microbatches=st.integers(1, 5),
)
@example(seed=65, num_stages=2, microbatches=5)  # 1.04% above lowtime before mixed roundings
def test_not_worse_than_lowtime(seed: int, num_stages: int, microbatches: int) -> None:
    pytest.importorskip("lowtime")
    bench = _bench()
    profile = random_profile(seed, num_stages)
    ours = plan_frontier(profile, microbatches, unit_time=0)
    check_frontier(profile, ours, microbatches)
    try:
        theirs, _ = bench.lowtime_frontier(profile, microbatches, budget_s=20)
    except (ValueError, TypeError, RuntimeError):
        assume(False)  # lowtime's exponential fit failed on this profile.
        return
    assume(theirs)
    for t, e, _ in theirs:
        best = min(p.energy for p in ours if p.time <= t * (1 + 1e-12))
        assert best <= 1.01 * e, (t, best, e)
