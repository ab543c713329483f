"""Schedules that switch at an iteration boundary: the agent waits for the step, tells the
trainer, and tags what it measures with the schedule's version (real nats-server, real socket)."""

from __future__ import annotations

import asyncio

import pytest

from tests.shell.agent_kit import Inbox, command, running_agent, wait_for
from zeus_agent.emit import Publisher
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import InstallScheduleCmd
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.trainer import TrainerHello

PLAN = [("forward", 1500), ("backward", 1200)]


@pytest.fixture
async def agent(nats_server):
    async with running_agent(nats_server.url, sim_count=1, recording=True) as server:
        yield server


async def _iteration(pub: Publisher, names: list[str]) -> None:
    pub.step_begin()
    for name in names:
        pub.instruction_begin(name)
        await asyncio.sleep(0.003)  # The agent shares this loop.
        pub.instruction_end(name)
    pub.step_end()
    await asyncio.sleep(0.003)


async def test_a_schedule_from_step_2_starts_there_and_the_trainer_is_told(agent, nc):
    node = agent.settings.node
    meas = await Inbox.open(nc, subjects.job_measurements("jobP", node))
    pub = Publisher(socket_path=agent.settings.socket_path, gpu_index=0)
    try:
        hello = TrainerHello(job_id="jobP", rank=0, gpu_index=0)
        assert (await asyncio.to_thread(pub.hello, hello)).ok
        gpu = agent.agents[0].gpu
        gpu.locks = []
        await _iteration(pub, ["forward", "backward"])  # step 0: nothing installed
        schedule = FrequencySchedule(rank=0, frequencies=PLAN)
        cmd = InstallScheduleCmd(job_id="jobP", schedule=schedule, holder="jobP", lease_s=30,
                                 version=7, from_step=2)
        assert (await command(nc, node, 0, cmd)).ok
        await wait_for(lambda: pub.latest_schedule() is not None, what="the notice")
        notice = pub.latest_schedule()
        assert notice is not None
        assert (notice.job_id, notice.rank, notice.version, notice.from_step) == ("jobP", 0, 7, 2)
        assert notice.frequencies == PLAN
        assert pub.next_step == 1
        await _iteration(pub, ["forward", "backward"])  # step 1: still waiting
        await asyncio.sleep(0.05)
        assert gpu.locks == []
        await _iteration(pub, ["forward", "backward"])  # step 2: switched
        await wait_for(lambda: len(gpu.locks) == 2, what="both clocks applied")
        assert [lo for lo, _, _ in gpu.locks] == [1500, 1200]
        tagged: dict[tuple[str, int], int | None] = {}
        while len(tagged) < 9:  # 3 steps + 6 instructions
            batch = await meas.next(NodeMeasurementBatch)
            for m in (m for p in batch.gpus for m in p.measurements):
                key = (m.name or m.kind, m.step) if m.kind == "instruction" else ("step", m.step)
                tagged[key] = m.schedule
        assert {k: v for k, v in tagged.items() if k[1] < 2} == {
            ("step", 0): None, ("forward", 0): None, ("backward", 0): None,
            ("step", 1): None, ("forward", 1): None, ("backward", 1): None}
        assert tagged[("step", 2)] == tagged[("forward", 2)] == tagged[("backward", 2)] == 7
    finally:
        pub.close()


async def test_an_invalid_schedule_is_refused_and_nothing_is_pending(agent, nc):
    node = agent.settings.node
    cmd = InstallScheduleCmd(job_id="jobQ", schedule=FrequencySchedule(
        rank=0, frequencies=[("forward", 1234)]), holder="jobQ", lease_s=30, from_step=1)
    reply = await command(nc, node, 0, cmd)
    assert not reply.ok
    assert "does not support" in reply.error
    assert agent.agents[0].schedule.pending is None
    assert agent.agents[0].leases.get("schedule") is None
