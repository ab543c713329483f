"""A Perseus pipeline job in a power budget, over a real nats-server and a simulated-GPU agent:
a budget set over the bus moves the job to a slower frontier point (its new schedules reach
the agent) and caps its GPUs at that point's limit; lifted, the job serves its own point again
and its GPUs return to their default limit."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from coordinator.service import CoordinatorService
from tests.shell.coordinator_kit import NODE, ask, gpu_info, rank_request, register_job
from tests.shell.pipeline_kit import ORDER, serve_two_pipelines
from zeus_agent.models import FrequencySchedule, ProfilingResult
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetRequest
from zeus_agent.wire.messages import Reply
from zeus_demo.cluster import wait_for_async


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[tuple[tuple[str, int], ...], ...]


def stage(clock: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    return (tuple((name, clock) for name in ORDER),)


# One stage, two pipelines (2 A40s); energies of both GPUs per iteration.
FRONTIER = [Point(1.0, 560.0, stage(1740)), Point(1.5, 450.0, stage(210))]
"""280 W per GPU at the chosen point, 150 W at the slower one."""
ROWS = [(0, kind, mhz, 0.1, 0.1 * w) for kind in ORDER
        for mhz, w in ((1740, 2 * 290.0), (210, 2 * 150.0))]
"""The stage's profile, both GPUs summed (as `make_3d_parallel` sums a stage's ranks)."""
POINT_LIMIT_W = 158
"""ceil(150 W x 1.05): the slower point's node cap."""
CAP_W = 400.0
"""The chosen point's 560 W does not fit; the slower point's 300 W does (floor 200 W)."""


class Planned(FrequencyScheduler):
    """Serves FRONTIER[0] from the start and keeps watching (a Perseus that has planned)."""

    frontier = FRONTIER
    chosen = FRONTIER[0]
    serving = True
    profile_rows = ROWS

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        while True:
            yield [FrequencySchedule(rank=i.rank, frequencies=list(FRONTIER[0].plan[0]))
                   for i in self.rank_infos]


async def serving_job(nc: Any, coord: CoordinatorService) -> PipelineJob:
    """A two-pipeline job registered on both GPUs, serving FRONTIER[0]."""
    job_id = await register_job(nc, dp=2)
    for rank in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, rank))).ok
    await wait_for_async(lambda: isinstance(coord.optimisers.get(job_id), PipelineJob), 5)
    return serve_two_pipelines(coord, job_id, lambda ji, ri: Planned(ji, ri, None))


async def budget(nc: Any, **kw: Any) -> Reply:
    msg = await nc.request(subjects.coord_budget(), codec.encode(BudgetRequest(**kw)), timeout=5)
    return codec.decode(msg.data, Reply)


def clocks(job: PipelineJob) -> set[int]:
    return {f for s in job.schedules.values() for _, f in s.frequencies}


def limits(agent: Any) -> list[int]:
    return [g.gpu.get_power_limit_w() for _, g in sorted(agent.agents.items())]


@pytest.mark.timeout(60)
async def test_a_budget_moves_a_perseus_job_to_a_slower_point_and_the_lift_back(
        nc, agent, coord) -> None:
    job = await serving_job(nc, coord)
    cluster = coord.budgets.cluster
    keys = {(NODE, 0), (NODE, 1)}
    await wait_for_async(lambda: keys <= set(cluster.power_w) & set(cluster.gpus), 10)
    served = job.version
    reply = await budget(nc, action="set", budget=Budget(budget_id="grid", cap_w=CAP_W))
    assert reply.ok, reply
    await wait_for_async(lambda: clocks(job) == {210}, 10)
    assert job.version is not None and served is not None and job.version > served
    assert job.phase == "serving" and job.straggling.budget is FRONTIER[1]
    plan = coord.budget_loop.plans["grid"]
    share = plan.allocation.by_job[job.job_id]
    assert share.key == 1 and share.expected_w == pytest.approx(300.0)
    assert plan.allocation.expected_w <= CAP_W
    assert plan.caps == dict.fromkeys(keys, POINT_LIMIT_W)
    await wait_for_async(lambda: limits(agent) == [POINT_LIMIT_W] * 2, 10)
    for gpu in (0, 1):  # The agent has the point's schedules (waiting for their step).
        assert (await gpu_info(nc, gpu))["gpu"]["schedule_version"] == job.version
    status = coord.budget_loop.statuses["grid"]
    assert [s.slowdown for s in status.shares] == [pytest.approx(0.5)]

    assert (await budget(nc, action="lift", budget_id="grid")).ok
    await wait_for_async(lambda: clocks(job) == {1740}, 10)
    assert job.straggling.budget is None and job.phase == "serving"
    await wait_for_async(lambda: limits(agent) == [300, 300], 10)
    # (The lift request lifts the caps at once; the loop's round then sends the job's own
    # schedules: on a loaded host the limits may be back before the schedules arrive.)
    for gpu in (0, 1):
        async def installed(gpu: int = gpu) -> bool:
            return bool((await gpu_info(nc, gpu))["gpu"]["schedule_version"] == job.version)

        await wait_for_async(installed, 10, f"GPU {gpu} given the job's own schedules")
    # (`tell` records the points once the schedules' replies are in: the agents may show the
    # schedules a moment before.)
    await wait_for_async(lambda: coord.budget_loop.points == {}, 10, "the points forgotten")
