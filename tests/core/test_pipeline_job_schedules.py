"""A pipeline job on any schedule: learned orders, and the bad inputs that stop it clearly.

Each bad input (an action the planner does not know, a cycle, a dependency nobody runs, a
microbatch count that differs between ranks, an order that changes once learned) ends with an
`error` status naming it, `ClearSchedules` (the GPUs back to their default, maximum clocks)
and a job that takes nothing more. An order that changes while the job is still discovering
keeps it discovering, at the GPUs' own clocks, until two iterations are alike
(`tests/core/test_pipeline_memory.py` bounds what it keeps meanwhile).
"""

from __future__ import annotations

import pytest

from coordinator.optimizer import ClearSchedules, InstallSchedules, StatusUpdate
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.planner.schedules import rank_orders
from coordinator.pipeline.schedulers.perseus import Perseus
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import Measurement

pytestmark = pytest.mark.core

CLOCKS = [1410, 1200, 1000]


def make_job(ranks: int = 2) -> PipelineJob:
    info = JobInfo(pp_degree=ranks, dp_degree=1, tp_degree=1, world_size=ranks)
    infos = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(ranks)]
    return PipelineJob("job", info, infos, lambda ji, ri: Perseus(
        ji, ri, None, profiler_args={"clocks": 3}, p_block_w=40.0), scheduler_name="Perseus",
        profiling_iterations=2)


def iteration(job: PipelineJob, rank: int, step: int, names: list[str],
              version: int | None = None) -> list:
    actions = []
    for i, name in enumerate(names):
        actions += job.on_measurement(rank, Measurement(
            kind="instruction", name=name, epoch=0, step=step, index=i, t0_ns=0, t1_ns=1,
            time_s=0.01, energy_j=1.0, schedule=version), 0.0)
    return actions + job.on_measurement(rank, Measurement(
        kind="step", name="", epoch=0, step=step, index=0, t0_ns=0, t1_ns=1, time_s=1.0,
        energy_j=100.0, schedule=version), 0.0)


def run(job: PipelineJob, orders: list[list[str]], steps: range) -> list:
    actions = []
    for step in steps:
        for rank, names in enumerate(orders):
            actions += iteration(job, rank, step, names)
    return actions


def assert_stopped(job: PipelineJob, actions: list, says: str) -> None:
    """Stopped with a status naming the problem, clocks cleared, nothing taken after."""
    assert job.phase == "error" and job.done
    assert any(isinstance(a, ClearSchedules) for a in actions)
    (status,) = [a for a in actions if isinstance(a, StatusUpdate) and a.state == "error"]
    assert says in status.message and "default clocks" in status.message
    assert job.schedules == {} and job.desired_schedule(0) is None
    assert iteration(job, 0, 99, ["forward", "backward"]) == []


def test_a_zero_bubble_job_is_learned_and_profiled_in_each_rank_s_order() -> None:
    job = make_job()
    orders = rank_orders("zero-bubble", 2, 4, 2)
    actions = run(job, orders, range(2))
    (install,) = [a for a in actions if isinstance(a, InstallSchedules)]
    assert [[n for n, _ in s.frequencies] for s in install.schedules] == orders
    assert job.phase == "profiling"


@pytest.mark.parametrize(("orders", "says"), [
    ([["forward:0:0", "recompute:0:0", "backward:0:0"], ["forward:1:0", "backward:1:0"]],
     "rank 0: instruction 'recompute:0:0': unknown kind 'recompute'"),
    ([["forward", "backward"], ["backward", "forward"]],
     "the schedule's dependencies form a cycle (it would deadlock): rank 1's forward "
     "(microbatch 0) -> rank 1's backward (microbatch 0)"),
    ([["forward:0:0", "backward:0:0"], ["forward:2:0", "backward:2:0"]],
     "no rank runs stage 1 (ranks run stages 0, 2): a dependency nobody runs"),
    ([["forward", "forward", "backward", "backward"], ["forward", "backward"]],
     "stage 1 runs forwards of microbatches 0, stage 0 of 0..1: the microbatch count must be "
     "the same everywhere"),
    ([["forward:0:0", "forward:0:1", "backward:0:0"], ["forward:1:0", "backward:1:0",
                                                      "forward:1:1", "backward:1:1"]],
     "stage 0 runs no backward of microbatch 1"),
])
def test_a_schedule_the_planner_cannot_model_stops_the_job_clearly(
        orders: list[list[str]], says: str) -> None:
    job = make_job()
    job.start()
    actions = run(job, orders, range(2))
    assert_stopped(job, actions, "the scheduler Perseus cannot run: Perseus cannot plan this "
                   "pipeline schedule: " + says)


def test_an_order_that_settles_after_two_changes_is_learned() -> None:
    job = make_job()
    for step, m in enumerate((2, 3, 4, 4)):
        run(job, rank_orders("1f1b", 2, m), range(step, step + 1))
    assert job.phase == "profiling" and job.orders[0] == rank_orders("1f1b", 2, 4)[0]


def test_a_rank_whose_named_order_changes_after_discovery_stops_the_job() -> None:
    job = make_job()
    run(job, rank_orders("interleaved-1f1b", 2, 4, 2), range(2))
    assert job.phase == "profiling"
    other = rank_orders("interleaved-1f1b", 2, 6, 2)
    actions: list = []
    for step in (5, 6, 7):
        for rank in (0, 1):
            actions += iteration(job, rank, step, other[rank], version=job.version)
    assert_stopped(job, actions, "rank 0 no longer runs the 16 instruction(s) it was "
                   "discovered with (24 now")
