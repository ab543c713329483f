"""`PipelineJob`: discovery, versioned schedules switching together, results, serving, errors."""

from __future__ import annotations

import json
from collections.abc import Generator

import pytest

from coordinator.optimizer import (
    ClearSchedules,
    InstallSchedules,
    KeepFile,
    SaveProgress,
    StatusUpdate,
    WriteFile,
)
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler, SchedulerError
from coordinator.pipeline.takeover import MAX_VERSION_LEAD, resumed_version
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


def discover(job: PipelineJob, steps: tuple[int, ...] = (0, 1)) -> list:
    """Two alike iterations of every rank: the job learns their orders."""
    actions = []
    for step in steps:
        for rank in (0, 1):
            actions += iteration(job, rank, step, None)
    return actions


def test_discovers_orders_then_installs_schedule_0_after_the_latest_step() -> None:
    job = make_job()
    assert isinstance(job.start()[0], StatusUpdate)
    assert iteration(job, 0, 0, None) == [] and iteration(job, 0, 1, None) == []
    assert iteration(job, 1, 1, None) == []  # One iteration of rank 1 is not enough.
    actions = iteration(job, 1, 2, None)
    install = next(a for a in actions if isinstance(a, InstallSchedules))
    assert (install.version, install.from_step) == (0, 2 + 2)  # (Upper) median of latest steps
    assert [s.rank for s in install.schedules] == [0, 1]
    assert [n for n, _ in install.schedules[1].frequencies] == ORDERS[1]
    assert {a.name for a in actions if isinstance(a, KeepFile)} == {"ranks.json", "0.sched.json"}
    assert job.rank_infos[0].instructions == ORDERS[0]
    # The desired schedule carries the step it was sent to switch at: installed again (an
    # agent restarted, a lease lapsed), a rank waiting for that step must not switch early.
    assert job.phase == "profiling" and job.desired_schedule(1) == (install.schedules[1], 0, 4)
    # A schedule made is progress: recorded, so a replica taking over resumes from it.
    saved = [a for a in actions if isinstance(a, SaveProgress)]
    assert len(saved) == 1 and saved[0].kind == "pipeline" and saved[0].state == job.persisted()
    assert actions[-1] is saved[0]  # After the schedules and dumps it records.


def test_results_use_only_the_current_version_and_become_profiling_results() -> None:
    job = make_job()
    discover(job)
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
    discover(job)
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
    actions = discover(job)
    assert job.phase == "error" and job.done and words in (job.error or "")
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["discovering"][:0] + [
        "error"]
    assert not any(isinstance(a, InstallSchedules) for a in actions)
    assert any(isinstance(a, ClearSchedules) for a in actions)  # A predecessor's, if any.


def test_bad_knobs_are_refused() -> None:
    info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(ValueError, match="profiling_iterations"):
        PipelineJob("j", info, [], lambda ji, ri: TwoRounds(ji, ri, None), profiling_iterations=0)


def test_a_finished_3d_scheduler_is_served_though_it_copies_its_schedules() -> None:
    """The 3D wrapper builds new schedule objects on every call: serving is by `finished`."""
    from coordinator.pipeline.schedulers import make_3d_parallel

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

    for step in (0, 1):
        for rank in range(4):
            feed(rank, step, None)
    for version in range(3):
        for rank in range(4):
            feed(rank, 10 + version, version)
    assert job.phase == "serving" and job.version == 2


def test_a_partial_first_iteration_is_not_taken_for_the_order() -> None:
    """A trainer that started before the job: its first iteration is seen only in part."""
    job = make_job()
    partial = ORDERS[0][2:]
    for i, name in enumerate(partial):
        job.on_measurement(0, Measurement(kind="instruction", name=name, epoch=0, step=0,
                                          index=i, t0_ns=0, t1_ns=1, time_s=0.1, energy_j=1.0),
                           0.0)
    job.on_measurement(0, Measurement(kind="step", name="", epoch=0, step=0, index=0, t0_ns=0,
                                      t1_ns=1, time_s=1.0, energy_j=10.0), 0.0)
    discover(job, steps=(1, 2))
    assert job.orders[0] == ORDERS[0] and job.phase == "profiling"


def test_a_rank_whose_order_never_repeats_while_discovering_stops_the_job_saying_why() -> None:
    """Each iteration of rank 0 runs one more microbatch: no two alike, nothing to learn. The job
    used to wait at default clocks with no word; it stops after 6 such iterations."""
    job = make_job()
    job.start()
    actions: list = []
    for step in range(6):
        names = ["forward"] * (step + 1) + ["backward"] * (step + 1)
        for i, name in enumerate(names):
            job.on_measurement(0, Measurement(
                kind="instruction", name=name, epoch=0, step=step, index=i, t0_ns=0, t1_ns=1,
                time_s=0.1, energy_j=1.0), 0.0)
        assert job.phase == "discovering" or step == 5
        actions += job.on_measurement(0, Measurement(
            kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1, time_s=1.0,
            energy_j=10.0), 0.0)
    assert job.phase == "error", job.phase
    assert job.error is not None and job.error.startswith(
        "rank 0 ran other instructions in each of its last 6 iterations (the last two differ "
        "at instruction 5: backward before, forward now; 10 and 12 in all)")
    assert "same schedule and number of microbatches" in job.error
    assert [a.state for a in actions if isinstance(a, StatusUpdate)] == ["error"]


