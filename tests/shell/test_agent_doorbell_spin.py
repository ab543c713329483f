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
import resource
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.shell.agent_kit import wait_for
from tests.shell.doorbell_kit import (
    HIGH,
    LOW,
    doorbell_event,
    first_forward,
    thread_gpu,
    wired_agent,
)
from zeus_agent.agent import doorbell as bell
from zeus_agent.agent.doorbell import ClockDoorbell
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.metrics import AgentCollector
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.trainer import EventDatagram, Kind

pytestmark = pytest.mark.usefixtures("close_doorbell_agents")

SPIN_US = 50_000.0
"""Wide windows (from 50 ms before the forecast to 100 ms after): the thread is spinning when
the test sends, 25 ms before the forecast, even on a loaded machine (whose loop may send tens
of milliseconds late). The forecast must then be at least 1.5 s away (ten windows)."""
AWAY_NS = 1_600_000_000
SEND_BEFORE_NS = 25_000_000
MS = 1_000_000


def _iterations(t0: int, gap: int) -> tuple[list[bytes], int, int]:
    """Three steps of forward and backward, stamped `gap` apart from `t0` (the forecast learns
    it): the datagrams, the next instruction's index and its forecast begin."""
    datagrams, index = [], 0
    for step in range(3):
        datagrams.append(dg.encode_event(Kind.STEP_BEGIN, os.getpid(), t0, step, 0, ""))
        for name in ("forward", "backward"):
            datagrams.append(dg.encode_event(Kind.INSTRUCTION_BEGIN, os.getpid(), t0, index, 0,
                                             name))
            index += 1
            t0 += gap
        datagrams.append(dg.encode_event(Kind.STEP_END, os.getpid(), t0, step, 0, ""))
    return datagrams, index, t0


async def test_the_schedules_forecast_sets_the_spin_window(tmp_path):
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu, spin_us=500)
    assert agent.doorbell is not None
    datagrams, index, due = _iterations(time.monotonic_ns(), 40_000_000)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(agent.doorbell.path)
        for data in datagrams:  # back to back: a batch may hold several instructions, each
            s.send(data)  # handled (and armed after) on the loop in turn
        await wait_for(lambda: agent.cursor.position == 0 and agent.doorbell is not None
                       and agent.doorbell.counters["datagrams"] == len(datagrams), 3.0, "all")
        await asyncio.sleep(0.05)
    arm = agent.doorbell._arm  # the next forward, at LOW, after backward began at due - gap
    assert arm is not None and (arm.instruction, arm.name, arm.mhz) == (index, "forward", LOW)
    assert arm.spin == (due - 500_000, due + 1_000_000)
    await agent.clocks.drained()


async def test_a_trainer_that_sends_its_events_elsewhere_is_never_spun_for(tmp_path):
    """An old emitter, or one that cannot reach its doorbell: the events reach the loop through
    the trainers' socket and the doorbell reads nothing, so nothing is spun."""
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu, spin_us=500)
    assert agent.doorbell is not None
    datagrams, index, _ = _iterations(time.monotonic_ns(), 40_000_000)
    for data in datagrams:
        event = dg.decode_datagram(data)
        assert isinstance(event, EventDatagram)
        agent.on_event(event)
    arm = agent.doorbell._arm
    assert arm is not None and arm.instruction == index and arm.spin is None
    await agent.clocks.drained()


async def test_a_forecast_from_an_absurd_stamp_is_not_spun_for_and_reading_goes_on(tmp_path):
    """A trainer's stamp is its own: one near 2**64 made the wait until the window overflow
    and killed both reading threads. Such a forecast is not spun for."""
    gpu, agent, doorbell = await _agent(tmp_path, 500)
    delivered = doorbell.counters
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        _arm(doorbell, 2**64 - 1)
        assert doorbell._arm is not None and doorbell._arm.spin is None
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
        await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
        s.send(doorbell_event(Kind.STEP_END, 0))
        await wait_for(lambda: delivered["datagrams"] == 4, 3.0, "still reading")
    assert all(thread.is_alive() for thread in doorbell._threads)


