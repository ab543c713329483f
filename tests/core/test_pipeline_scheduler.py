"""FrequencyScheduler (Zeus 0.16 semantics) and make_3d_parallel (per-stage planning)."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.pipeline.schedulers import (
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
    make_3d_parallel,
)
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo


def job(pp: int = 1, dp: int = 1, tp: int = 1) -> JobInfo:
    return JobInfo(pp_degree=pp, dp_degree=dp, tp_degree=tp, world_size=pp * dp * tp)


def rank_info(rank: int, pp: int = 0, dp: int = 0, tp: int = 0, **kw: Any) -> RankInfo:
    return RankInfo(
        rank=rank,
        dp_rank=dp,
        pp_rank=pp,
        tp_rank=tp,
        available_frequencies=kw.pop("freqs", [1410, 1200]),
        **kw,
    )


def result(rank: int, value: float = 1.0) -> ProfilingResult:
    return ProfilingResult(rank=rank, iter_time=[value], iter_energy=[value * 100])


class Scripted(FrequencyScheduler):
    """Yields `rounds` rounds of schedules (frequency = 1000 + round), records what it is sent."""

    def __init__(
        self, job_info: JobInfo, rank_infos: Sequence[RankInfo], pfo_settings: Any, rounds: int = 2
    ) -> None:
        self.rounds = rounds
        self.received: list[list[ProfilingResult]] = []
        self.seen_job = job_info
        super().__init__(job_info, rank_infos, pfo_settings)

    def _run(self) -> ScheduleGenerator:
        for r in range(self.rounds):
            results = yield [
                FrequencySchedule(rank=info.rank, frequencies=[("forward", 1000 + r)])
                for info in self.rank_infos
            ]
            self.received.append(results)


def freqs(schedules: list[FrequencySchedule]) -> list[tuple[int, int]]:
    return [(s.rank, s.frequencies[0][1]) for s in schedules]


# --- FrequencyScheduler ---------------------------------------------------------------------


def test_next_schedule_starts_once_and_observe_advances() -> None:
    sched = Scripted(job(pp=2), [rank_info(0, pp=0), rank_info(1, pp=1)], None, rounds=3)
    first = sched.next_schedule()
    assert freqs(first) == [(0, 1000), (1, 1000)]
    assert sched.next_schedule() is first  # Asking again does not advance the generator.
    assert sched.received == []
    results = [result(0), result(1)]
    sched.observe(results)
    assert sched.received == [results]
    assert freqs(sched.next_schedule()) == [(0, 1001), (1, 1001)]
    assert not sched.finished


def test_finished_scheduler_keeps_serving_its_last_schedules() -> None:
    sched = Scripted(job(), [rank_info(0)], None, rounds=2)
    sched.next_schedule()
    sched.observe([result(0, 1.0)])
    last = sched.next_schedule()
    assert freqs(last) == [(0, 1001)]
    sched.observe([result(0, 2.0)])  # The generator returns here.
    assert sched.finished
    assert sched.next_schedule() is last
    sched.observe([result(0, 3.0)])  # Ignored: nothing left to learn.
    assert sched.next_schedule() is last
    assert [r[0].iter_time for r in sched.received] == [[1.0], [2.0]]


def test_observe_before_next_schedule_starts_the_generator() -> None:
    sched = Scripted(job(), [rank_info(0)], None, rounds=2)
    sched.observe([result(0)])  # Zeus would send into an unstarted generator (TypeError).
    assert len(sched.received) == 1
    assert freqs(sched.next_schedule()) == [(0, 1001)]


def test_generator_stopping_at_once_is_a_scheduler_error() -> None:
    sched = Scripted(job(), [rank_info(0)], None, rounds=0)
    with pytest.raises(SchedulerError, match="Scripted stopped before producing any schedule"):
        sched.next_schedule()


def test_rank_infos_are_sorted_by_rank() -> None:
    infos = [rank_info(2, pp=2), rank_info(0, pp=0), rank_info(1, pp=1)]
    sched = Scripted(job(pp=3), infos, None)
    assert [i.rank for i in sched.rank_infos] == [0, 1, 2]
    assert sched.world_size == 3
    assert [s.rank for s in sched.next_schedule()] == [0, 1, 2]


def test_progress_defaults_to_none() -> None:
    assert Scripted(job(), [rank_info(0)], None).progress() is None


# --- make_3d_parallel -----------------------------------------------------------------------


Scripted3D = make_3d_parallel(Scripted, "Scripted3D")


def grid(pp: int, dp: int, tp: int) -> list[RankInfo]:
    """All ranks of a DP x PP x TP job (TP fastest, then PP, then DP), shuffled a little."""
    infos = []
    for rank, (d, p, t) in enumerate(itertools.product(range(dp), range(pp), range(tp))):
        # Each rank's GPU reports its own frequencies, to see whose the wrapped scheduler gets.
        infos.append(rank_info(rank, pp=p, dp=d, tp=t, freqs=[2000 + rank, 1000]))
    return infos[::-1]


def test_3d_wrapped_scheduler_sees_one_rank_info_per_stage() -> None:
    infos = grid(pp=3, dp=2, tp=2)
    sched = Scripted3D(job(pp=3, dp=2, tp=2), infos, None, rounds=1)
    assert type(sched).__name__ == "Scripted3D"
    # A pipeline-only job: dp = tp = 1, world size = pp.
    assert (
        sched.seen_job.pp_degree,
        sched.seen_job.dp_degree,
        sched.seen_job.tp_degree,
        sched.seen_job.world_size,
    ) == (3, 1, 1, 3)
    assert sched.world_size == 3
    # One RankInfo per stage, rank = pp_rank (Zeus 0.16 passes the full list: fixed here),
    # taken from the stage's dp_rank = tp_rank = 0 rank.
    assert [i.rank for i in sched.rank_infos] == [0, 1, 2]
    assert [i.pp_rank for i in sched.rank_infos] == [0, 1, 2]
    by_pos = {(i.pp_rank, i.dp_rank, i.tp_rank): i.rank for i in infos}
    assert [i.available_frequencies[0] - 2000 for i in sched.rank_infos] == [
        by_pos[(p, 0, 0)] for p in range(3)
    ]


def test_3d_stage_schedule_is_copied_to_every_dp_tp_rank() -> None:
    class StagePlan(Scripted):
        def _run(self) -> ScheduleGenerator:
            yield [
                FrequencySchedule(
                    rank=i.rank,
                    frequencies=[("forward", 1000 + i.rank), ("backward", 1100 + i.rank)],
                )
                for i in self.rank_infos
            ]

    infos = grid(pp=2, dp=2, tp=2)
    sched = make_3d_parallel(StagePlan)(job(pp=2, dp=2, tp=2), infos, None)
    schedules = sched.next_schedule()
    assert [s.rank for s in schedules] == list(range(8))  # Every rank, sorted by rank.
    pp_of = {i.rank: i.pp_rank for i in infos}
    for s in schedules:
        p = pp_of[s.rank]
        assert s.frequencies == [("forward", 1000 + p), ("backward", 1100 + p)]
    # Copies: editing one rank's schedule does not change another's.
    schedules[0].frequencies.append(("forward", 1))
    assert len(schedules[1].frequencies) == 2


def test_3d_aggregates_max_times_and_summed_energies_per_stage() -> None:
    infos = grid(pp=2, dp=2, tp=2)
    sched = Scripted3D(job(pp=2, dp=2, tp=2), infos, None, rounds=2)
    sched.next_schedule()
    results = []
    for i in infos:
        k = i.rank + 1  # Distinct per rank; two iterations, two forwards and one backward each.
        results.append(
            ProfilingResult(
                rank=i.rank,
                iter_time=[k, 10 * k],
                iter_energy=[100 * k, 1000 * k],
                time_breakdown={
                    "forward": [[k, 2 * k], [3 * k, 4 * k]],
                    "backward": [[5 * k], [6 * k]],
                },
                energy_breakdown={
                    "forward": [[7 * k, 8 * k], [9 * k, 10 * k]],
                    "backward": [[11 * k], [12 * k]],
                },
            )
        )
    sched.observe(results[::-1])  # Order of the results does not matter.
    (stage_results,) = sched.received
    assert [r.rank for r in stage_results] == [0, 1]
    for stage, got in enumerate(stage_results):
        ks = [i.rank + 1 for i in infos if i.pp_rank == stage]
        assert len(ks) == 4  # DP=2 x TP=2 ranks per stage.
        hi, total = max(ks), sum(ks)
        assert got.iter_time == [hi, 10 * hi]
        assert got.iter_energy == [100 * total, 1000 * total]
        assert got.time_breakdown == {
            "forward": [[hi, 2 * hi], [3 * hi, 4 * hi]],
            "backward": [[5 * hi], [6 * hi]],
        }
        assert got.energy_breakdown == {
            "forward": [[7 * total, 8 * total], [9 * total, 10 * total]],
            "backward": [[11 * total], [12 * total]],
        }


@settings(max_examples=50, deadline=None)
@given(
    pp=st.integers(1, 3),
    dp=st.integers(1, 3),
    tp=st.integers(1, 2),
    values=st.lists(st.floats(0.001, 1e6), min_size=18, max_size=18),
)
def test_3d_aggregation_property(pp: int, dp: int, tp: int, values: list[float]) -> None:
    infos = grid(pp=pp, dp=dp, tp=tp)
    sched = Scripted3D(job(pp=pp, dp=dp, tp=tp), infos, None, rounds=1)
    sched.next_schedule()
    value = {i.rank: values[i.rank] for i in infos}
    sched.observe(
        [
            ProfilingResult(rank=i.rank, iter_time=[value[i.rank]], iter_energy=[value[i.rank]])
            for i in infos
        ]
    )
    for stage, got in enumerate(sched.received[0]):
        stage_values = [value[i.rank] for i in infos if i.pp_rank == stage]
        assert got.iter_time == [max(stage_values)]
        assert got.iter_energy == [pytest.approx(sum(stage_values))]


def test_3d_missing_dp0_tp0_rank_is_an_error() -> None:
    infos = [i for i in grid(pp=2, dp=2, tp=1) if not (i.pp_rank == 1 and i.dp_rank == 0)]
    with pytest.raises(SchedulerError, match="pp_rank=1, dp_rank=0, tp_rank=0"):
        Scripted3D(job(pp=2, dp=2, tp=1), infos, None)


def test_3d_wrapper_keeps_the_wrapped_constructor_signature() -> None:
    # So that Zeus's scheduler_args check (inspect.signature(cls).bind(...)) sees `rounds`.
    assert list(inspect.signature(Scripted3D).parameters) == [
        "job_info",
        "rank_infos",
        "pfo_settings",
        "rounds",
    ]
    with pytest.raises(TypeError):
        inspect.signature(Scripted3D).bind(
            job_info=None, rank_infos=None, pfo_settings=None, bogus=1
        )
    # Extra arguments are forwarded, positionally too.
    sched = Scripted3D(job(pp=2), grid(pp=2, dp=1, tp=1), None, 5)
    assert sched.rounds == 5


# --- make_3d_parallel: broken rank lists and results are clear errors (Zeus raises or serves) --


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # Rank 2 left out: Zeus serves 3 schedules to a 4-rank job.
        (lambda infos: [i for i in infos if i.rank != 2],
         r"Scripted3D: rank\(s\) 2 missing \(the job has 4 ranks, 0 to 3\): no rank at "
         r"pp_rank=0, dp_rank=1, tp_rank=0"),
        # Rank 3 given twice (a re-registration, or a copy-paste): one of them replaces rank 2.
        (lambda infos: [i for i in infos if i.rank != 2]
         + [rank_info(3, pp=1, dp=1)],
         "Scripted3D: rank 3 is registered twice"),
        # Rank 2 numbered as if it were rank 3's position (misnumbered).
        (lambda infos: [i if i.rank != 2 else rank_info(2, pp=1, dp=1) for i in infos],
         "Scripted3D: ranks 2 and 3 are both at pp_rank=1, dp_rank=1, tp_rank=0 "
         r"\(misnumbered\)"),
        # Rank 4 in a 4-rank world.
        (lambda infos: [i if i.rank != 3 else rank_info(4, pp=1, dp=1) for i in infos],
         r"Scripted3D: rank 4 is beyond the world size 4 \(ranks are 0 to 3\)"),
        # A stage, DP or TP rank beyond its degree.
        (lambda infos: [i if i.rank != 3 else rank_info(3, pp=2, dp=1) for i in infos],
         r"Scripted3D: rank 3 has pp_rank=2, beyond the job's pp_degree 2 \(0 to 1\)"),
        (lambda infos: [i if i.rank != 3 else rank_info(3, pp=1, dp=2) for i in infos],
         "Scripted3D: rank 3 has dp_rank=2, beyond the job's dp_degree 2"),
        (lambda infos: [i if i.rank != 3 else rank_info(3, pp=1, dp=1, tp=1) for i in infos],
         "Scripted3D: rank 3 has tp_rank=1, beyond the job's tp_degree 1"),
    ],
)
def test_3d_broken_rank_lists_name_the_rank(change: Any, message: str) -> None:
    infos = sorted(grid(pp=2, dp=2, tp=1), key=lambda i: i.rank)  # rank = 2 * dp + pp
    with pytest.raises(SchedulerError, match=message):
        Scripted3D(job(pp=2, dp=2, tp=1), change(infos), None)


def breakdown_result(rank: int, time_keys: Sequence[str] = ("forward", "backward"),
                     energy_keys: Sequence[str] = ("forward", "backward")) -> ProfilingResult:
    return ProfilingResult(
        rank=rank, iter_time=[1.0], iter_energy=[10.0],
        time_breakdown={k: [[0.1]] for k in time_keys},
        energy_breakdown={k: [[1.0]] for k in energy_keys},
    )


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([], r"Scripted3D: no profiling results \(one per rank is needed, 4 ranks\)"),
        ([breakdown_result(r) for r in (0, 1, 2, 3, 7)],
         r"Scripted3D: a result from rank 7, which is not a rank of the job \(ranks 0 to 3\)"),
        # Ranks 1 and 3 are stage 1 (grid: TP fastest, then PP, then DP).
        ([breakdown_result(r) for r in (0, 2)],
         r"Scripted3D: no result for stage 1 \(ranks 1, 3\)"),
        ([breakdown_result(r) for r in (0, 1, 2)],
         r"Scripted3D: no result from rank\(s\) 3 of stage 1"),
        ([breakdown_result(r) for r in (0, 1, 2, 3, 1)],
         r"Scripted3D: two results from rank 1 \(stage 1\)"),
        ([*(breakdown_result(r) for r in (0, 1, 2)), breakdown_result(3, time_keys=["forward"])],
         r"Scripted3D: the result of rank 3 \(stage 1\) has no time_breakdown for 'backward', "
         r"which rank 1's has"),
        ([breakdown_result(0, energy_keys=["forward"]), *(breakdown_result(r) for r in (1, 2, 3))],
         r"Scripted3D: the result of rank 0 \(stage 0\) has no energy_breakdown for 'backward', "
         r"which rank 2's has"),
    ],
)
def test_3d_observe_refuses_bad_results_naming_the_rank_or_stage(
    results: list[ProfilingResult], message: str
) -> None:
    sched = Scripted3D(job(pp=2, dp=2, tp=1), grid(pp=2, dp=2, tp=1), None, rounds=2)
    first = sched.next_schedule()
    with pytest.raises(SchedulerError, match=message):
        sched.observe(results)
    assert sched.received == []  # Nothing reached the wrapped scheduler ...
    assert sched.next_schedule() == first  # ... which still serves the same schedules.


def test_3d_results_without_breakdowns_are_aggregated() -> None:
    # Zeus's ProfilingResult defaults the breakdowns to {}: a stage where all are empty is fine.
    sched = Scripted3D(job(pp=2, dp=2, tp=1), grid(pp=2, dp=2, tp=1), None, rounds=2)
    sched.next_schedule()
    sched.observe([result(r, value=r + 1) for r in range(4)])
    (stage_results,) = sched.received
    assert [(r.rank, r.iter_time, r.time_breakdown) for r in stage_results] == [
        (0, [3], {}), (1, [4], {})]