def test_a_rank_whose_instructions_change_stops_the_job_and_clears_its_clocks() -> None:
    job = make_job()
    discover(job)
    ORDERS[2] = ["forward", "backward"]
    try:
        actions: list = []
        for step in (5, 6, 7):
            for i, name in enumerate(ORDERS[2]):
                job.on_measurement(0, Measurement(
                    kind="instruction", name=name, epoch=0, step=step, index=i, t0_ns=0,
                    t1_ns=1, time_s=0.1, energy_j=1.0, schedule=0), 0.0)
            actions += job.on_measurement(0, Measurement(
                kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1,
                time_s=1.0, energy_j=10.0, schedule=0), 0.0)
    finally:
        del ORDERS[2]
    assert job.phase == "error" and "no longer runs the 4 instruction(s)" in (job.error or "")
    assert any(isinstance(a, ClearSchedules) for a in actions)


def test_a_departed_rank_stops_profiling_and_a_silent_one_is_named() -> None:
    job = make_job()
    discover(job)
    assert job.tick(10.0) == []
    job.on_measurement(0, Measurement(kind="step", name="", epoch=0, step=6, index=0, t0_ns=0,
                                      t1_ns=1, time_s=1.0, energy_j=10.0, schedule=0), 29.0)
    stalled = job.tick(31.0)
    assert [a.state for a in stalled] == ["stalled"] and "rank(s) 1 " in stalled[0].message
    assert job.tick(40.0) == []  # Once per silence.
    actions = job.on_agent_error(1, "trainer_gone", "trainer pid 7 is gone", 141.0)
    assert job.phase == "stopped" and job.done
    assert any(isinstance(a, ClearSchedules) for a in actions)
    assert "rank 1 left" in actions[-1].message


def test_from_step_ignores_one_rank_with_a_wild_counter() -> None:
    info = JobInfo(pp_degree=3, dp_degree=1, tp_degree=1, world_size=3)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(3)]
    ORDERS[2] = ORDERS[1]
    try:
        job = PipelineJob("job", info, ranks, lambda ji, ri: TwoRounds(ji, ri, None))
        actions = []
        for step in (0, 1):
            actions += iteration(job, 0, step, None) + iteration(job, 1, step, None)
        for step in (2**40, 2**40 + 1):
            actions += iteration(job, 2, step, None)
    finally:
        del ORDERS[2]
    install = next(a for a in actions if isinstance(a, InstallSchedules))
    assert install.from_step == 1 + 2


def resumed(job: PipelineJob, state: dict | None = None, n: int = 1) -> PipelineJob:
    """A new owner's job, rebuilt from what the old owner recorded (through JSON)."""
    if state is None:
        state = json.loads(json.dumps(job.persisted()))
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(2)]
    return PipelineJob("job", info, ranks, lambda ji, ri: TwoRounds(ji, ri, None),
                       scheduler_name="TwoRounds", profiling_iterations=n, resume=state)


def test_nothing_is_recorded_before_the_orders_are_known() -> None:
    job = make_job()
    iteration(job, 0, 0, None)
    assert job.persisted() is None


def test_a_takeover_replays_the_recorded_rounds_and_reinstalls_the_same_schedule() -> None:
    """A replica taking the job over reaches the same scheduler state and schedule version,
    and installs it at once (the agents most likely run it already)."""
    job = make_job(n=1)
    discover(job)
    for rank in (0, 1):
        iteration(job, rank, 10, 0)  # One round observed: schedule 1 (CLOCKS[1]) installed.
    assert job.version == 1 and job.phase == "profiling"
    new = resumed(job)
    assert new.version == 1 and new.phase == "profiling" and new.orders == job.orders
    assert new.desired_schedule(0)[:2] == job.desired_schedule(0)[:2]
    assert new.desired_schedule(0).from_step is None  # Its switch step is not known: at once.
    scheduler = new.scheduler
    assert isinstance(scheduler, TwoRounds) and len(scheduler.seen) == 1
    install, status = new.start()
    assert isinstance(install, InstallSchedules)
    assert (install.version, install.from_step) == (1, None)
    assert isinstance(status, StatusUpdate) and "resumed" in status.message
    # It carries on from there: the next round finishes the scheduler, as the old owner would.
    for rank in (0, 1):
        iteration(new, rank, 20, 1)
    assert new.version == 2 and new.desired_schedule(1)[0].frequencies[0][1] == CLOCKS[2]


