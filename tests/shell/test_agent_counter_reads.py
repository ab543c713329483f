"""The agent reads the energy counter on its read policy's schedule: never per trainer event or
per window request; an exact window, and a step's measurement, wait for the read that brackets
their end.

The simulated GPU here counts its counter reads and can hold them (a gate in its thread, as a
slow NVML call would), so "no read happened" and "it waited for a read" are facts, not timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.shell.agent_kit import GatedGPU, RawTrainer, gated_gpu, running_agent, wait_for
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import Measurement, MeasurementBatch
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.trainer import EventDatagram, Kind, WindowRequest


def knots(agent: GpuAgent) -> int:
    """Knots in the agent's ring (a query first takes those the reader thread has added)."""
    agent.counter.newest_ns()
    return len(agent.ring)


async def hold_reads(gpu: GatedGPU) -> None:
    """Close the gate and wait until a read is held in it (none can complete from then on)."""
    gpu.waiting.clear()
    gpu.gate.clear()
    await wait_for(gpu.waiting.is_set, 5.0, "a counter read held at the gate")


class Published:
    def __init__(self) -> None:
        self.measurements: list[Measurement] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        if subject == subjects.job_measurements("job", "n"):
            self.measurements += [m for p in codec.decode(payload, NodeMeasurementBatch).gpus
                                  if p.gpu == 0 for m in p.measurements]


@contextlib.asynccontextmanager
async def measuring_agent(gpu: GatedGPU) -> AsyncIterator[tuple[GpuAgent, Published]]:
    published = Published()
    agent = GpuAgent(gpu, "n", published.publish)
    await agent.start()
    agent.bind("job", 0, os.getpid())
    task = asyncio.create_task(agent.process_events())  # (it runs the counter reads too)
    try:
        yield agent, published
    finally:
        gpu.gate.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.restore(reason="test over")
        agent.caller.close()


def event(kind: Kind, a: int, name: str = "") -> EventDatagram:
    return EventDatagram(kind, os.getpid(), time.monotonic_ns(), a, 0, name)


async def test_the_reader_thread_has_ended_once_the_agent_stops_measuring(
        tmp_path: Path) -> None:
    """The counter's reader thread is joined when `process_events` ends (shutdown), so no
    read of the GPU runs after the agent restored it and closed its caller (it was left to
    end by itself after its sleep or its read)."""
    import threading

    gpu = gated_gpu(tmp_path)
    name = f"gpu{gpu.index}-counter"
    async with measuring_agent(gpu) as (agent, _):
        await wait_for(lambda: any(t.name == name for t in threading.enumerate()), 5.0,
                       "the reader thread started")
        await wait_for(lambda: gpu.reads > 0, 5.0, "a read")
    # (The context cancelled and awaited process_events, then restored the GPU.)
    assert not any(t.name == name and t.is_alive() for t in threading.enumerate())
    reads = gpu.reads
    await asyncio.sleep(0.3)  # more than a counter period: no read comes any more
    assert gpu.reads == reads


async def test_trainer_events_never_read_the_counter(tmp_path: Path) -> None:
    gpu = gated_gpu(tmp_path)
    async with measuring_agent(gpu) as (agent, published):
        # Locked on the counter's updates first: while learning the policy reads back to back
        # until an update comes (a scan), whatever the trainer does (60 reads in 354 ms once).
        await wait_for(lambda: agent.counter.policy.locked, 10.0, "the policy locked")
        steps = 300
        before, t0 = gpu.reads, time.monotonic()
        for step in range(steps):  # each event alone, as a pipeline's would come
            for kind, a, name in ((Kind.STEP_BEGIN, step, ""),
                                  (Kind.INSTRUCTION_BEGIN, 2 * step, "forward"),
                                  (Kind.INSTRUCTION_END, 2 * step, "forward"),
                                  (Kind.STEP_END, step, "")):  # fmt: skip
                agent.on_event(event(kind, a, name))
                await asyncio.sleep(0)  # the agent measures it before the next comes
        reads, elapsed_s = gpu.reads - before, time.monotonic() - t0
        # The old agent read once per burst of events: 1,200 reads here. The locked policy
        # reads once per counter update (100 ms), a test read at most beside some of them.
        assert reads <= elapsed_s / 0.020 + 2
        assert reads < 4 * steps / 20
        # Every step and instruction is still measured, once reads bracket it.
        await wait_for(lambda: len(published.measurements) == 2 * steps, 5.0, "measurements")


