"""A doorbell's thread spins around a forecast clock change (`ClockDoorbell.spin_ns`).

* the schedule's forecast reaches the arm: the window is `spin_ns` before the instruction's
  forecast begin to 2 x `spin_ns` after it;
* an instruction that comes inside the window is caught by the spinning thread and applied
  there;
* a window in which nothing comes ends, and the thread sleeps again (no CPU after it);
* one thread of the process spins at a time: a doorbell that finds another spinning waits
  asleep and still applies its change;
* `spin_ns` 0 never spins, nor does a change forecast less than ten windows away.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

from tests.shell.agent_kit import wait_for
from tests.shell.test_agent_doorbell import (  # noqa: F401 - `_close_agents`: a fixture
    HIGH,
    LOW,
    _close_agents,
    _event,
    _first_forward,
    _gpu,
    _wired_agent,
)
from zeus_agent.agent import doorbell as bell
from zeus_agent.agent.doorbell import ClockDoorbell
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.metrics import AgentCollector
from zeus_agent.wire.trainer import EventDatagram, Kind

SPIN_US = 10_000.0
"""Wide windows (from 10 ms before the forecast to 20 ms after): the thread is spinning when
the test sends, 5 ms before the forecast, however slow the machine. The forecast must then be
at least 300 ms away (ten windows)."""
AWAY_NS = 320_000_000


async def test_the_schedules_forecast_sets_the_spin_window(tmp_path):
    gpu = _gpu(tmp_path)
    agent = await _wired_agent(tmp_path, gpu, spin_us=500)
    assert agent.doorbell is not None
    t0, gap = time.monotonic_ns(), 40_000_000
    index = 0
    for step in range(3):  # forward, backward at a steady gap: the forecast learns it
        agent.on_event(EventDatagram(Kind.STEP_BEGIN, os.getpid(), t0, step, 0, ""))
        for name in ("forward", "backward"):
            agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, os.getpid(), t0, index, 0,
                                         name))
            index += 1
            t0 += gap
        agent.on_event(EventDatagram(Kind.STEP_END, os.getpid(), t0, step, 0, ""))
    arm = agent.doorbell._arm  # the next forward, at LOW, after backward began at t0 - gap
    assert arm is not None and (arm.instruction, arm.name, arm.mhz) == (index, "forward", LOW)
    assert arm.spin == (t0 - 500_000, t0 + 1_000_000)
    await agent.clocks.drained()


async def _agent(tmp_path: Path, spin_us: float) -> tuple[Any, GpuAgent, ClockDoorbell]:
    """A GPU, its agent (schedule installed, trainer bound) and the agent's doorbell."""
    gpu = _gpu(tmp_path)
    agent = await _wired_agent(tmp_path, gpu, spin_us=spin_us)
    assert agent.doorbell is not None
    return gpu, agent, agent.doorbell


async def _ring_near_its_forecast(agent: GpuAgent, gpu: Any, s: socket.socket) -> None:
    """Arm backward (HIGH) with a forecast `AWAY_NS` from now, as the loop would; send its
    `instruction_begin` 5 ms before the forecast; wait until the doorbell's thread applied it."""
    assert agent.doorbell is not None
    due = time.monotonic_ns() + AWAY_NS
    agent.doorbell.arm(os.getpid(), 1, "backward", HIGH, due)
    await asyncio.sleep((due - 5_000_000 - time.monotonic_ns()) / 1e9)
    s.send(_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
    await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
    assert gpu.locks[1][0] == HIGH and gpu.locks[1][1].startswith("gpu0-doorbell")
    assert agent.doorbell.counters["taken"] == 1


async def test_an_instruction_in_the_window_is_caught_spinning(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, SPIN_US)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await _first_forward(agent, gpu, s)  # armed for backward (HIGH), no forecast yet
        assert doorbell._arm is not None and doorbell._arm.spin is None
        await _ring_near_its_forecast(agent, gpu, s)
    assert doorbell.counters["spins"] == 1 and doorbell.counters["spin_hits"] == 1
    assert doorbell.spun_ns > 0
    assert agent.counters["mismatches"] == 0
    families = {m.name: m for m in AgentCollector({0: agent}, dict).collect()}
    exported = {s.labels["event"]: s.value for s in families["zeus_agent_gpu_events"].samples}
    assert exported["doorbell_spins"] == exported["doorbell_spin_hits"] == 1
    [spun] = families["zeus_agent_doorbell_spin_seconds"].samples
    assert spun.value == doorbell.spun_ns / 1e9 > 0


async def test_a_window_without_its_instruction_ends_and_the_thread_sleeps(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, 5_000)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await _first_forward(agent, gpu, s)
        due = time.monotonic_ns() + 200_000_000  # (windows of 15 ms: ten of them away)
        doorbell.arm(os.getpid(), 1, "backward", HIGH, due)
        assert doorbell._arm is not None and doorbell._arm.spin is not None
        await wait_for(lambda: time.monotonic_ns() > due + 10_000_000 + 50_000_000, 3.0,
                       "the window over")
        spun = doorbell.spun_ns
        assert doorbell.counters["spins"] == 1 and doorbell.counters["spin_hits"] == 0
        assert spun > 0
        await asyncio.sleep(0.1)
        assert doorbell.spun_ns == spun  # asleep since
        s.send(_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))  # late: still rung, asleep
        await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
    assert gpu.locks[1][0] == HIGH and gpu.locks[1][1].startswith("gpu0-doorbell")
    assert doorbell.counters["spins"] == 1 and doorbell.counters["taken"] == 1
    assert doorbell.counters["spin_hits"] == 0  # found asleep, not by a spin past its window


async def test_one_thread_of_the_process_spins_at_a_time(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, SPIN_US)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await _first_forward(agent, gpu, s)
        assert bell._SPIN_TOKEN.acquire(timeout=5)  # another GPU's doorbell spins
        try:
            await _ring_near_its_forecast(agent, gpu, s)
        finally:
            bell._SPIN_TOKEN.release()
    assert doorbell.counters["spins"] == 0 and doorbell.spun_ns == 0


async def test_no_spin_when_it_is_off(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await _first_forward(agent, gpu, s)
        await _ring_near_its_forecast(agent, gpu, s)
    assert doorbell.counters["spins"] == 0 and doorbell.spun_ns == 0


async def test_a_change_too_close_for_a_tenth_of_a_core_is_not_spun_for(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, 1_000)  # windows of 3 ms
    now = time.monotonic_ns()
    doorbell.arm(os.getpid(), 1, "backward", HIGH, now + 20_000_000)  # < 10 windows away
    assert doorbell._arm is not None and doorbell._arm.spin is None
    doorbell.arm(os.getpid(), 1, "backward", HIGH, now + 40_000_000)
    assert doorbell._arm is not None and doorbell._arm.spin == (now + 39_000_000,
                                                                now + 42_000_000)
    doorbell.disarm()
    await agent.clocks.drained()
