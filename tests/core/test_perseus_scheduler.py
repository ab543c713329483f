"""`Perseus`: profile (a composed InstructionProfiler), plan, choose, serve, re-profile on drift.

Pure and deterministic: exact synthetic results (no counter noise), and a stub planner whose
frontier is written by hand (so the plan -> schedules mapping, the choice arguments and the drift
rule are checked on their own); one test runs the real planner when it is there.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import Any

import pytest

from coordinator.pipeline.dumps import write_files
from coordinator.pipeline.schedulers import SchedulerError, perseus
from coordinator.pipeline.schedulers.instruction_profiler import coarse_grid
from coordinator.pipeline.schedulers.perseus import Perseus, Perseus3D, one_f_one_b, plan_schedule
from coordinator.pipeline.schedulers.registry import resolve_scheduler
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

CLOCKS = [1500, 1350, 1200, 1050, 900, 750]
FAST = {"clocks": 3, "warmup_iterations": 0, "min_profile_iterations": 2}
"""Profiler knobs for a short profile (3 grid clocks, no warm-up)."""


def t(kind: str, f: int, stage: int) -> float:
    return (0.02 if kind == "forward" else 0.04) * (1 + 0.1 * stage) * (0.4 + 0.6 * 1500 / f)


def p(kind: str, f: int) -> float:
    return 100 + 200 * (f / 1500) ** 2


def results(schedules: list[FrequencySchedule], n: int = 2, scale: float = 1.0,
            p_block: float = 40.0) -> list[ProfilingResult]:
    """Exact results of one round: every rank waits for the slowest, at `p_block`."""
    stage = {s.rank: s.rank % 10 for s in schedules}
    busy = {s.rank: sum(t(k, f, stage[s.rank]) for k, f in s.frequencies if k != "optimizer")
            for s in schedules}
    length = max(busy.values()) * 1.1 * scale
    out = []
    for s in schedules:
        tb: dict[str, list[list[float]]] = {}
        eb: dict[str, list[list[float]]] = {}
        for i in range(n):
            for name, _ in s.frequencies:
                tb.setdefault(name, [[] for _ in range(n)])
                eb.setdefault(name, [[] for _ in range(n)])
            for name, f in s.frequencies:
                kind = "backward" if name == "optimizer" else name
                dt = 0.0 if name == "optimizer" else t(kind, f, stage[s.rank])
                tb[name][i].append(dt)
                eb[name][i].append(p(kind, f) * dt)
        energy = sum(p(k, f) * t(k, f, stage[s.rank]) for k, f in s.frequencies
                     if k != "optimizer") + p_block * (length - busy[s.rank])
        out.append(ProfilingResult(rank=s.rank, iter_time=[length] * n,
                                   iter_energy=[energy] * n, time_breakdown=tb,
                                   energy_breakdown=eb))
    return out


def job(stages: int = 4, dp: int = 1) -> JobInfo:
    info = JobInfo(pp_degree=stages, dp_degree=dp, tp_degree=1, world_size=stages * dp)
    info.job_id = "job+perseus"  # As the coordinator sets it (`set_job_id`).
    return info


def ranks(stages: int = 4, microbatches: int = 4, dp: int = 1,
          extra: dict[int, list[str]] | None = None) -> list[RankInfo]:
    extra = extra or {}
    return [RankInfo(rank=d * stages + s, dp_rank=d, pp_rank=s, tp_rank=0,
                     available_frequencies=CLOCKS,
                     instructions=one_f_one_b(s, stages, microbatches) + extra.get(s, []))
            for d in range(dp) for s in range(stages)]


def profile_to_end(sched: Perseus, scale: float = 1.0) -> int:
    rounds = 0
    while not sched.serving:
        sched.observe(results(sched.next_schedule(), scale=scale))
        rounds += 1
        assert rounds < 100
    return rounds


# ------------------------------------------------------------------ a stub planner


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[tuple[tuple[str, int], ...], ...]


def uniform_plan(clock: int, stages: int = 4, microbatches: int = 4) -> tuple:
    return tuple(tuple((name, clock) for name in one_f_one_b(s, stages, microbatches))
                 for s in range(stages))


class StubPlanner:
    """`planner`'s functions over a frontier written by hand; records how it was called."""

    def __init__(self, frontier: list[Point], all_max_time: float = 1.0) -> None:
        self.frontier = frontier
        self.all_max_time = all_max_time
        self.calls: list[tuple[str, Any]] = []
        stub = self

        class InstructionProfile:
            @staticmethod
            def from_rows(rows: list[tuple]) -> tuple:
                stub.calls.append(("rows", list(rows)))
                return ("profile",)

        self.InstructionProfile = InstructionProfile

    def plan_frontier(self, profile: Any, num_microbatches: int, num_stages: int | None = None,
                      p_block_w: float = 0.0, **kw: Any) -> list[Point]:
        self.calls.append(("plan", (num_microbatches, num_stages, p_block_w)))
        return list(self.frontier)

    def max_frequency_plan(self, profile: Any, num_microbatches: int,
                           schedule: Any = None) -> tuple:
        return uniform_plan(CLOCKS[0])

    def evaluate(self, profile: Any, plan: Any, num_microbatches: int,
                 p_block_w: float, schedule: Any = None) -> tuple[float, float]:
        return self.all_max_time, 0.0

    def choose(self, frontier: list[Point], **kw: Any) -> Point:
        self.calls.append(("choose", kw))
        limit = kw["target_time"] or kw["all_max_time"]
        return min((q for q in frontier if q.time <= limit), key=lambda q: q.energy)


