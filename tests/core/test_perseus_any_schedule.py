"""Perseus on schedules other than 1F1B: profiled per action kind, planned on the learned DAG."""

from __future__ import annotations

import pytest

from coordinator.pipeline.planner import InstructionProfile, evaluate
from coordinator.pipeline.planner.schedules import rank_orders
from coordinator.pipeline.schedulers.instruction_profiler import InstructionProfiler
from coordinator.pipeline.schedulers.perseus import Perseus
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.pipeline_order import action_kind

pytestmark = pytest.mark.core

CLOCKS = list(range(1500, 690, -30))
FAST = {"clocks": 3, "warmup_iterations": 0, "min_profile_iterations": 2}
BASE = {"forward": 0.02, "backward": 0.04, "backward_input": 0.025, "backward_weight": 0.015}


def t(kind: str, f: int, rank: int) -> float:
    return BASE[kind] * (1 + 0.1 * rank) * (0.4 + 0.6 * 1500 / f)


def p(f: int) -> float:
    return 100 + 200 * (f / 1500) ** 2


def results(schedules: list[FrequencySchedule], n: int = 2) -> list[ProfilingResult]:
    """Exact results: every rank waits for the slowest at 40 W; one power per clock."""
    def busy_of(s: FrequencySchedule) -> float:
        return sum(t(k, f, s.rank) for n, f in s.frequencies if (k := action_kind(n)))

    length = max(busy_of(s) for s in schedules) * 1.1
    out = []
    for s in schedules:
        tb: dict[str, list[list[float]]] = {}
        eb: dict[str, list[list[float]]] = {}
        energy = 40.0 * (length - busy_of(s))
        for name, f in s.frequencies:
            kind = action_kind(name)
            dt = t(kind, f, s.rank) if kind else 0.0
            energy += p(f) * dt
            tb.setdefault(name, [[] for _ in range(n)])
            eb.setdefault(name, [[] for _ in range(n)])
            for i in range(n):
                tb[name][i].append(dt)
                eb[name][i].append(p(f) * dt)
        out.append(ProfilingResult(rank=s.rank, iter_time=[length] * n,
                                   iter_energy=[energy] * n, time_breakdown=tb,
                                   energy_breakdown=eb))
    return out


def ranks(orders: list[list[str]]) -> list[RankInfo]:
    return [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS,
                     instructions=order + ["optimizer"]) for r, order in enumerate(orders)]


def job(stages: int) -> JobInfo:
    return JobInfo(pp_degree=stages, dp_degree=1, tp_degree=1, world_size=stages)


@pytest.mark.parametrize(("name", "chunks"), [("zero-bubble", 1), ("zero-bubble", 2),
                                              ("interleaved-1f1b", 2), ("gpipe", 1)])
def test_perseus_profiles_plans_and_serves_the_order_each_rank_runs(name: str,
                                                                    chunks: int) -> None:
    orders = rank_orders(name, 4, 8, chunks)
    sched = Perseus(job(4), ranks(orders), {}, profiler_args=FAST, p_block_w=40.0,
                    time_margin=0.0, max_slowdown=0.05)
    rounds = 0
    while not sched.serving:
        sched.observe(results(sched.next_schedule()))
        rounds += 1
        assert rounds < 100
    assert sched.schedule is not None and sched.schedule.num_microbatches == 8
    kinds = {k for _, k, *_ in sched.profile_rows}
    assert kinds == {action_kind(n) for row in orders for n in row}
    for stage, kind, f, time, energy in sched.profile_rows:  # Exact results: exact rows.
        assert time == pytest.approx(t(kind, f, stage), rel=1e-6)
        assert energy == pytest.approx(p(f) * t(kind, f, stage), rel=0.02)
    served = sched.next_schedule()
    for s, order in zip(served, orders, strict=True):
        assert [n for n, _ in s.frequencies] == order + ["optimizer"]
        assert s.frequencies[-1] == ("optimizer", 1500)
    assert sched.chosen is not None and sched.all_max_time is not None
    assert sched.chosen.time <= 1.05 * sched.all_max_time * (1 + 1e-9)
    assert sched.chosen.energy < sched.frontier[0].energy  # type: ignore[index]
    profile = InstructionProfile.from_rows(sched.profile_rows)
    assert evaluate(profile, sched.chosen.plan, 8, 40.0, schedule=sched.schedule) == (
        pytest.approx((sched.chosen.time, sched.chosen.energy)))


def test_the_profiler_writes_split_backward_rows_in_its_csv() -> None:
    orders = rank_orders("zero-bubble", 2, 4)
    prof = InstructionProfiler(job(2), ranks(orders), {}, p_block_w=40.0,
                               result_path="/x/profile.csv", **FAST)
    while not prof.finished:
        prof.observe(results(prof.next_schedule()))
    (out,) = prof.take_files()
    lines = out.content.splitlines()
    assert any(",backward_weight," in line for line in lines)
    assert not any(",backward," in line for line in lines)
    assert prof.result is not None and prof.result.root[0].backward_time == {}
