"""`PipelineJob`: discovery, versioned schedules switching together, results, serving, errors."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from coordinator.optimizer import ClearSchedules, InstallSchedules, KeepFile, StatusUpdate
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.messages import Measurement

CLOCKS = [1410, 1200, 1000]
ORDERS = {0: ["forward", "forward", "backward", "backward"],
          1: ["forward", "backward", "forward", "backward"]}


class TwoRounds(FrequencyScheduler):
    """Runs every instruction at CLOCKS[0], then at CLOCKS[1], then serves CLOCKS[2]."""

    seen: list[list[ProfilingResult]]

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        self.seen = []
        for clock in CLOCKS:
            results = yield [FrequencySchedule(rank=i.rank, frequencies=[
                (name, clock) for name in i.instructions or []]) for i in self.rank_infos]
            self.seen.append(results)


def make_job(scheduler: type[FrequencyScheduler] = TwoRounds, n: int = 2) -> PipelineJob:
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(2)]
    return PipelineJob("job", info, ranks, lambda ji, ri: scheduler(ji, ri, None),
                       scheduler_name=scheduler.__name__, profiling_iterations=n)


def iteration(job: PipelineJob, rank: int, step: int, version: int | None,
              scale: float = 1.0) -> list:
    actions = []
    for i, name in enumerate(ORDERS[rank]):
        m = Measurement(kind="instruction", name=name, epoch=0, step=step, index=step * 10 + i,
                        t0_ns=0, t1_ns=1, time_s=0.1 * scale * (i + 1), energy_j=10.0 * scale,
                        schedule=version)
        actions += job.on_measurement(rank, m, 0.0)
    m = Measurement(kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1,
                    time_s=1.0 * scale, energy_j=100.0 * scale, schedule=version)
    return actions + job.on_measurement(rank, m, 0.0)


def test_discovers_orders_then_installs_schedule_0_after_the_latest_step() -> None:
    job = make_job()
    assert isinstance(job.start()[0], StatusUpdate)
    assert iteration(job, 0, 0, None) == [] and iteration(job, 0, 1, None) == []
    actions = iteration(job, 1, 1, None)
    install = next(a for a in actions if isinstance(a, InstallSchedules))
    assert (install.version, install.from_step) == (0, 1 + 2)
    assert [s.rank for s in install.schedules] == [0, 1]
    assert [n for n, _ in install.schedules[1].frequencies] == ORDERS[1]
    assert {a.name for a in actions if isinstance(a, KeepFile)} == {"ranks.json", "0.sched.json"}
    assert job.rank_infos[0].instructions == ORDERS[0]
    assert job.phase == "profiling" and job.desired_schedule(1) == (install.schedules[1], 0)


def test_results_use_only_the_current_version_and_become_profiling_results() -> None:
    job = make_job()
    iteration(job, 0, 0, None)
    iteration(job, 1, 0, None)
    assert iteration(job, 0, 1, None) == []  # Still version None: not profiled.
    for step in (2, 3):
        assert not any(isinstance(a, InstallSchedules) for a in iteration(job, 0, step, 0))
    assert iteration(job, 1, 2, 0) == []
    actions = iteration(job, 1, 3, 0, scale=2.0)
    assert any(isinstance(a, KeepFile) and a.name == "0.prof.json" for a in actions)
    install = next(a for a in actions if isinstance(a, InstallSchedules))
    assert install.version == 1 and install.schedules[0].frequencies[0][1] == CLOCKS[1]
    scheduler = job.scheduler
    assert isinstance(scheduler, TwoRounds)
    r1 = scheduler.seen[0][1]
    assert r1.iter_time == [1.0, 2.0] and r1.iter_energy == [100.0, 200.0]
    assert r1.time_breakdown["forward"] == [[0.1, 0.30000000000000004], [0.2, 0.6000000000000001]]
    assert r1.time_breakdown["backward"][0] == pytest.approx([0.2, 0.4])
    assert r1.energy_breakdown["backward"] == [[10.0, 10.0], [20.0, 20.0]]


def test_a_finished_scheduler_is_served_and_collection_stops() -> None:
    job = make_job(n=1)
    for rank in (0, 1):
        iteration(job, rank, 0, None)
    for version in (0, 1, 2):
        for rank in (0, 1):
            actions = iteration(job, rank, 10 + version, version)
    assert job.phase == "serving" and job.done
    assert any(isinstance(a, StatusUpdate) and a.state == "serving" for a in actions)
    assert job.desired_schedule(0) is not None and job.desired_schedule(0)[1] == 2
    assert iteration(job, 0, 20, 2) == []


class WrongShape(FrequencyScheduler):
    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield [FrequencySchedule(rank=i.rank, frequencies=[("forward", 1410)])
               for i in self.rank_infos]


class Broken(FrequencyScheduler):
    def __init__(self, *args: object) -> None:
        raise SchedulerError("plan file has 3 rows for 2 ranks")

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield []


@pytest.mark.parametrize(("scheduler", "words"), [
    (WrongShape, "do not match"), (Broken, "3 rows for 2 ranks")])
def test_a_scheduler_that_cannot_run_is_an_error_status(scheduler, words) -> None:
    job = make_job(scheduler)
    iteration(job, 0, 0, None)
    actions = iteration(job, 1, 0, None)
    assert job.phase == "error" and job.done and words in (job.error or "")
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["error"]
    assert not any(isinstance(a, (InstallSchedules, ClearSchedules)) for a in actions)


def test_bad_knobs_are_refused() -> None:
    info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(ValueError, match="profiling_iterations"):
        PipelineJob("j", info, [], lambda ji, ri: TwoRounds(ji, ri, None), profiling_iterations=0)


def test_a_finished_3d_scheduler_is_served_though_it_copies_its_schedules() -> None:
    """The 3D wrapper builds new schedule objects on every call: serving is by `finished`."""
    from coordinator.pipeline.scheduler import make_3d_parallel

    info = JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4)
    ranks = [RankInfo(rank=r, dp_rank=r % 2, pp_rank=r // 2, tp_rank=0,
                      available_frequencies=CLOCKS) for r in range(4)]
    wrapped = make_3d_parallel(TwoRounds)
    job = PipelineJob("job", info, ranks, lambda ji, ri: wrapped(ji, ri, None),
                      profiling_iterations=1)
    order = {r: ORDERS[r // 2] for r in range(4)}

    def feed(rank: int, step: int, version: int | None) -> list:
        actions = []
        for i, name in enumerate(order[rank]):
            actions += job.on_measurement(rank, Measurement(
                kind="instruction", name=name, epoch=0, step=step, index=i, t0_ns=0, t1_ns=1,
                time_s=0.1, energy_j=1.0, schedule=version), 0.0)
        return actions + job.on_measurement(rank, Measurement(
            kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1, time_s=1.0,
            energy_j=10.0, schedule=version), 0.0)

    for rank in range(4):
        feed(rank, 0, None)
    for version in range(3):
        for rank in range(4):
            feed(rank, 10 + version, version)
    assert job.phase == "serving" and job.version == 2