async def test_a_measurement_waits_for_the_read_that_brackets_its_end(tmp_path: Path) -> None:
    gpu = gated_gpu(tmp_path)
    async with measuring_agent(gpu) as (agent, published):
        await wait_for(lambda: knots(agent) >= 3, 5.0, "the first reads")
        await hold_reads(gpu)
        agent.on_event(event(Kind.STEP_BEGIN, 0))
        await asyncio.sleep(0.01)
        agent.on_event(event(Kind.STEP_END, 0))
        await wait_for(lambda: agent.measurer.idle and len(agent.measurer.unread) == 3, 3.0,
                       "the step and its marks waiting")  # fmt: skip
        await asyncio.sleep(0.05)
        assert published.measurements == []  # no read after its end yet: nothing published
        gpu.gate.set()
        await wait_for(lambda: published.measurements, 5.0, "the step's measurement")
        [m] = published.measurements
        assert agent.counter.covers(m.t1_ns)
        assert m.energy_j == pytest.approx(agent.energy_between(m.t0_ns, m.t1_ns))


async def test_an_exact_window_waits_for_the_read_that_brackets_its_end(
    nats_server, tmp_path: Path
) -> None:
    gpu = gated_gpu(tmp_path)
    async with running_agent(nats_server.url, gpus=[gpu], sample_hz=10.0) as server:
        agent = server.agents[0]
        trainer = RawTrainer(server.settings.socket_path)
        try:
            await wait_for(lambda: knots(agent) >= 3, 5.0, "the first reads")
            t0 = time.monotonic_ns()
            await hold_reads(gpu)
            t1 = time.monotonic_ns()
            reads = gpu.reads
            # The default answer comes at once, from the reads so far: no read per request.
            reply = await trainer.request(Kind.WINDOW, WindowRequest(t0_ns=t0, t1_ns=t1, gpus=[0]))
            assert reply.ok and "exact" not in reply.result and gpu.reads == reads
            # The exact one waits until a read after its end is in.
            request = WindowRequest(t0_ns=t0, t1_ns=t1, gpus=[0], exact=True)
            answer = asyncio.create_task(trainer.request(Kind.WINDOW, request))
            await wait_for(lambda: agent.counter._waiters, 3.0, "the exact window waiting")
            assert not answer.done() and not agent.counter.covers(t1)
            gpu.gate.set()
            reply = await answer
            assert reply.ok and reply.result["exact"] is True
            assert agent.counter.covers(t1)
            [energy] = reply.result["energy_j"]
            assert energy == pytest.approx(agent.energy_between(t0, t1))  # interpolated
        finally:
            gpu.gate.set()
            trainer.close()


async def test_a_step_that_ends_just_before_goodbye_is_still_measured(tmp_path: Path) -> None:
    """Its trainer leaves (the GPU is unbound) before a read brackets its last step: the step
    goes out once one does, under the rank it was measured for."""
    gpu = gated_gpu(tmp_path)
    batches: list[MeasurementBatch] = []

    async def publish(subject: str, payload: bytes) -> None:
        if subject == subjects.job_measurements("job", "n"):  # (the GPU's part, as a batch)
            batches.extend(codec.decode(payload, NodeMeasurementBatch).per_gpu())

    agent = GpuAgent(gpu, "n", publish)
    await agent.start()
    agent.bind("job", 3, os.getpid())
    task = asyncio.create_task(agent.process_events())
    try:
        await wait_for(lambda: knots(agent) >= 3, 5.0, "the first reads")
        await hold_reads(gpu)
        agent.on_event(event(Kind.STEP_BEGIN, 0))
        agent.on_event(event(Kind.STEP_END, 0))
        await wait_for(lambda: len(agent.measurer.unread) == 3, 3.0, "the step waiting for a read")
        agent.unbind()  # the trainer said goodbye
        gpu.gate.set()
        await wait_for(lambda: any(b.measurements for b in batches), 5.0, "the last step")
        [batch] = [b for b in batches if b.measurements]
        assert (batch.job_id, batch.rank, batch.measurements[0].step) == ("job", 3, 0)
    finally:
        gpu.gate.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        agent.caller.close()
