"""A GPU nothing needs the fine series of is read ~once a second; a trainer's HELLO, a window
request or an exact window brings it back to every update at once. The power limit is read with
the status ~once a second, and at once after the agent sets it.

Counts of the simulated GPU's calls, not timings: the margins are several times what an idle
reader could do in the time allowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tests.shell.agent_kit import GatedGPU, RawTrainer, gated_gpu, running_agent, wait_for
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.gpu.base import Telemetry
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire.trainer import Kind, WindowRequest
from zeus_demo.cluster import wait_for_async


async def _published(subject: str, payload: bytes) -> None:
    del subject, payload


@contextlib.asynccontextmanager
async def idle_agent(gpu: GatedGPU) -> AsyncIterator[GpuAgent]:
    """An agent reading `gpu`, no trainer bound, once its reads are phase-locked and idle."""
    agent = GpuAgent(gpu, "n", _published)
    await agent.start()
    task = asyncio.create_task(agent.process_events())
    try:
        await wait_for(lambda: agent.counter.policy.locked, 10.0, "the policy locked")
        await wait_for(lambda: agent.counter.policy.idle, 5.0, "the reader idle")
        yield agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.restore(reason="test over")
        agent.caller.close()


async def test_an_unbound_gpu_is_read_about_once_a_second_until_a_trainer_binds(
    tmp_path: Path,
) -> None:
    gpu = gated_gpu(tmp_path)
    async with idle_agent(gpu) as agent:
        before = gpu.reads
        await asyncio.sleep(2.0)
        assert gpu.reads - before <= 6  # ~1.2 a second (every update: 20)
        # Samples go on at their rate, with the ring's energy, never going back.
        energies = []
        for _ in range(5):
            sample = await agent.sample()
            assert sample is not None
            energies.append(sample.energy_j)
            await asyncio.sleep(0.05)
        assert energies == sorted(energies) and energies[-1] > energies[0]
        # A trainer binds: its reads follow every update from the next one on, not in a second.
        before = gpu.reads
        agent.bind("job", 0, os.getpid())
        await wait_for(lambda: gpu.reads >= before + 6, 3.0, "reads at every update")
        assert agent.counter.policy.active
        agent.unbind()
        await wait_for(lambda: not agent.counter.policy.active, 2.0, "idle again")


async def test_an_exact_window_wakes_an_idle_reader(tmp_path: Path) -> None:
    gpu = gated_gpu(tmp_path)
    async with idle_agent(gpu) as agent:
        t1 = time.monotonic_ns()
        energy, exact = await agent.energy_between_exact(t1 - 50_000_000, t1)
        assert exact and energy > 0
        assert agent.counter.policy.active  # (it read the next update, not one a second on)


async def test_a_window_request_keeps_an_unbound_gpu_read_at_every_update(
    nats_server, tmp_path: Path
) -> None:
    gpu = gated_gpu(tmp_path)
    async with running_agent(nats_server.url, gpus=[gpu], sample_hz=10.0) as server:
        agent = server.agents[0]
        await wait_for(lambda: agent.counter.policy.locked, 10.0, "the policy locked")
        await wait_for(lambda: agent.counter.policy.idle, 5.0, "the reader idle")
        trainer = RawTrainer(server.settings.socket_path)  # a bare monitor: no HELLO
        try:
            t1 = time.monotonic_ns()
            request = WindowRequest(t0_ns=t1 - 300_000_000, t1_ns=t1, gpus=[0])
            reply = await trainer.request(Kind.WINDOW, request)
            assert reply.ok and reply.result["energy_j"][0] > 0
            before = gpu.reads
            await wait_for(lambda: gpu.reads >= before + 6, 3.0, "reads at every update")
            assert agent.counter.active and agent.binding is None
        finally:
            trainer.close()


async def test_the_power_limit_is_read_about_once_a_second_and_after_the_agent_sets_it(
    tmp_path: Path,
) -> None:
    gpu = gated_gpu(tmp_path)
    async with idle_agent(gpu) as agent:
        agent.bind("job", 0, os.getpid())  # every update read, each with a status
        await wait_for(lambda: agent.counter.policy.active, 2.0, "the reader active")
        reads0, limit_reads0 = agent.counter.reads, agent.counter.limit_reads
        start = time.monotonic()
        await asyncio.sleep(2.0)
        # (Counted over at least 10 updates: a loaded host reads fewer in 2 s.)
        await wait_for(lambda: agent.counter.reads >= reads0 + 10, 10.0, "10 updates read")
        elapsed_s = time.monotonic() - start
        reads = agent.counter.reads - reads0
        limit_reads = agent.counter.limit_reads - limit_reads0
        assert limit_reads <= elapsed_s + 2 and limit_reads < reads / 2, (
            reads, limit_reads, elapsed_s)
        assert agent.info is not None
        limit = agent.info.min_power_limit_w + 10
        # The agent's own change shows in the very next sample, read back from the GPU.
        await agent.set_power_limit(limit, "job", 30.0)
        sample = await agent.sample()
        assert sample is not None and sample.power_limit_w == limit
        # Another tool's change (nvidia-smi) shows within about a second.
        other = SimGPU.open(tmp_path, 0)
        other.set_power_limit_w(limit + 5)

        async def seen() -> bool:
            sample = await agent.sample()
            return sample is not None and sample.power_limit_w == limit + 5

        await wait_for_async(seen, 3.0, lambda: "another tool's limit not seen within 3 s")
        agent.unbind()


async def test_a_status_read_across_the_agents_limit_change_is_not_kept(tmp_path: Path) -> None:
    """A status whose limit was read before the agent set another is dropped, not sampled."""

    class HeldStatus(SimGPU):
        calls_block = True
        hold = False
        entered = threading.Event()
        release = threading.Event()

        def read_status(self, power_limit_w: int | None = None) -> Telemetry:
            status = super().read_status(power_limit_w)  # the limit as it was
            if self.hold:
                self.entered.set()
                self.release.wait(5)
            return status

    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = HeldStatus.open(tmp_path, 0)
    assert isinstance(gpu, HeldStatus)
    agent = GpuAgent(gpu, "n", _published)
    await agent.start()
    try:
        reader = agent.counter
        old = gpu.get_power_limit_w()
        reader.refresh_limit()  # (or the limit read last is over a second old): read it again
        gpu.hold = True
        thread = threading.Thread(target=reader._read_status)  # as after a counter read
        thread.start()
        assert await asyncio.to_thread(gpu.entered.wait, 5)
        gpu.set_power_limit_w(old - 50)  # the agent's set, then its refresh
        reader.refresh_limit()
        gpu.release.set()
        await asyncio.to_thread(thread.join, 5)
        taken = reader.status
        assert taken is None or taken[1].power_limit_w == old - 50  # a sample takes it
    finally:
        agent.caller.close()