FRONTIER = [Point(0.9, 120.0, uniform_plan(1500)), Point(1.0, 100.0, uniform_plan(1200)),
            Point(1.2, 90.0, uniform_plan(900))]


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> StubPlanner:
    planner = StubPlanner(FRONTIER)
    monkeypatch.setattr(perseus, "planner", planner)
    return planner


# ------------------------------------------------------------------ profile, plan, serve


def test_profiles_then_plans_with_m_s_and_the_fitted_p_block(stub: StubPlanner) -> None:
    sched = Perseus(job(), ranks(), {"profiling_iterations": 2}, profiler_args=FAST,
                    time_margin=0.0)
    assert sched.progress() is not None and sched.frontier is None and not sched.serving
    first = sched.next_schedule()
    assert all({f for _, f in s.frequencies} == {1500} for s in first)  # The profiler's.
    profile_to_end(sched)
    assert sched.progress() is None and not sched.finished
    (m, s, p_block), = [args for name, args in stub.calls if name == "plan"]
    assert (m, s) == (4, 4)
    assert p_block == pytest.approx(40.0, rel=1e-3)  # The profiler's fit, mean over ranks.
    rows = next(args for name, args in stub.calls if name == "rows")
    assert {(r[0], r[1]) for r in rows} == {(st, k) for st in range(4)
                                            for k in ("forward", "backward")}
    assert all(f in CLOCKS and tt > 0 and e > 0 for _, _, f, tt, e in rows)
    assert sched.frontier == FRONTIER and sched.chosen == FRONTIER[1]
    served = sched.next_schedule()
    assert [sch.rank for sch in served] == [0, 1, 2, 3]
    for sch, info in zip(served, sched.rank_infos, strict=True):
        assert [n for n, _ in sch.frequencies] == info.instructions
        assert {f for _, f in sch.frequencies} == {1200}


@pytest.mark.parametrize("plan_clocks", ["grid", "all"])
def test_plans_on_the_measured_grid_or_every_profiled_clock(stub: StubPlanner,
                                                            plan_clocks: str) -> None:
    sched = Perseus(job(), ranks(), {}, profiler_args={**FAST, "clocks": 4}, time_margin=0.0,
                    plan_clocks=plan_clocks)
    profile_to_end(sched)
    clocks = {r[2] for r in next(args for name, args in stub.calls if name == "rows")}
    grid = set(coarse_grid(CLOCKS, 4, 0.5))
    assert clocks == (grid if plan_clocks == "grid" else set(CLOCKS))
    assert len(grid) < len(CLOCKS)


def test_given_p_block_skips_the_fit_and_reaches_the_profiler(stub: StubPlanner) -> None:
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0, p_block_w=55.0)
    assert sched._profiler.p_block_w == 55.0
    profile_to_end(sched)
    assert [args[2] for name, args in stub.calls if name == "plan"] == [55.0]


def test_schedules_follow_the_ranks_order_with_other_instructions_at_the_top_clock(
        stub: StubPlanner) -> None:
    extra = {0: ["optimizer"], 3: ["optimizer"]}
    sched = Perseus(job(), ranks(extra=extra), {}, profiler_args=FAST, time_margin=0.0)
    profile_to_end(sched)
    served = sched.next_schedule()
    assert served[0].frequencies[-1] == ("optimizer", 1500)
    assert [n for n, _ in served[3].frequencies] == one_f_one_b(3, 4, 4) + ["optimizer"]
    assert {f for n, f in served[3].frequencies if n != "optimizer"} == {1200}


def test_plan_schedule_refuses_another_order() -> None:
    with pytest.raises(SchedulerError, match="not the pipeline's schedule"):
        plan_schedule(0, ["forward", "backward"], [("backward", 1), ("forward", 1)], 2)