def test_unusable_recorded_progress_is_refused() -> None:
    job = make_job(n=1)
    discover(job)
    state = job.persisted()
    assert state is not None
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(2)]
    for bad in ({**state, "orders": {"0": ["forward"]}}, {**state, "rounds": [[{"x": 1}]]},
                {"orders": 3}):
        with pytest.raises(ValueError, match="recorded progress"):
            PipelineJob("job", info, ranks, lambda ji, ri: TwoRounds(ji, ri, None), resume=bad)


class Writes(TwoRounds):
    """TwoRounds that produces a file after each round (as the profiler and Perseus do)."""

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        super().observe(profiling_results)
        self._give_file(f"/out/{len(self.seen)}.csv", f"round {len(self.seen)}\n", "a round")


def test_the_files_a_scheduler_produces_become_write_file_actions() -> None:
    """The job reads no file and writes none: the shell writes what the scheduler produced."""
    job = make_job(Writes, n=1)
    discover(job)
    actions = iteration(job, 0, 4, 0) + iteration(job, 1, 4, 0)
    writes = [a for a in actions if isinstance(a, WriteFile)]
    assert writes == [WriteFile("/out/1.csv", "round 1\n", "a round")]
    keep = next(i for i, a in enumerate(actions) if isinstance(a, KeepFile))
    assert actions.index(writes[0]) == keep + 1  # Right after the round's dump.
    assert job.scheduler is not None and job.scheduler.take_files() == []  # Taken once.


def test_a_scheduler_without_features_answers_the_base_defaults() -> None:
    """What the job asks of any scheduler is declared on the base class, not probed."""
    job = make_job()
    discover(job)
    scheduler = job.scheduler
    assert scheduler is not None
    assert (scheduler.serving, scheduler.replan_window, scheduler.frontier, scheduler.chosen,
            scheduler.job_rank_infos) == (False, 0, None, None, None)
    assert TwoRounds.check_args(anything=1) is None


def test_a_takeover_writes_the_files_its_replay_produced_when_it_starts() -> None:
    job = make_job(Writes, n=1)
    discover(job)
    for rank in (0, 1):
        iteration(job, rank, 10, 0)
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    new = PipelineJob("job", info, list(job.rank_infos.values()),
                      lambda ji, ri: Writes(ji, ri, None), profiling_iterations=1,
                      resume=job.persisted())
    write, install, status = new.start()
    assert write == WriteFile("/out/1.csv", "round 1\n", "a round")
    assert isinstance(install, InstallSchedules) and isinstance(status, StatusUpdate)
    assert not any(isinstance(a, WriteFile) for a in new.start())  # Written once.


def test_a_job_taken_over_numbers_above_the_last_version_recorded() -> None:
    assert resumed_version(3, None) == 3  # (Recorded before versions were kept.)
    assert resumed_version(3, 3) == 3  # The agents run what the replay reached: as it is.
    assert resumed_version(1, 3) == 4  # Versions for no round (budget points) came after.
    assert resumed_version(None, 3) is None  # Nothing reached: the job discovers again.
    job = make_job(n=1)
    discover(job)
    state = json.loads(json.dumps(job.persisted()))
    assert state["version"] == job.version
    del state["version"]  # A record written before the version was kept still resumes.
    assert resumed(job, state).version == job.version


def test_a_takeover_whose_record_missed_the_last_install_still_reaches_the_trainers() -> None:
    """Review: progress is saved beside the job, after its install went out (`saving`), so a
    replica that dies in between leaves a record one version behind what the trainers run.
    They take only a version above theirs: the new owner must not stay below it (here it
    reinstalled version 0 and dropped every measurement of version 1: stuck for ever)."""
    job = make_job(n=1)
    discover(job)
    before = json.loads(json.dumps(job.persisted()))  # Recorded: version 0.
    for rank in (0, 1):
        iteration(job, rank, 10, 0)  # Round 0 closes: version 1 goes out...
    assert job.version == 1  # ...and its SaveProgress is lost with the replica.
    new = resumed(job, before)
    new.start()
    for step in (11, 12):
        for rank in (0, 1):
            iteration(new, rank, step, 1)  # The trainers run version 1 and say so.
    desired = new.desired_schedule(0)
    assert desired is not None and desired[1] > 1
    # The trainers take it, and the lost round is profiled again: the job goes on from there.
    for rank in (0, 1):
        iteration(new, rank, 20, desired[1])
    assert new.version == desired[1] + 1
    assert new.desired_schedule(0)[0].frequencies[0][1] == CLOCKS[1]


def test_a_wild_version_does_not_renumber_a_resumed_job() -> None:
    job = make_job(n=1)
    discover(job)
    new = resumed(job)
    new.start()
    version = new.version
    assert version is not None
    for rank in (0, 1):
        assert iteration(new, rank, 11, version + MAX_VERSION_LEAD + 1) == []
    assert new.version == version  # Dropped as a stale one is.
    for rank in (0, 1):
        iteration(new, rank, 12, version - 1 if version else version + 1000)
    assert new.version == version
