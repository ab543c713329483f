"""Step marks carry the power limit in force at their event's time, not when it was measured.

The agent measures a trainer event after it arrived (`process_events` reads the energy counter
first, in a thread). A power-limit command handled in between, typically the coordinator's
command for the next window, answering another rank's `step_begin` of the same step, must not
be stamped on a step that began before it: the coordinator would see the window's closing mark
"run at" the next limit and profile the window again.

These tests drive a `GpuAgent` on a simulated GPU without NATS (publish is captured).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import Mark
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.trainer import EventDatagram, Kind
from zeus_demo.cluster import wait_for_async

DEFAULT_W = 300  # A40


class Captured:
    """The agent's published marks, decoded."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        if subject == subjects.job_measurements("job", "n"):
            self.marks += [m for p in codec.decode(payload, NodeMeasurementBatch).gpus
                           if p.gpu == 0 for m in p.marks]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[GpuAgent, Captured]]:
    SimGPU.create(tmp_path, 0, preset="A40")
    captured = Captured()
    agent = GpuAgent(SimGPU.open(tmp_path, 0), "n", captured.publish)
    await agent.start()
    agent.bind("job", 0, os.getpid())
    try:
        yield agent, captured
    finally:
        await agent.restore(reason="test over")
        agent.caller.close()


def step_begin(step: int, t_ns: int | None = None) -> EventDatagram:
    return EventDatagram(Kind.STEP_BEGIN, os.getpid(), t_ns or time.monotonic_ns(), step, 0, "")


@contextlib.asynccontextmanager
async def measuring(agent: GpuAgent) -> AsyncIterator[None]:
    task = asyncio.create_task(agent.process_events())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def marks_of(captured: Captured, n: int) -> list[Mark]:
    await wait_for_async(lambda: len(captured.marks) >= n, 5,
                         lambda: f"{len(captured.marks)} of {n} marks published", interval_s=0.01)
    return captured.marks


async def test_a_limit_set_after_the_event_but_before_its_measurement_is_not_stamped_on_it(
        agent: tuple[GpuAgent, Captured]) -> None:
    gpu_agent, captured = agent
    await gpu_agent.sample()
    gpu_agent.on_event(step_begin(10))  # queued: the agent measures it later
    await gpu_agent.set_power_limit(150, "job", 5.0)  # the next window's command lands first
    async with measuring(gpu_agent):
        [mark] = await marks_of(captured, 1)
        assert mark.step == 10
        assert mark.power_limit_w == DEFAULT_W, (
            "the step began at the default limit; the mark says it ran at the limit set after it")
        gpu_agent.on_event(step_begin(11))  # a step that began after the change
        marks = await marks_of(captured, 2)
    assert marks[1].power_limit_w == 150


async def test_every_change_is_remembered_by_time(agent: tuple[GpuAgent, Captured]) -> None:
    gpu_agent, captured = agent
    await gpu_agent.sample()
    t = [time.monotonic_ns()]
    for watts in (250, 200, 150):
        await gpu_agent.set_power_limit(watts, "job", 5.0)
        t.append(time.monotonic_ns())
    await gpu_agent.restore(reason="back to default")
    for step, t_ns in enumerate(t):  # measured only now, after every change
        gpu_agent.on_event(step_begin(step, t_ns))
    async with measuring(gpu_agent):
        marks = await marks_of(captured, 4)
    assert [m.power_limit_w for m in marks] == [DEFAULT_W, 250, 200, 150]
    assert gpu_agent.power_limit_w == DEFAULT_W