def test_a_plan_in_another_order_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    gpipe = tuple(tuple([("forward", 1200)] * 4 + [("backward", 1200)] * 4) for _ in range(4))
    monkeypatch.setattr(perseus, "planner", StubPlanner([Point(1.0, 1.0, gpipe)]))
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0)
    with pytest.raises(SchedulerError, match="the plan is not the pipeline's schedule"):
        profile_to_end(sched)


@pytest.mark.parametrize("case", ["cycle", "shared_stage", "unequal", "no_instructions",
                                  "unknown_kind", "missing_backward"])
def test_jobs_perseus_cannot_plan_are_refused_when_built(case: str) -> None:
    infos = ranks()
    if case == "cycle":  # The last stage turns a microbatch around before its forward.
        infos[3] = infos[3].model_copy(update={"instructions": ["backward", "forward"] * 4})
        words = "cycle .*rank 3's forward \\(microbatch 0\\) -> rank 3's backward"
    elif case == "unknown_kind":
        infos[1] = infos[1].model_copy(update={"instructions": ["recompute:1:0"]})
        words = "rank 1: .*unknown kind 'recompute'"
    elif case == "missing_backward":
        infos[2] = infos[2].model_copy(update={"instructions": ["forward"] * 4
                                               + ["backward"] * 3})
        words = "stage 2 runs no backward of microbatch 3"
    elif case == "shared_stage":
        infos = ranks(dp=2)
        words = "use Perseus3D"
    elif case == "unequal":
        infos[1] = infos[1].model_copy(update={"instructions": ["forward", "backward"]})
        words = "microbatch count must be the same everywhere"
    else:
        infos[2] = infos[2].model_copy(update={"instructions": None})
        words = "has no instructions"
    with pytest.raises(SchedulerError, match=words):
        Perseus(job(dp=2 if case == "shared_stage" else 1), infos, {}, profiler_args=FAST,
                time_margin=0.0)


def test_3d_plans_per_stage_and_serves_every_replica(stub: StubPlanner) -> None:
    sched = Perseus3D(job(dp=2), ranks(dp=2), {}, profiler_args=FAST, time_margin=0.0)
    rounds = 0
    while not sched.serving:
        sched.observe(results(sched.next_schedule()))
        rounds += 1
    served = sched.next_schedule()
    assert [s.rank for s in served] == list(range(8))
    assert all({f for _, f in s.frequencies} == {1200} for s in served)
    assert sched.frontier == FRONTIER


# ------------------------------------------------------------------ the choice


@pytest.mark.parametrize(("knobs", "expected"), [
    ({}, {"target_time": None, "max_slowdown": None, "eta_knob": None, "all_max_time": 1.0}),
    ({"target_time": 1.3}, {"target_time": 1.3, "max_slowdown": None, "eta_knob": None,
                            "all_max_time": 1.0}),
])
def test_the_choice_gets_the_knobs_and_the_all_max_time(stub: StubPlanner, knobs: dict,
                                                        expected: dict) -> None:
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0, **knobs)
    profile_to_end(sched)
    assert [kw for name, kw in stub.calls if name == "choose"] == [expected]
    assert sched.chosen == (FRONTIER[2] if knobs else FRONTIER[1])
    assert sched.all_max_time == 1.0


@pytest.mark.parametrize("knobs", [
    {"target_time": 1.0, "eta_knob": 0.5}, {"max_slowdown": -0.1}, {"eta_knob": 1.5},
    {"target_time": 0}, {"replan_window": 0}, {"replan_threshold": 0.0},
    {"max_reprofiles": -1}, {"profiler_args": {"clocks": 1}}, {"profiler_args": {"nope": 1}},
    {"frontier_path": "f.txt"}, {"profiler_args": "clocks=3"}, {"plan_clocks": "some"},
])
def test_bad_knobs_are_refused(knobs: dict) -> None:
    with pytest.raises(SchedulerError):
        Perseus(job(), ranks(), {}, **knobs)


def test_real_planner_choice_rules() -> None:
    """The real `choose` on a hand-made frontier: default, target, slowdown, eta."""
    planner = pytest.importorskip("coordinator.pipeline.planner")
    frontier = [planner.FrontierPoint(t_, e, uniform_plan(c)) for t_, e, c in
                ((0.9, 120.0, 1500), (1.0, 100.0, 1200), (1.2, 90.0, 900))]
    assert planner.choose(frontier, all_max_time=1.0) == frontier[1]
    assert planner.choose(frontier, target_time=1.25, all_max_time=1.0) == frontier[2]
    assert planner.choose(frontier, max_slowdown=0.1, all_max_time=1.0) == frontier[1]


# ------------------------------------------------------------------ drift


def serve(sched: Perseus, scale: float) -> None:
    sched.observe(results(sched.next_schedule(), scale=scale))


