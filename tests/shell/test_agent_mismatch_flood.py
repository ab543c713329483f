"""A flood of schedule mismatches over a real nats-server: counted exactly, reported a few times.

Before the throttle, every mismatched instruction was one WARNING line and one error event
(20,000 in an iteration: 4.5 MB of log and 19,394 events in 1.5 s).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.shell.agent_kit import Inbox, RawTrainer, command, running_agent, wait_for
from zeus_agent.agent.reports import FLOOD_BURST, FLOOD_REPORTS_PER_S
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import ErrorEvent, InstallScheduleCmd

FLOOD = 2_000



async def test_a_mismatch_flood_is_counted_exactly_and_reported_a_few_times_a_second(
    nats_server, nc, caplog: pytest.LogCaptureFixture
) -> None:
    """Instructions that match no schedule pair: each is counted, a few a second are logged and
    published, and every one is in a report (its own, or the `suppressed` count of a later one,
    the last ones in the summary sent once the flood is over)."""
    caplog.set_level(logging.WARNING, logger="zeus_agent.agent.gpu_agent")
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        errors = await Inbox.open(nc, subjects.gpu_errors(node, 0))
        schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1740)])
        cmd = InstallScheduleCmd(job_id="jobF", schedule=schedule, holder="coord", lease_s=30)
        assert (await command(nc, node, 0, cmd)).ok
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("jobF", rank=0, gpu_index=0)).ok
            started = time.monotonic()
            await trainer.event_when_room(dg.Kind.STEP_BEGIN, 0, 0, "")
            for i in range(FLOOD):  # The schedule has one pair: every instruction mismatches.
                await trainer.event_when_room(dg.Kind.INSTRUCTION_BEGIN, i, 0, "backward")
                await trainer.event_when_room(dg.Kind.INSTRUCTION_END, i, 0, "backward")
            gpu = agent.agents[0]
            await wait_for(lambda: gpu.counters["mismatches"] == FLOOD, 20, "all counted")
            flood_s = time.monotonic() - started
            events: list[ErrorEvent] = []
            accounted = 0
            while accounted < FLOOD:
                event = await errors.next(ErrorEvent, timeout_s=5)
                assert (event.code, event.job_id, event.rank) == ("schedule_mismatch", "jobF", 0)
                events.append(event)
                held = event.detail.get("suppressed", 0)
                summary = "since the last one reported" in event.message
                accounted += held + (0 if summary else 1)
                if held:
                    assert f"{held} more schedule mismatch(es)" in event.message
            assert accounted == FLOOD
            # The burst, then a few per second (and the summary): not one per mismatch.
            assert len(events) <= FLOOD_BURST + FLOOD_REPORTS_PER_S * flood_s + 2, flood_s
            assert events[0].detail == {"instruction": "backward", "index": 0}
            logged = [r for r in caplog.records if "schedule_mismatch" in r.getMessage()]
            assert len(logged) == len(events)
            assert gpu.counters["gaps"] == 0
        finally:
            trainer.close()


async def test_failing_clock_changes_are_counted_exactly_and_reported_a_few_times_a_second(
    nats_server, nc, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a GPU whose clock lock fails (a driver error) sent one `frequency_failed` event
    and one WARNING per instruction (2,000 instructions: 2,000 events). Now throttled as the
    mismatches are; the counter `clock_failures` stays exact."""
    from zeus_agent.errors import GPUError
    from zeus_agent.gpu.sim import SimGPU

    class FailingClocks(SimGPU):
        def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:
            raise GPUError(f"GPU {self.index}: the driver refused the clock change")

    caplog.set_level(logging.WARNING, logger="zeus_agent.agent.gpu_agent")
    gpu = FailingClocks.create(tmp_path / "sim", 0, energy_update_ms=0)
    async with running_agent(nats_server.url, gpus=[gpu]) as agent:
        node = agent.settings.node
        errors = await Inbox.open(nc, subjects.gpu_errors(node, 0))
        clocks = [1740, 1200]
        schedule = FrequencySchedule(
            rank=0, frequencies=[("forward", clocks[i % 2]) for i in range(FLOOD)])
        cmd = InstallScheduleCmd(job_id="jobC", schedule=schedule, holder="coord", lease_s=30)
        assert (await command(nc, node, 0, cmd)).ok
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("jobC", rank=0, gpu_index=0)).ok
            started = time.monotonic()
            await trainer.event_when_room(dg.Kind.STEP_BEGIN, 0, 0, "")
            for i in range(FLOOD):
                await trainer.event_when_room(dg.Kind.INSTRUCTION_BEGIN, i, 0, "forward")
                await trainer.event_when_room(dg.Kind.INSTRUCTION_END, i, 0, "forward")
            sim = agent.agents[0]
            await wait_for(lambda: sim.counters["clock_failures"] == FLOOD, 20, "all counted")
            flood_s = time.monotonic() - started
            accounted, events = 0, 0
            while accounted < FLOOD:
                event = await errors.next(ErrorEvent, timeout_s=5)
                assert event.code == "frequency_failed"
                events += 1
                summary = "since the last one reported" in event.message
                accounted += event.detail.get("suppressed", 0) + (0 if summary else 1)
            assert accounted == FLOOD
            assert events <= FLOOD_BURST + FLOOD_REPORTS_PER_S * flood_s + 2, flood_s
            logged = [r for r in caplog.records if "frequency_failed" in r.getMessage()]
            assert len(logged) == events
        finally:
            trainer.close()


async def test_mismatches_held_back_for_each_binding_are_all_reported(tmp_path) -> None:
    """Review: a rebind during a flood started new throttles while the old binding's summary
    still waited; the new rank's held-back mismatches were never summarised (3 of 10 reported).
    Each throttle now has its summary."""
    from zeus_agent.agent.gpu_agent import GpuAgent
    from zeus_agent.gpu.sim import SimGPU
    from zeus_agent.wire import codec
    from zeus_agent.wire.trainer import EventDatagram

    events: list[ErrorEvent] = []

    async def publish(subject: str, payload: bytes) -> None:
        if subject.endswith(".error"):
            events.append(codec.decode(payload, ErrorEvent))

    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = GpuAgent(SimGPU.open(tmp_path, 0), "n", publish)
    await gpu.start()
    try:
        assert gpu.info is not None
        top = gpu.info.supported_graphics_clocks_mhz[0]
        await gpu.install_schedule("job", FrequencySchedule(rank=0, frequencies=[("forward", top)]),
                                   "job", 30.0)
        t = time.monotonic_ns()
        for rank in (0, 1):
            gpu.bind("job", rank, pid=1)
            gpu.on_event(EventDatagram(dg.Kind.STEP_BEGIN, 1, t, rank, 0, ""))
            for i in range(10):
                gpu.on_event(EventDatagram(dg.Kind.INSTRUCTION_BEGIN, 1, t, i, 0, "backward"))
            await asyncio.sleep(0.05)

        def accounted(rank: int) -> int:
            return sum(e.detail.get("suppressed", 0)
                       + (0 if "since the last one reported" in e.message else 1)
                       for e in events if e.rank == rank)

        await wait_for(lambda: accounted(0) == 10 and accounted(1) == 10, 8, "all reported")
        assert gpu.counters["mismatches"] == 20
    finally:
        gpu.caller.close()
