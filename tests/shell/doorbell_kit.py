"""Helpers of the doorbell's shell tests: a simulated GPU that records which thread locked its
clocks, and `GpuAgent`s wired to a doorbell as the gateway wires them. Agents made here are
kept in `OPEN_AGENTS`; the `close_doorbell_agents` fixture (conftest.py) closes them."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

from tests.shell.agent_kit import wait_for
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.errors import PayloadError
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.trainer import EventDatagram, Kind

LOW, HIGH = 900, 1740
PAIRS = [("forward", LOW), ("backward", HIGH)]


class ThreadGPU(SimGPU):
    """A simulated GPU called as NVML is; records each clock lock and the thread that made it."""

    calls_block = True
    locks: list[tuple[int, str]]
    gate: threading.Event | None = None
    entered: threading.Event | None = None

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        if self.entered is not None:
            self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)
        self.locks.append((min_clock_mhz, threading.current_thread().name))

    def reset_sm_clocks(self) -> None:  # noqa: D102
        super().reset_sm_clocks()
        self.locks.append((0, threading.current_thread().name))


def thread_gpu(tmp_path: Path) -> ThreadGPU:
    SimGPU.create(tmp_path / "sim", 0, preset="A40", energy_update_ms=0)
    gpu = ThreadGPU.open(tmp_path / "sim", 0)
    gpu.locks = []
    return gpu


OPEN_AGENTS: list[GpuAgent] = []
"""Agents the helpers below made: closed after each test (`_close_agents`)."""


async def no_publish(subject: str, payload: bytes) -> None:
    return None


async def wired_agent(tmp_path: Path, gpu: ThreadGPU, on_batch=None,
                       spin_us: float = 0.0) -> GpuAgent:
    """A `GpuAgent` whose doorbell hands its batches to `on_event`, as the gateway does."""
    agent = GpuAgent(gpu, "n", no_publish)
    OPEN_AGENTS.append(agent)
    await agent.start()
    del gpu.locks[:]

    def deliver(batch: list) -> None:
        for data, _ancillary, _flags, _addr in batch:
            try:
                event = dg.decode_datagram(data)
            except PayloadError:
                continue  # (The gateway reports it.)
            if isinstance(event, EventDatagram):
                agent.on_event(event)
        if on_batch is not None:
            on_batch(batch)

    assert agent.open_doorbell(str(tmp_path / "bell.gpu0"), deliver, 0o600, spin_us=spin_us)
    agent.bind("j", 0, pid=os.getpid(), uid=os.getuid())
    await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=PAIRS), "j", 30.0)
    agent.raises.enabled = False  # (every change on its event: the doorbell's or the loop's)
    return agent


def doorbell_event(kind: Kind, a: int = 0, name: str = "") -> bytes:
    return dg.encode_event(kind, os.getpid(), time.monotonic_ns(), a, 0, name)


async def first_forward(agent: GpuAgent, gpu: ThreadGPU, s: socket.socket) -> None:
    """Connect `s` to the doorbell; step 0 begins with forward, locked at LOW by the loop
    (nothing was armed yet), which then arms backward (HIGH)."""
    assert agent.doorbell is not None
    s.connect(agent.doorbell.path)
    for data in (doorbell_event(Kind.STEP_BEGIN, 0),
                 doorbell_event(Kind.INSTRUCTION_BEGIN, 0, "forward")):
        s.send(data)
    await wait_for(lambda: gpu.locks == [(LOW, "gpu0-set_0")], 3.0, "forward's clock")
    await asyncio.sleep(0.02)