def test_re_profiles_after_replan_window_drifting_windows(stub: StubPlanner) -> None:
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0, replan_window=2)
    profile_to_end(sched)
    plan = sched.next_schedule()
    serve(sched, 1.0)  # The first served window calibrates (its overheads are not planned).
    serve(sched, 1.04)  # Within 5%.
    serve(sched, 1.08)
    assert sched.serving and sched.next_schedule() == plan and sched.drift == pytest.approx(0.08)
    serve(sched, 0.98)  # Back within: the count starts again.
    serve(sched, 1.08)
    assert sched.serving
    serve(sched, 1.08)
    assert not sched.serving and sched.reprofiles == 1
    assert sched.progress() is not None
    assert all({f for _, f in s.frequencies} == {1500} for s in sched.next_schedule())
    profile_to_end(sched)  # A new plan from the new profile.
    assert sched.serving and len([c for c in stub.calls if c[0] == "plan"]) == 2


def test_re_profiles_at_most_max_reprofiles_times(stub: StubPlanner) -> None:
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0, replan_window=1,
                    max_reprofiles=0)
    profile_to_end(sched)
    for scale in (1.0, 1.5, 1.5, 1.5):
        serve(sched, scale)
    assert sched.serving and sched.reprofiles == 0 and sched.drift == pytest.approx(0.5)


# ------------------------------------------------------------------ files, names, real planner


def test_frontier_csv_in_the_job_dump_directory(stub: StubPlanner, tmp_path) -> None:
    sched = Perseus(job(), ranks(), {"dump_dir": str(tmp_path)}, profiler_args=FAST,
                    time_margin=0.0)
    profile_to_end(sched)
    files = sched.take_files()
    assert [f.what for f in files] == ["the instruction profile", "the frontier"]
    write_files(files)
    with (tmp_path / "job+perseus" / "frontier.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["index", "time", "energy"]
    assert [(int(i), float(a), float(b)) for i, a, b in rows[1:]] == [
        (i, q.time, q.energy) for i, q in enumerate(FRONTIER)]
    assert (tmp_path / "job+perseus" / "instruction_profile.csv").exists()
    off = Perseus(job(), ranks(), {"dump_dir": str(tmp_path / "x"), "dump_data": False})
    assert off.frontier_path is None


def test_registered_names() -> None:
    assert resolve_scheduler("Perseus") is Perseus
    assert resolve_scheduler("Perseus3D") is Perseus3D


def test_with_the_real_planner() -> None:
    pytest.importorskip("coordinator.pipeline.planner")
    Perseus.check_args(profiler_args=FAST, time_margin=0.0)
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0)
    profile_to_end(sched)
    assert sched.frontier and sched.chosen is not None and sched.all_max_time is not None
    assert sched.chosen.time <= sched.all_max_time * (1 + 1e-9)
    assert sched.chosen.energy <= min(q.energy for q in sched.frontier
                                      if q.time <= sched.all_max_time * (1 + 1e-9))
    served = sched.next_schedule()
    for sch, info in zip(served, sched.rank_infos, strict=True):
        assert [n for n, _ in sch.frequencies] == info.instructions
        assert all(f in CLOCKS for _, f in sch.frequencies)
    assert any(f < 1500 for s in served for _, f in s.frequencies)  # Some slack was used.


def test_the_default_choice_keeps_a_margin_for_clock_changes(stub: StubPlanner) -> None:
    """By default the plan leaves 1% of the all-max time as slack: locking a new clock as an
    instruction begins costs time the profile does not show."""
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST)
    profile_to_end(sched)
    (call,) = [kw for name, kw in stub.calls if name == "choose"]
    assert call["target_time"] == pytest.approx(0.99 * sched.all_max_time)
    assert sched.chosen is not None and sched.chosen.time <= 0.99 * sched.all_max_time


def test_a_re_profile_asked_from_outside_is_not_counted_in_max_reprofiles(
        stub: StubPlanner) -> None:
    """Its profile ran under a power budget's caps: once they are gone the coordinator asks
    it to profile again (`coordinator.budget.capped_profiles`), whatever `max_reprofiles`."""
    sched = Perseus(job(), ranks(), {}, profiler_args=FAST, time_margin=0.0, max_reprofiles=0)
    assert not sched.reprofile()  # Profiling: nothing to ask.
    profile_to_end(sched)
    plan = sched.next_schedule()
    serve(sched, 1.0)
    assert sched.reprofile() and sched.next_schedule() == plan  # At the next window.
    serve(sched, 1.0)
    assert not sched.serving and sched.reprofiles == 0 and sched.progress() is not None
    profile_to_end(sched)
    assert sched.serving and len([c for c in stub.calls if c[0] == "plan"]) == 2
