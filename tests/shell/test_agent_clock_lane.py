"""The clock-change path of a GPU whose calls block: `ClockLane` and `EarlyRaises` in an agent.

* a change wanted before its schedule was cleared is dropped in the GPU's thread, even when it
  only gets there after the restore;
* a clock change never queues behind a read on the getters' lane (its own lane);
* a raise is issued ahead of its forecast instruction, whose event then sends nothing; a
  lowering waits for its event; a mismatch is still reported by the event.
"""

from __future__ import annotations

import asyncio
import threading
import time

from tests.shell.agent_kit import wait_for
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire.trainer import EventDatagram, Kind

MS = 1_000_000


class ThreadedGPU(SimGPU):
    """A simulated GPU called as NVML is (in the GPU's threads); records its clock locks."""

    calls_block = True
    locks: list[int]
    gate: threading.Event | None = None

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        self.locks.append(min_clock_mhz)
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)

    def get_power_w(self) -> float:  # noqa: D102 - a getter that can be held
        if self.gate is not None:
            self.gate.wait(5)
        return super().get_power_w()


async def _no_publish(subject: str, payload: bytes) -> None:
    return None


def _event(kind: Kind, t_ns: int, a: int = 0, name: str = "") -> EventDatagram:
    return EventDatagram(kind=kind, pid=1, t_ns=t_ns, a=a, b=0, name=name)


async def _agent(tmp_path, pairs: list[tuple[str, int]]) -> tuple[GpuAgent, ThreadedGPU]:
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = ThreadedGPU.open(tmp_path, 0)
    gpu.locks = []
    agent = GpuAgent(gpu, "n", _no_publish)
    await agent.start()
    agent.bind("job", 0)
    await agent.install_schedule("job", FrequencySchedule(rank=0, frequencies=pairs), "job", 30.0)
    return agent, gpu


async def test_a_change_wanted_before_a_clear_is_dropped_in_the_gpus_thread(tmp_path):
    agent, gpu = await _agent(tmp_path, [("forward", 1200)])
    try:
        hold = threading.Event()
        busy = agent.caller.submit_setter(hold.wait, 5)  # the setters' lane is busy
        agent.schedule.apply_frequency(1200)  # queued behind it
        restore = agent.restore({"schedule"}, reason="clear command")
        hold.set()
        assert await restore == ["schedule", "sm_clocks"]
        await agent.clocks.drained()
        busy.result(1)
        assert gpu.locks == []  # dropped: its schedule was cleared before it ran
        assert gpu.get_locked_sm_clocks_mhz() is None
    finally:
        agent.caller.close()


async def test_a_clock_change_does_not_wait_behind_a_queued_read(tmp_path):
    agent, gpu = await _agent(tmp_path, [("forward", 1200)])
    try:
        gpu.gate = threading.Event()
        read = agent.caller.call(gpu.get_power_w)  # holds the getters' lane
        pending = __import__("asyncio").ensure_future(read)
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 0, "forward"))
        await agent.clocks.drained()
        assert gpu.locks == [1200]  # applied while the read still holds its lane
        assert not pending.done()
        gpu.gate.set()
        await pending
    finally:
        agent.caller.close()


async def test_a_raise_is_issued_ahead_and_its_event_sends_nothing(tmp_path):
    low, high = 900, 1740
    agent, gpu = await _agent(tmp_path, [("forward", low), ("backward", high)])
    try:
        lead = agent.raises.ahead.lead_ns  # before calibration: the longest lead
        gap = 3 * lead  # forward lasts three leads
        t = time.monotonic_ns() - 10 * gap
        for step in range(2):  # one iteration to learn the gaps (stamps in the past)
            agent.on_event(_event(Kind.STEP_BEGIN, t, step))
            agent.on_event(_event(Kind.INSTRUCTION_BEGIN, t, 2 * step, "forward"))
            await agent.clocks.drained()  # (changes wanted at once coalesce to the latest)
            agent.on_event(_event(Kind.INSTRUCTION_BEGIN, t + gap, 2 * step + 1, "backward"))
            await agent.clocks.drained()
            agent.on_event(_event(Kind.STEP_END, t + 2 * gap, step))
            t += 2 * gap
        await agent.clocks.drained()
        issued = agent.raises.issued
        assert gpu.locks == [low, high, low, high]  # all on their events so far
        now = time.monotonic_ns()
        agent.on_event(_event(Kind.STEP_BEGIN, now, 2))
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, now, 4, "forward"))  # lowers on its event
        await wait_for(lambda: agent.raises.issued > issued, 5.0, "the raise issued ahead")
        await agent.clocks.drained()
        assert gpu.locks[-2:] == [low, high]
        assert gpu.get_locked_sm_clocks_mhz() == (high, high)  # in before backward began
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 5, "other"))
        await agent.clocks.drained()
        assert len(gpu.locks) == 6  # not sent again on its event
        assert agent.counters["mismatches"] == 1  # the event still checks the instruction
        assert agent.raises.on_event == 0
    finally:
        agent.caller.close()


