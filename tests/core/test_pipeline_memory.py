"""What a `PipelineJob` keeps of its ranks' measurements: bounded while discovering, capped per
job and per node (`too_large`), let go when it stops or every rank's trainer said goodbye."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Generator

import pytest

from coordinator.optimizer import ClearSchedules, StatusUpdate
from coordinator.pipeline.job import MAX_DISCOVERY_CHANGES, PipelineJob
from coordinator.pipeline.memory import CHUNK, Kept, NodeBudget, name_bytes, record_bytes
from coordinator.pipeline.schedulers import FrequencyScheduler
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.messages import Measurement

CLOCKS = [1410, 1200]


class Holding(FrequencyScheduler):
    """Runs every instruction at CLOCKS[0], forever (keeps profiling)."""

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        while True:
            yield [FrequencySchedule(rank=i.rank, frequencies=[
                (name, CLOCKS[0]) for name in i.instructions or []]) for i in self.rank_infos]


def make_job(nodes: dict[int, str] | None = None, budget: NodeBudget | None = None,
             cap: int = 1 << 30, job_id: str = "job") -> PipelineJob:
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(2)]
    return PipelineJob(job_id, info, ranks, lambda ji, ri: Holding(ji, ri, None),
                       scheduler_name="Holding", profiling_iterations=2, max_kept_bytes=cap,
                       budget=budget, nodes=nodes)


def instruction(step: int, index: int, name: str, version: int | None = None) -> Measurement:
    return Measurement.model_construct(
        kind="instruction", name=name, epoch=0, step=step, index=index, t0_ns=0, t1_ns=1,
        time_s=0.1, energy_j=1.0, schedule=version)


def step_end(step: int, version: int | None = None) -> Measurement:
    return Measurement.model_construct(
        kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1, time_s=1.0,
        energy_j=10.0, schedule=version)


def iteration(job: PipelineJob, rank: int, step: int, names: list[str],
              version: int | None = None, end: bool = True) -> list:
    actions = []
    for i, name in enumerate(names):
        actions += job.on_measurement(rank, instruction(step, i, name, version), 0.0)
    if end:
        actions += job.on_measurement(rank, step_end(step, version), 0.0)
    return actions


def stopped(actions: list) -> StatusUpdate | None:
    if not any(isinstance(a, ClearSchedules) for a in actions):
        return None
    return next(a for a in actions if isinstance(a, StatusUpdate))


def test_discovery_of_a_rank_with_new_names_every_iteration_keeps_about_one_iteration() -> None:
    """Regression: every complete iteration stayed (64 per rank, 275 bytes per instruction)
    while the job waited for two alike ones. Now at most about one is kept, and the job stops
    (keeping nothing) once `MAX_DISCOVERY_CHANGES` iterations in a row were each new."""
    job = make_job()
    job.start()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(MAX_DISCOVERY_CHANGES):  # 500 instructions each, never the same.
            assert iteration(job, 0, step, [f"op{step}_{k}" for k in range(500)]) == []
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert job.phase == "discovering"
    one = 500 * record_bytes("op10_100")
    assert kept < 4 * one, f"{kept / 1e6:.1f} MB kept for {MAX_DISCOVERY_CHANGES} iterations"
    assert 0 < job.kept.total <= one
    assert job.progress()["kept_bytes"] == job.kept.total
    iteration(job, 0, MAX_DISCOVERY_CHANGES, [f"opx_{k}" for k in range(500)])
    assert job.phase == "error" and job.kept.total == 0


def test_profiling_keeps_only_the_iterations_it_observes() -> None:
    """A rank far ahead of the others kept every complete iteration (up to 64) while profiling;
    only the first `profiling_iterations` are observed."""
    job = make_job()
    names = ["forward", "backward"] * 50
    for step in (0, 1):
        for rank in (0, 1):
            iteration(job, rank, step, names)
    assert job.phase == "profiling" and job.version == 0
    for step in range(2, 40):
        iteration(job, 0, step, names, version=0)
    assert len(job._steps[0]) == 2
    assert job.kept.by_rank[0] == 2 * 50 * (record_bytes("forward") + record_bytes("backward")) + (
        name_bytes(names))  # Two iterations and the order.


def test_a_job_past_its_cap_stops_with_too_large_and_keeps_nothing() -> None:
    job = make_job(cap=200_000)
    job.start()
    actions: list = []
    for step in range(64):  # Iterations that never end: kept until the cap.
        actions = iteration(job, 0, step, [f"x{k}" for k in range(100)], end=False)
        if actions:
            break
    status = stopped(actions)
    assert status is not None and status.state == "error"
    assert status.progress == {"code": "too_large"}
    assert "max_pipeline_mb_per_job" in status.message and "rank 0" in status.message
    assert job.done and job.kept.total == 0 and not any(job._steps.values())
    assert iteration(job, 0, 100, ["x"]) == []  # Stopped: nothing more is kept.
    assert job.kept.total == 0


def test_jobs_of_one_node_share_its_cap_and_a_stopped_job_gives_its_room_back() -> None:
    budget = NodeBudget(600_000)
    a = make_job({0: "n1", 1: "n1"}, budget, job_id="a")
    b = make_job({0: "n1", 1: "n2"}, budget, job_id="b")
    c = make_job({0: "n2", 1: "n2"}, budget, job_id="c")
    for step in range(3):  # ~470 KB of open iterations on n1 for job a
        assert iteration(a, 0, step, [f"a{k}" for k in range(560)], end=False) == []
    assert 400_000 < budget.used("n1") < 600_000
    actions: list = []
    for step in range(3):
        actions = iteration(b, 0, step, [f"b{k}" for k in range(560)], end=False)
        if actions:
            break
    status = stopped(actions)
    assert status is not None and status.progress == {"code": "too_large"}
    assert "node n1" in status.message and "max_pipeline_mb_per_node" in status.message
    for step in range(3):  # Another node's room is its own.
        assert iteration(c, 0, step, [f"c{k}" for k in range(560)], end=False) == []
    # Every rank of job a says goodbye: it stops and gives its room back.
    assert a.on_agent_error(0, "trainer_left", "trainer pid 7 said goodbye", 1.0) == []
    status = stopped(a.on_agent_error(1, "trainer_left", "trainer pid 8 said goodbye", 1.0))
    assert status is not None and status.state == "stopped" and "goodbye" in status.message
    assert a.kept.total == 0 and budget.used("n1") == 0
    d = make_job({0: "n1", 1: "n1"}, budget, job_id="d")
    for step in range(3):
        assert iteration(d, 0, step, [f"d{k}" for k in range(560)], end=False) == []


def test_a_job_dropped_without_letting_go_stops_counting() -> None:
    live: set[str] = set()
    budget = NodeBudget(300_000, alive=lambda job: getattr(job, "job_id", None) in live)
    a = make_job({0: "n", 1: "n"}, budget, job_id="a")
    live.add("a")
    assert iteration(a, 0, 0, [f"a{k}" for k in range(800)], end=False) == []
    b = make_job({0: "n", 1: "n"}, budget, job_id="b")
    live.add("b")
    assert stopped(iteration(b, 0, 0, [f"b{k}" for k in range(800)], end=False)) is not None
    live.discard("a")  # Taken over by another replica: no longer driven here.
    c = make_job({0: "n", 1: "n"}, budget, job_id="c")
    live.add("c")
    assert iteration(c, 0, 0, [f"c{k}" for k in range(800)], end=False) == []
    del a, c  # Freed: their reservations go with them.
    e = make_job({0: "n", 1: "n"}, budget, job_id="e")
    live.add("e")
    assert iteration(e, 0, 0, [f"e{k}" for k in range(800)], end=False) == []
    assert budget.used("n") == e.kept.total and len(budget._holders["n"]) == 1


def test_a_rank_that_said_goodbye_has_its_iterations_dropped_and_may_come_back() -> None:
    job = make_job({0: "n", 1: "n"}, NodeBudget(1 << 30))
    iteration(job, 0, 0, ["f", "b"], end=False)
    iteration(job, 1, 0, ["f", "b"], end=False)
    assert job.on_agent_error(0, "trainer_left", "said goodbye", 1.0) == []
    assert job.kept.by_rank[0] == 0 and job.kept.by_rank[1] > 0
    iteration(job, 0, 1, ["f", "b"])  # Back (a new trainer process bound the rank).
    assert job.on_agent_error(1, "trainer_left", "said goodbye", 1.0) == []  # Rank 0 is back.
    assert job.phase == "discovering"


def test_a_serving_job_whose_ranks_all_left_keeps_serving_and_lets_go() -> None:
    job = make_job()
    names = ["forward", "backward"]
    for step in (0, 1):
        for rank in (0, 1):
            iteration(job, rank, step, names)
    job.phase = "serving"  # (As a watching scheduler serving its plan.)
    iteration(job, 0, 5, names, version=0, end=False)
    assert job.kept.total > 0
    assert job.on_agent_error(0, "trainer_left", "", 1.0) == []
    assert job.on_agent_error(1, "trainer_left", "", 1.0) == []
    assert job.phase == "serving" and job.kept.total == 2 * name_bytes(names)  # The orders.
    assert not any(job._steps.values())


class Holder:
    """A job, as far as `Kept` is concerned."""


def test_kept_refuses_past_its_caps_and_reserves_in_chunks() -> None:
    budget = NodeBudget(3 * CHUNK)
    holders = Holder(), Holder()
    k = Kept(holders[0], 10 * CHUNK, budget, {0: "n"})
    assert k.take(0, CHUNK + 1) is None and k.reserved == {"n": 2 * CHUNK}
    other = Kept(holders[1], 10 * CHUNK, budget, {0: "n"})
    assert other.take(0, 1) is None  # One chunk left.
    assert other.take(0, CHUNK) is not None
    k.give(0, CHUNK + 1)
    assert k.reserved == {"n": 2 * CHUNK}  # (Shrinks only past two chunks of slack.)
    k.release()
    assert other.take(0, CHUNK) is None and budget.used("n") == CHUNK + 1
    with pytest.raises(ValueError):
        NodeBudget(0)
    with pytest.raises(ValueError):
        Kept(Holder(), 0)


def test_a_plan_served_for_ever_keeps_bounded_rounds_charged_and_resumes_the_same_plan() -> None:
    """A scheduler that keeps watching its plan (Perseus) gets a round per window for ever:
    the job keeps the rounds that led to the plan, the first served window and the latest
    `SERVED_ROUNDS_KEPT`, charged to `Kept`; the bounded record resumes the same plan."""
    import json

    from coordinator.optimizer import InstallSchedules
    from coordinator.pipeline.memory import result_bytes
    from coordinator.pipeline.takeover import SERVED_ROUNDS_KEPT
    from tests.core.straggler_kit import FRONTIER, Trainer, Watching
    from tests.core.straggler_kit import make_job as make_watched

    job = make_watched(dp=2)
    trainer = Trainer(job)
    trainer.iterate(n=3)  # Discovery, one profiling round: the plan is served.
    assert job.phase == "serving" and job.version == 1
    trainer.iterate(n=1000)  # 1,000 windows of 1 iteration served.
    assert job.phase == "serving" and job.version == 1 and not job.done
    scheduler = job.scheduler
    assert isinstance(scheduler, Watching) and scheduler.seen == 1000
    rounds = job.kept_rounds.rounds
    assert len(rounds) == 1 + 1 + SERVED_ROUNDS_KEPT  # Profiling, first served, latest ones.
    kept_rounds = sum(result_bytes(r) for results in rounds for r in results)
    assert 0 < kept_rounds <= job.kept.total < 64 << 10
    assert sum(job.kept.by_rank.values()) == job.kept.total
    state = job.persisted()
    assert state is not None
    record = json.dumps(state)
    assert len(record) < 16 << 10, len(record)  # Was 839 KB (every window).

    resumed = make_watched(dp=2, resume=json.loads(record))
    assert resumed.resumed and resumed.phase == "serving" and resumed.version == job.version
    assert resumed.schedules == job.schedules
    assert resumed.persisted() == state  # Replaying the bounded record keeps it as it is.
    assert resumed.kept.total == kept_rounds + sum(
        name_bytes(names) for names in resumed.orders.values())
    installs = [a for a in resumed.start() if isinstance(a, InstallSchedules)]
    assert [(i.version, i.schedules) for i in installs] == [
        (job.version, tuple(job.schedules[r] for r in sorted(job.schedules)))]
    chosen = {s.rank: s.frequencies for s in resumed.schedules.values()}
    assert all(f == 1500 for freqs in chosen.values() for _, f in freqs)
    assert resumed.scheduler is not None and getattr(resumed.scheduler, "chosen", None) == (
        FRONTIER[0])
    more = Trainer(resumed)
    more.step = trainer.step
    more.iterate(n=50)  # It serves on, still bounded.
    assert resumed.version == job.version and len(resumed.kept_rounds.rounds) == len(rounds)


def test_a_new_plan_while_serving_keeps_its_round_and_bounds_the_next_one() -> None:
    """A re-plan (the scheduler serves another plan) is a round a replay needs: kept, and the
    windows served under each plan are bounded; a resumed job serves the latest plan."""
    import json

    from coordinator.pipeline.takeover import SERVED_ROUNDS_KEPT
    from tests.core.straggler_kit import FRONTIER, Trainer, Watching
    from tests.core.straggler_kit import make_job as make_watched

    job = make_watched(dp=2)
    trainer = Trainer(job)
    trainer.iterate(n=3 + 30)
    scheduler = job.scheduler
    assert isinstance(scheduler, Watching)
    scheduler.new_plan = FRONTIER[1]
    trainer.iterate(n=1)  # Its window's round brings the new plan (version 2).
    assert job.version == 2
    trainer.iterate(n=2 + 30)  # The switch, then 30 windows under the new plan.
    assert job.version == 2
    # Profiling; first + latest windows of plan 1; the re-plan; first + latest of plan 2.
    assert len(job.kept_rounds) == 1 + (1 + SERVED_ROUNDS_KEPT) + 1 + (1 + SERVED_ROUNDS_KEPT)

    class Replanned(Watching):
        """Re-plans at the same window as the job's scheduler did (as a replay would)."""

        def observe(self, profiling_results: list[ProfilingResult]) -> None:
            if self.seen == 1 + SERVED_ROUNDS_KEPT and self.chosen == FRONTIER[0]:
                self.new_plan = FRONTIER[1]
            super().observe(profiling_results)

    resumed = PipelineJob("job", job.job_info, list(job.rank_infos.values()),
                          lambda ji, ri: Replanned(ji, ri, None), profiling_iterations=1,
                          resume=json.loads(json.dumps(job.persisted())))
    assert resumed.phase == "serving" and resumed.version == 2
    assert resumed.schedules == job.schedules and resumed.persisted() == job.persisted()