def test_waiting_works_for_descriptors_past_what_select_takes(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine allows only {hard} open descriptors (a test needs 2,048)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    high, high_wake = os.dup2(a.fileno(), 1500), os.dup2(wake, 1501)
    try:
        assert bell._wait(high, high_wake, 0.01) == (False, False)
        b.send(b"x")
        assert bell._wait(high, high_wake, 1.0) == (True, False)
        os.eventfd_write(wake, 1)
        assert bell._wait(high, high_wake, 1.0) == (True, True)
    finally:
        for fd in (high, high_wake, wake):
            os.close(fd)
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_window_counts_once_and_its_catch_once(tmp_path):
    """The spin finds an instruction's end, then spins on for the next one's begin: one window,
    one change caught."""
    gpu, agent, doorbell = await _agent(tmp_path, SPIN_US)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        due = time.monotonic_ns() + AWAY_NS
        _arm(doorbell, due)
        await asyncio.sleep((due - SEND_BEFORE_NS - time.monotonic_ns()) / 1e9)
        s.send(doorbell_event(Kind.INSTRUCTION_END, 0, "forward"))
        time.sleep(0.0003)
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
        await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
    assert doorbell.counters["spins"] == 1 and doorbell.counters["spin_hits"] == 1


async def _agent(tmp_path: Path, spin_us: float) -> tuple[Any, GpuAgent, ClockDoorbell]:
    """A GPU, its agent (schedule installed, trainer bound) and the agent's doorbell."""
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu, spin_us=spin_us)
    assert agent.doorbell is not None
    return gpu, agent, agent.doorbell


def _arm(doorbell: ClockDoorbell, due_ns: int | None) -> None:
    """Arm backward (HIGH) as the loop does while it handles an event the doorbell read."""
    doorbell._delivering = True
    try:
        doorbell.arm(os.getpid(), 1, "backward", HIGH, due_ns)
    finally:
        doorbell._delivering = False


async def _ring_near_its_forecast(agent: GpuAgent, gpu: Any, s: socket.socket) -> None:
    """Arm backward (HIGH) with a forecast `AWAY_NS` from now, as the loop would; send its
    `instruction_begin` `SEND_BEFORE_NS` before the forecast; wait until the doorbell's thread
    applied it."""
    assert agent.doorbell is not None
    due = time.monotonic_ns() + AWAY_NS
    _arm(agent.doorbell, due)
    await asyncio.sleep((due - SEND_BEFORE_NS - time.monotonic_ns()) / 1e9)
    s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
    await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
    assert gpu.locks[1][0] == HIGH and gpu.locks[1][1].startswith("gpu0-doorbell")
    assert agent.doorbell.counters["taken"] == 1


async def test_an_instruction_in_the_window_is_caught_spinning(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, SPIN_US)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)  # armed for backward (HIGH), no forecast yet
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
    gpu, agent, doorbell = await _agent(tmp_path, 20_000)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        due = time.monotonic_ns() + 700_000_000  # (windows of 60 ms: ten of them away)
        _arm(doorbell, due)
        assert doorbell._arm is not None and doorbell._arm.spin is not None
        await wait_for(lambda: time.monotonic_ns() > due + 40_000_000 + 50_000_000, 3.0,
                       "the window over")
        spun = doorbell.spun_ns
        assert doorbell.counters["spins"] == 1 and doorbell.counters["spin_hits"] == 0
        assert spun > 0
        await asyncio.sleep(0.1)
        assert doorbell.spun_ns == spun  # asleep since
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))  # late: still rung, asleep
        await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
    assert gpu.locks[1][0] == HIGH and gpu.locks[1][1].startswith("gpu0-doorbell")
    assert doorbell.counters["spins"] == 1 and doorbell.counters["taken"] == 1
    assert doorbell.counters["spin_hits"] == 0  # found asleep, not by a spin past its window


async def test_one_thread_of_the_process_spins_at_a_time(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, SPIN_US)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        assert bell._SPIN_TOKEN.acquire(timeout=5)  # another GPU's doorbell spins
        try:
            await _ring_near_its_forecast(agent, gpu, s)
        finally:
            bell._SPIN_TOKEN.release()
    assert doorbell.counters["spins"] == 0 and doorbell.spun_ns == 0


async def test_no_spin_when_it_is_off(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        await _ring_near_its_forecast(agent, gpu, s)
    assert doorbell.counters["spins"] == 0 and doorbell.spun_ns == 0


async def test_a_change_too_close_for_a_tenth_of_a_core_is_not_spun_for(tmp_path):
    gpu, agent, doorbell = await _agent(tmp_path, 1_000)  # windows of 3 ms
    for away, spin in [(20, None), (40, (39, 42))]:  # 20 ms: fewer than ten windows away
        now = time.monotonic_ns()
        _arm(doorbell, now + away * MS)
        expected = None if spin is None else (now + spin[0] * MS, now + spin[1] * MS)
        assert doorbell._arm is not None and doorbell._arm.spin == expected
    doorbell.disarm()
    await agent.clocks.drained()
