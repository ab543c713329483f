"""InstructionProfiler: schedules, warm-up, early stop, the energy fit, the CSV, errors, 3D.

Pure and deterministic: synthetic results from exact models (a counter quantized to 100 ms whose
updates fall on the iteration boundaries, so windows are exact while per-instruction readings
are not), and the seeded simulation of `bench/instruction_profiler.py`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from coordinator.pipeline.dumps import write_file, write_files
from coordinator.pipeline.schedulers import SchedulerError
from coordinator.pipeline.schedulers.instruction_profiler import (
    InstructionProfiler,
    InstructionProfiler3D,
    coarse_grid,
)
from zeus_agent import pipeline_order
from zeus_agent.models import (
    CSV_COLUMNS,
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    ProfilingResult,
    RankInfo,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_bench() -> ModuleType:
    name = "instruction_profiler_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "instruction_profiler.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

CLOCKS = list(range(1500, 690, -30))  # 1500 ... 720 MHz
TICK = 0.1


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[str]:
    return [kind for kind, _ in pipeline_order.one_f_one_b(stage, stages, microbatches)]


def infos_for(stages: int = 4, microbatches: int = 4, dp: int = 1) -> list[RankInfo]:
    return [
        RankInfo(rank=d * stages + s, dp_rank=d, pp_rank=s, tp_rank=0,
                 available_frequencies=CLOCKS,
                 instructions=one_f_one_b(stages, microbatches, s))
        for d in range(dp) for s in range(stages)
    ]


def job_for(stages: int = 4, dp: int = 1) -> JobInfo:
    return JobInfo(pp_degree=stages, dp_degree=dp, tp_degree=1, world_size=stages * dp)


# ------------------------------------------------------------------ an exact synthetic pipeline


def t_fwd(f: int) -> float:
    return 0.02 * 1500 / f


def t_bwd(f: int) -> float:
    return 0.04 * 1500 / f


class Synthetic:
    """Per-instruction time t(f), power P(f); waiting at `p_block`; tick-aligned iterations.

    Every iteration lasts a whole number of counter updates, so the counter read at its ends is
    exact; per-instruction readings (instructions back to back from the start) are quantized.
    The iteration length also varies from round to round (`extra`), as other stages would make
    it, so waiting time is not proportional to busy time.
    """

    def __init__(self, p_fwd: Callable[[int], float], p_bwd: Callable[[int], float],
                 p_block: float = 40.0, corrupt_first: bool = False) -> None:
        self.p = {"forward": p_fwd, "backward": p_bwd}
        self.t = {"forward": t_fwd, "backward": t_bwd}
        self.p_block = p_block
        self.corrupt_first = corrupt_first
        self.round = 0
        self.last: dict[int, list[tuple[str, int]]] = {}

    def results(self, schedules: list[FrequencySchedule], n: int = 5) -> list[ProfilingResult]:
        busy = {s.rank: sum(self.t[k](f) for k, f in s.frequencies) for s in schedules}
        extra = (0.0, 0.35, 0.1, 0.6, 0.2)[self.round % 5]
        length = TICK * math.ceil((max(busy.values()) + extra) / TICK - 1e-9)
        out = []
        for s in schedules:
            switched = self.last.get(s.rank) != s.frequencies
            tb: dict[str, list[list[float]]] = {"forward": [], "backward": []}
            eb: dict[str, list[list[float]]] = {"forward": [], "backward": []}
            times, energies = [], []
            for i in range(n):
                now, energy = 0.0, 0.0
                spans: list[tuple[str, float, float, float, float]] = []
                for k in tb:
                    tb[k].append([])
                    eb[k].append([])
                for kind, f in s.frequencies:
                    dt = self.t[kind](f)
                    spans.append((kind, now, now + dt, energy, self.p[kind](f)))
                    tb[kind][i].append(dt)
                    now += dt
                    energy += self.p[kind](f) * dt

                def true_energy(t: float, spans: list = spans) -> float:
                    for _, start, end, e0, power in spans:
                        if start <= t <= end:
                            return e0 + power * (t - start)
                    return spans[-1][3] + spans[-1][4] * (spans[-1][2] - spans[-1][1])

                def counter(t: float) -> float:
                    return true_energy(math.floor(t / TICK + 1e-9) * TICK)

                for kind, start, end, _, _ in spans:
                    # A quantized per-instruction reading: garbage for short instructions.
                    eb[kind][i].append(counter(end) - counter(start))
                energy += self.p_block * (length - now)
                it_time = length
                if switched and i == 0 and self.corrupt_first:
                    energy *= 3.0  # a warm-up iteration: nothing like the steady state
                    it_time += 0.7
                times.append(it_time)
                energies.append(energy)
            out.append(ProfilingResult(rank=s.rank, iter_time=times, iter_energy=energies,
                                       time_breakdown=tb, energy_breakdown=eb))
            self.last[s.rank] = s.frequencies
        self.round += 1
        return out


def drive(profiler: InstructionProfiler, model: Synthetic, max_rounds: int = 100) -> int:
    rounds = 0
    while not profiler.finished and rounds < max_rounds:
        profiler.observe(model.results(profiler.next_schedule()))
        rounds += 1
    assert profiler.finished
    return rounds


def p_bwd_lin(f: int) -> float:
    return 100.0 + 0.1 * f


# ------------------------------------------------------------------ schedules


def test_schedule_shape_clocks_and_highest_first() -> None:
    infos = infos_for()
    prof = InstructionProfiler(job_for(), infos, {}, clocks=5)
    first = prof.next_schedule()
    assert [s.rank for s in first] == [0, 1, 2, 3]
    for sched, info in zip(first, infos, strict=True):
        assert [n for n, _ in sched.frequencies] == info.instructions
        assert {f for _, f in sched.frequencies} == {max(CLOCKS)}
    model = Synthetic(p_bwd_lin, p_bwd_lin)
    seen_levels: list[int] = []
    while not prof.finished:
        schedules = prof.next_schedule()
        for sched, info in zip(schedules, infos, strict=True):
            assert [n for n, _ in sched.frequencies] == info.instructions
            assert all(f in CLOCKS for _, f in sched.frequencies)
        seen_levels.append(min(f for _, f in schedules[0].frequencies))
        prof.observe(model.results(schedules))
    grid = coarse_grid(CLOCKS, 5, 0.5)
    assert grid[0] == max(CLOCKS) and grid == sorted(grid, reverse=True)
    # Staircase after the 3 blocking rounds: going down, never back up (before replays).
    stair = seen_levels[3:3 + 2 * (len(grid) - 1)]
    assert stair == sorted(stair, reverse=True)


def test_grid_evenly_in_period_and_snapped() -> None:
    grid = coarse_grid(CLOCKS, 6, 0.5)
    assert grid[0] == 1500 and all(f in CLOCKS for f in grid)
    assert grid[-1] == 750  # 0.5 * 1500
    periods = [1 / f for f in grid]
    steps = [b - a for a, b in zip(periods, periods[1:], strict=False)]
    assert max(steps) / min(steps) < 1.3
    assert coarse_grid([1000], 8, 0.5) == [1000]


def test_finished_scheduler_serves_all_max_and_progress() -> None:
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=4)
    assert prof.progress() == (0, 9)
    model = Synthetic(p_bwd_lin, p_bwd_lin)
    rounds = drive(prof, model)
    assert prof.progress() == (rounds, rounds)
    for sched in prof.next_schedule():
        assert {f for _, f in sched.frequencies} == {max(CLOCKS)}
    prof.observe(model.results(prof.next_schedule()))  # ignored
    assert all({f for _, f in s.frequencies} == {max(CLOCKS)} for s in prof.next_schedule())


# ------------------------------------------------------------------ the fit


def _p_fwd_orthogonal(grid: list[int]) -> Callable[[int], float]:
    # P_fwd differs from P_bwd at two levels, with a difference orthogonal to the one direction
    # the windows cannot see (so the equal-power prior does not move it).
    c = [1 / t_fwd(f) + 1 / t_bwd(f) for f in grid]
    d = {grid[0]: 12.0, grid[1]: -12.0 * c[0] / c[1]}
    return lambda f: p_bwd_lin(f) + d.get(f, 0.0)


@pytest.mark.parametrize("corrupt", [False, True])
def test_regression_recovers_powers_exactly(corrupt: bool) -> None:
    grid = coarse_grid(CLOCKS, 4, 0.5)
    p_fwd = _p_fwd_orthogonal(grid)
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=4, prior_weight=1e-4,
                               stop_after_rising=10)
    drive(prof, Synthetic(p_fwd, p_bwd_lin, p_block=40.0, corrupt_first=corrupt))
    for rank in range(4):
        est = prof.estimates(rank)
        assert est["p_block_w"] == pytest.approx(40.0, rel=1e-3)
        for (kind, f), power in est["power"].items():
            truth = p_fwd(f) if kind == "forward" else p_bwd_lin(f)
            assert power == pytest.approx(truth, rel=1e-4), (rank, kind, f)
    assert prof.result is not None
    entry = prof.result.root[0]
    for f in grid:
        assert entry.forward_time[f] == pytest.approx(t_fwd(f), rel=1e-9)
        assert entry.forward_energy[f] == pytest.approx(p_fwd(f) * t_fwd(f), rel=1e-4)
        assert entry.backward_energy[f] == pytest.approx(p_bwd_lin(f) * t_bwd(f), rel=1e-4)


def test_a_setting_seen_briefly_in_a_low_reading_window_gets_no_negative_power() -> None:
    """Found by a loaded e2e run (a profile row with energy <= 0): the unbounded least squares
    gave a setting seen for 0.05 s in one window whose energy read 20 J low a power of about
    -500 W. The fit is bounded: every busy power is at least MIN_POWER_FRACTION of the rank's
    mean power, P_block at least 0; what the windows determine is unchanged."""
    from coordinator.pipeline.schedulers.instruction_profiler import MIN_POWER_FRACTION, _Window

    prof = InstructionProfiler(job_for(stages=1), infos_for(stages=1), {})
    state = prof._states[0]
    state.windows = [
        _Window({("forward", 0): 1.0, ("backward", 0): 2.0}, 0.1, 3.0 * 200 + 0.1 * 50),
        _Window({("forward", 0): 1.0, ("backward", 0): 2.0}, 0.2, 3.0 * 200 + 0.2 * 50),
        _Window({("forward", 0): 0.9, ("backward", 0): 2.1, ("forward", 1): 0.05}, 0.1,
                3.0 * 200 - 20),
    ]
    prof._fit(state)
    mean = sum(w.energy_j for w in state.windows) / sum(
        sum(w.busy_s.values()) + w.idle_s for w in state.windows)
    assert min(state.powers.values()) >= MIN_POWER_FRACTION * mean * (1 - 1e-9)
    assert state.p_block_w is not None and state.p_block_w >= 0
    # Consistent windows are fitted as before (the bounds are not active).
    state.windows = state.windows[:2] + [
        _Window({("forward", 0): 0.9, ("backward", 0): 2.1, ("forward", 1): 0.5}, 0.1,
                3.0 * 200 + 0.5 * 150 + 0.1 * 50)]
    prof._fit(state)
    assert state.powers[("forward", 1)] == pytest.approx(150, rel=0.05)


def test_forward_power_ratio_prior() -> None:
    def p_fwd(f: int) -> float:
        return 0.8 * p_bwd_lin(f)

    def worst(ratio: float = 1.0) -> float:
        prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=4, prior_weight=1e-4,
                                   stop_after_rising=10, forward_power_ratio=ratio)
        drive(prof, Synthetic(p_fwd, p_bwd_lin))
        return max(abs(p / (p_fwd(f) if k == "forward" else p_bwd_lin(f)) - 1)
                   for (k, f), p in prof.estimates(1)["power"].items())

    assert worst(0.8) < 1e-4
    assert worst() > 0.05  # the split the windows cannot see follows the (wrong) prior


def test_warmup_iterations_are_discarded() -> None:
    grid = coarse_grid(CLOCKS, 4, 0.5)
    p_fwd = _p_fwd_orthogonal(grid)
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=4, warmup_iterations=0,
                               prior_weight=1e-4, stop_after_rising=10)
    drive(prof, Synthetic(p_fwd, p_bwd_lin, corrupt_first=True))
    worst = max(abs(p / (p_fwd(f) if k == "forward" else p_bwd_lin(f)) - 1)
                for (k, f), p in prof.estimates(0)["power"].items())
    assert worst > 0.05  # the corrupted first iterations are in the fit without warm-up


def test_known_p_block_is_not_fitted() -> None:
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=3, p_block_w=40.0,
                               prior_weight=1e-4, stop_after_rising=10)
    assert prof.progress() == (0, 5)  # no blocking rounds
    drive(prof, Synthetic(p_bwd_lin, p_bwd_lin, p_block=40.0))
    est = prof.estimates(2)
    assert est["p_block_w"] == 40.0
    for (_, f), power in est["power"].items():
        assert power == pytest.approx(p_bwd_lin(f), rel=1e-4)


def test_early_stop_when_energy_rises() -> None:
    grid = coarse_grid(CLOCKS, 8, 0.5)

    # Per-instruction energy falls to grid level 2 and rises below it, for both kinds.
    def power(t: Callable[[int], float]) -> Callable[[int], float]:
        def p(f: int) -> float:
            level = min(range(len(grid)), key=lambda i: abs(grid[i] - f))
            return (10.0 + abs(level - 2)) / t(f) * t_fwd(1500)
        return p

    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=8, stop_after_rising=2)
    rounds = drive(prof, Synthetic(power(t_fwd), power(t_bwd)))
    assert prof.result is not None
    for entry in prof.result.root:
        assert min(entry.forward_time) == grid[4]  # levels 3 and 4 above the minimum
        assert max(entry.forward_time) == grid[0]
    assert rounds == 3 + 2 * 4  # blocking rounds, then (1,0) ... (4,4)


def test_setting_held_until_enough_iterations() -> None:
    prof = InstructionProfiler(job_for(), infos_for(), {"profiling_iterations": 2}, clocks=3,
                               p_block_w=40.0, warmup_iterations=1, min_profile_iterations=3)
    model = Synthetic(p_bwd_lin, p_bwd_lin)
    levels = []
    while not prof.finished:
        sched = prof.next_schedule()
        levels.append(min(f for _, f in sched[0].frequencies))
        prof.observe(model.results(sched, n=2))
    # 1 + 2 usable iterations: each of the 5 settings is held for 2 rounds.
    assert len(levels) == 10 and levels[0] == levels[1] and levels[2] == levels[3]


# ------------------------------------------------------------------ output


def test_csv_columns_and_rows(tmp_path: Path) -> None:
    path = tmp_path / "out" / "profile.csv"
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=4, result_path=str(path),
                               stop_after_rising=10)
    drive(prof, Synthetic(p_bwd_lin, p_bwd_lin))
    assert not path.exists()  # Handed over, not written: the coordinator writes it.
    write_files(prof.take_files())
    lines = path.read_text().splitlines()
    assert tuple(lines[0].split(",")) == CSV_COLUMNS
    back = InstructionProfilingResult.from_csv(str(path))
    grid = coarse_grid(CLOCKS, 4, 0.5)
    expected = [f for f in CLOCKS if grid[-1] <= f <= grid[0]]
    assert [e.rank for e in back.root] == [0, 1, 2, 3]
    for entry in back.root:
        assert list(entry.forward_time) == expected and list(entry.backward_energy) == expected
    assert len(lines) == 1 + 4 * 2 * len(expected)
    # Interpolated rows lie between their grid neighbours.
    entry = back.root[0]
    mid = expected[1]
    assert entry.forward_time[grid[0]] <= entry.forward_time[mid] <= entry.forward_time[grid[1]]


def test_unwritable_result_path_keeps_the_result(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=3,
                               result_path=str(blocker / "p.csv"))
    drive(prof, Synthetic(p_bwd_lin, p_bwd_lin))
    assert prof.result is not None and prof.finished
    (file,) = prof.take_files()
    assert file.path == str(blocker / "p.csv") and file.what == "the instruction profile"
    assert not write_file(file.path, file.content, file.what)  # Logged; nothing raised.
    assert prof.take_files() == []


def test_default_result_path_under_dump_dir(tmp_path: Path) -> None:
    job = job_for()
    job.set_job_id("InstructionProfiler")
    settings = SimpleNamespace(dump_dir=str(tmp_path), profiling_iterations=5)
    prof = InstructionProfiler(job, infos_for(), settings, clocks=3)
    assert prof.result_path == str(tmp_path / job.job_id / "instruction_profile.csv")
    drive(prof, Synthetic(p_bwd_lin, p_bwd_lin))
    write_files(prof.take_files())
    assert Path(prof.result_path).exists()
    assert InstructionProfiler(job_for(), infos_for(), {}).result_path is None


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clocks": 1}, "clocks must be an integer >= 2"),
        ({"clocks": True}, "clocks must be an integer"),
        ({"warmup_iterations": -1}, "warmup_iterations"),
        ({"min_profile_iterations": 0}, "min_profile_iterations"),
        ({"stop_after_rising": 0}, "stop_after_rising"),
        ({"min_clock_fraction": 0.0}, "min_clock_fraction"),
        ({"min_clock_fraction": 1.5}, "min_clock_fraction"),
        ({"p_block_w": -1.0}, "p_block_w"),
        ({"p_block_w": float("nan")}, "p_block_w"),
        ({"prior_weight": 0}, "prior_weight"),
        ({"forward_power_ratio": -1.0}, "forward_power_ratio"),
        ({"block_level": 0}, "block_level"),
        ({"result_path": "profile.txt"}, "ending with '.csv'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(SchedulerError, match=message):
        InstructionProfiler(job_for(), infos_for(), {}, **kwargs)


def test_missing_instructions_and_frequencies() -> None:
    infos = infos_for()
    infos[2] = infos[2].model_copy(update={"instructions": None})
    with pytest.raises(SchedulerError, match=r"rank 2 has no instructions.*RankInfo\.instructions"):
        InstructionProfiler(job_for(), infos, {})
    infos = infos_for()
    infos[1] = infos[1].model_copy(update={"instructions": ["forward", "forward"]})
    with pytest.raises(SchedulerError, match="rank 1: instructions have no backward"):
        InstructionProfiler(job_for(), infos, {})
    infos = infos_for()
    infos[0] = infos[0].model_copy(update={"available_frequencies": []})
    with pytest.raises(SchedulerError, match="available_frequencies"):
        InstructionProfiler(job_for(), infos, {})
    with pytest.raises(SchedulerError, match="at least one RankInfo"):
        InstructionProfiler(job_for(), [], {})


def test_wrong_results_are_refused_without_consuming() -> None:
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=3)
    model = Synthetic(p_bwd_lin, p_bwd_lin)
    results = model.results(prof.next_schedule())
    with pytest.raises(SchedulerError, match="one ProfilingResult per rank"):
        prof.observe(results[:3])
    assert prof.rounds_done == 0
    prof.observe(results)
    assert prof.rounds_done == 1


def test_mismatched_result_window_is_skipped_and_setting_held() -> None:
    prof = InstructionProfiler(job_for(), infos_for(), {}, clocks=3)
    model = Synthetic(p_bwd_lin, p_bwd_lin)
    first = prof.next_schedule()
    results = model.results(first)
    results[1] = results[1].model_copy(update={"iter_energy": results[1].iter_energy[:-1]})
    prof.observe(results)
    assert prof.next_schedule() == first  # held: rank 1 has no usable window yet


def test_registered_names() -> None:
    from coordinator.pipeline.schedulers.registry import resolve_scheduler

    assert resolve_scheduler("InstructionProfiler") is InstructionProfiler
    assert resolve_scheduler("InstructionProfiler3D") is InstructionProfiler3D


# ------------------------------------------------------------------ 3D and the simulation


def test_3d_wrapper_with_data_parallel(tmp_path: Path) -> None:
    sim, _ = bench.build_sim("gpt3-175b+a100_sxm", num_stages=4, microbatches=8, seed=3)
    clocks = list(sim.hw.supported_sm_clocks_mhz)
    infos = [RankInfo(rank=d * 4 + s, dp_rank=d, pp_rank=s, tp_rank=0,
                      available_frequencies=clocks, instructions=sim.instructions(s))
             for d in range(2) for s in range(4)]
    path = tmp_path / "p.csv"
    prof = InstructionProfiler3D(job_for(4, dp=2), infos, {}, clocks=6, result_path=str(path))
    while not prof.finished:
        schedules = prof.next_schedule()
        assert [s.rank for s in schedules] == list(range(8))
        for s in schedules:
            assert s.frequencies == schedules[s.rank % 4].frequencies
        stage_results = sim.window(schedules[:4], 5)
        prof.observe([r.model_copy(update={"rank": r.rank + 4 * d})
                      for d in range(2) for r in stage_results])
    assert len(prof.next_schedule()) == 8
    assert all({f for _, f in s.frequencies} == {clocks[0]} for s in prof.next_schedule())
    write_files(prof.take_files())
    back = InstructionProfilingResult.from_csv(str(path))
    assert [e.rank for e in back.root] == [0, 1, 2, 3]
    # Two DP ranks' energies are summed per stage (they ran the same, so twice one GPU's).
    for entry in back.root:
        t, e = sim.cost(entry.pp_rank, "backward", clocks[0])
        assert entry.backward_energy[clocks[0]] == pytest.approx(2 * e, rel=0.1)
        assert entry.backward_time[clocks[0]] == pytest.approx(t, rel=0.02)


@pytest.mark.parametrize("profile", bench.PROFILES)
def test_simulated_pipeline_meets_the_accuracy_goal(profile: str) -> None:
    run = bench.run_profile(profile, seed=0)
    assert run["energy_median"] <= 0.05
    assert run["energy_p90"] <= 0.10
    assert run["time_median"] <= 0.02
    assert run["profile_s"] <= 120.0
    assert run["rows"] >= 4 * 2 * 10