async def test_no_raise_is_issued_ahead_when_turned_off(tmp_path):
    agent, gpu = await _agent(tmp_path, [("forward", 900), ("backward", 1740)])
    agent.raises.enabled = False
    try:
        gap = 3 * agent.raises.ahead.lead_ns
        t = time.monotonic_ns() - 10 * gap
        for i in range(6):
            agent.on_event(_event(Kind.INSTRUCTION_BEGIN, t + i * gap, i,
                                  ("forward", "backward")[i % 2]))
            await agent.clocks.drained()
            if i % 2:
                agent.on_event(_event(Kind.STEP_END, t + i * gap, i // 2))
        await agent.clocks.drained()
        assert agent.raises.issued == 0
        assert gpu.locks == [900, 1740] * 3
    finally:
        agent.caller.close()


class FailingGPU(ThreadedGPU):
    """Its first clock lock raises what no backend error maps (an OSError, a driver bug)."""

    failures = 1

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        if self.failures:
            self.failures -= 1
            raise OSError("the device file's directory is gone")
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)


async def test_an_unexpected_error_in_the_lane_is_reported_and_the_lane_goes_on(tmp_path):
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = FailingGPU.open(tmp_path, 0)
    assert isinstance(gpu, FailingGPU)
    gpu.locks = []
    agent = GpuAgent(gpu, "n", _no_publish)
    await agent.start()
    agent.bind("job", 0)
    await agent.install_schedule(
        "job", FrequencySchedule(rank=0, frequencies=[("forward", 900), ("backward", 1740)]),
        "job", 30.0)
    agent.raises.enabled = False
    try:
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 0, "forward"))
        await agent.clocks.drained()
        await wait_for(lambda: agent.counters["clock_failures"] == 1, 2.0, "the failure reported")
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 1, "backward"))
        await agent.clocks.drained()
        assert gpu.locks == [1740]  # the lane did not die with the first change
        assert gpu.get_locked_sm_clocks_mhz() == (1740, 1740)
    finally:
        agent.caller.close()


async def test_a_change_dropped_by_a_new_schedule_is_sent_again_by_it(tmp_path):
    agent, gpu = await _agent(tmp_path, [("forward", 1200)])
    agent.raises.enabled = False
    try:
        hold = threading.Event()
        busy = agent.caller.submit_setter(hold.wait, 5)  # the setters' lane is busy
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 0, "forward"))
        # Another schedule (same first clock) replaces it before the change ran: dropped.
        await agent.install_schedule(
            "job", FrequencySchedule(rank=0, frequencies=[("forward", 1200)]), "job", 30.0,
            version=1)
        hold.set()
        busy.result(1)
        await agent.clocks.drained()
        assert gpu.locks == []
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, time.monotonic_ns(), 0, "forward"))
        await agent.clocks.drained()
        assert gpu.get_locked_sm_clocks_mhz() == (1200, 1200)  # the new schedule's clock is in
    finally:
        agent.caller.close()


async def test_a_trainer_that_leaves_takes_its_planned_raise_with_it(tmp_path):
    """A BYE (unbind) between a lowering and the raise planned after it: no raise follows,
    although the schedule's lease is still live (its trainer is gone: the GPU stays put)."""
    low, high = 900, 1740
    agent, gpu = await _agent(tmp_path, [("forward", low), ("backward", high)])
    try:
        lead = agent.raises.ahead.lead_ns
        gap = 3 * lead
        t = time.monotonic_ns() - 10 * gap
        for step in range(2):  # one iteration to learn the gaps (stamps in the past)
            agent.on_event(_event(Kind.STEP_BEGIN, t, step))
            agent.on_event(_event(Kind.INSTRUCTION_BEGIN, t, 2 * step, "forward"))
            await agent.clocks.drained()
            agent.on_event(_event(Kind.INSTRUCTION_BEGIN, t + gap, 2 * step + 1, "backward"))
            await agent.clocks.drained()
            agent.on_event(_event(Kind.STEP_END, t + 2 * gap, step))
            t += 2 * gap
        issued = agent.raises.issued
        now = time.monotonic_ns()
        agent.on_event(_event(Kind.STEP_BEGIN, now, 2))
        agent.on_event(_event(Kind.INSTRUCTION_BEGIN, now, 4, "forward"))  # lowers; plans a raise
        await agent.clocks.drained()
        locks = list(gpu.locks)
        agent.unbind()
        await asyncio.sleep(4 * gap / 1e9)  # past the raise's planned instant
        await agent.clocks.drained()
        assert agent.raises.issued == issued
        assert gpu.locks == locks and gpu.get_locked_sm_clocks_mhz() == (low, low)
    finally:
        agent.caller.close()
