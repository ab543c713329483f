"""The GPUs' doorbells (`zeus_agent.agent.doorbell`): a trainer's clock change in one wake-up.

* through a real agent: the HELLO reply names the doorbell, the bound trainer's events go there,
  a scheduled clock change is applied in the doorbell's own thread, every event still reaches
  the agent in order (no mismatch), and the goodbye comes after them (nothing dropped as
  unbound);
* a datagram from another process never applies the armed change (the kernel's pid counts);
* the loop applies a change whose event reached it first (no arm taken twice);
* a restore racing a change applied from the doorbell: the reset comes last, the GPU is left
  unlocked; a change armed before an invalidation is dropped;
* the publisher falls back to the trainers' socket when the doorbell is gone;
* shutdown ends the thread and removes the socket.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.shell.agent_kit import running_agent, wait_for
from tests.shell.doorbell_kit import (
    HIGH,
    LOW,
    OPEN_AGENTS,
    PAIRS,
    ThreadGPU,
    doorbell_event,
    first_forward,
    no_publish,
    thread_gpu,
    wired_agent,
)
from zeus_agent.agent.doorbell import doorbell_path
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.metrics import AgentCollector
from zeus_agent.emit import Publisher
from zeus_agent.errors import GPUError
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import Reply
from zeus_agent.wire.trainer import EventDatagram, Kind, TrainerHello

pytestmark = pytest.mark.usefixtures("close_doorbell_agents")


def _instruction(index: int, name: str) -> bytes:
    return dg.encode_event(Kind.INSTRUCTION_BEGIN, os.getpid(), time.monotonic_ns(), index, 0,
                           name)


async def test_a_bound_trainers_clock_changes_are_applied_by_its_doorbell(nats_server, tmp_path):
    gpu = thread_gpu(tmp_path)
    async with running_agent(nats_server.url, gpus=[gpu]) as server:
        agent = server.agents[0]
        path = server.settings.socket_path
        assert agent.doorbell is not None and agent.doorbell.path == doorbell_path(path, 0)
        pub = Publisher(socket_path=path, gpu_index=0, reconnect_interval_s=0.01)
        reply = await asyncio.to_thread(pub.hello, TrainerHello(job_id="j", rank=0, gpu_index=0))
        assert reply is not None and reply.ok and reply.result["doorbell"] == agent.doorbell.path
        await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=PAIRS), "j", 30.0)
        del gpu.locks[:]  # (the reset at start)

        def train() -> None:
            for _ in range(4):
                pub.step_begin()
                for name, _ in PAIRS:
                    pub.instruction_begin(name)
                    time.sleep(0.02)  # The change is in well before the next instruction.
                    pub.instruction_end(name)
                pub.step_end()

        await asyncio.to_thread(train)
        await wait_for(lambda: len(gpu.locks) >= 8 and agent.doorbell.counters["datagrams"] == 24,
                       5.0, "every change applied, every event through the doorbell")
        assert [mhz for mhz, _ in gpu.locks] == [LOW, HIGH] * 4
        # Lowerings wait for their event: the doorbell's thread applies them (the first one
        # follows the install, on the loop), unless the loop handled the event first (here the
        # trainer is a thread of this process: it competes for the GIL). Raises go ahead of
        # their event (`EarlyRaises`, the setters' thread) once the forecast is ready.
        by_doorbell = [mhz for mhz, t in gpu.locks if t.startswith("gpu0-doorbell")]
        assert by_doorbell, gpu.locks
        assert agent.doorbell.counters["taken"] >= len(by_doorbell)
        assert agent.counters["mismatches"] == 0  # ... and reached the agent, in order
        families = {m.name: m for m in AgentCollector(server.agents, dict).collect()}
        exported = {s.labels["event"]: s.value for s in families["zeus_agent_gpu_events"].samples}
        assert exported["doorbell_taken"] == agent.doorbell.counters["taken"]
        assert exported["doorbell_datagrams"] == 24
        await asyncio.to_thread(pub.close)  # the goodbye follows the events
        await wait_for(lambda: gpu.get_locked_sm_clocks_mhz() is None, 3.0, "restored at BYE")
        assert server.gateway is not None
        assert server.gateway.counters["unbound"] == 0
        assert server.gateway.counters["unanswerable"] == 0


async def test_another_process_cannot_ring_the_armed_change(nats_server, tmp_path):
    gpu = thread_gpu(tmp_path)
    async with running_agent(nats_server.url, gpus=[gpu]) as server:
        agent = server.agents[0]
        assert agent.doorbell is not None
        agent.bind("j", 0, pid=os.getpid(), uid=os.getuid())
        await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=PAIRS), "j", 30.0)
        del gpu.locks[:]  # (the reset at start)
        agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), 0, 0,
                                     "forward"))
        await agent.clocks.drained()
        assert [mhz for mhz, _ in gpu.locks] == [LOW]  # armed for instruction 1 (backward)
        data = _instruction(1, "backward")  # claims this pid; the kernel says otherwise
        subprocess.run(
            [sys.executable, "-c", "import socket, sys; socket.socket(socket.AF_UNIX, "
             "socket.SOCK_DGRAM).sendto(bytes.fromhex(sys.argv[2]), sys.argv[1])",
             agent.doorbell.path, data.hex()], check=True, timeout=30)
        assert server.gateway is not None
        await wait_for(lambda: server.gateway.counters["unbound"] == 1, 3.0,
                       "the foreign datagram handled as the gateway handles it")
        await agent.clocks.drained()
        assert [mhz for mhz, _ in gpu.locks] == [LOW]
        assert agent.doorbell.counters["taken"] == 0


async def _gpu_agent(tmp_path: Path, gpu: ThreadGPU) -> tuple[GpuAgent, list[list]]:
    agent = GpuAgent(gpu, "n", no_publish)
    OPEN_AGENTS.append(agent)
    await agent.start()
    del gpu.locks[:]  # (the reset at start)
    delivered: list[list] = []
    assert agent.open_doorbell(str(tmp_path / "bell.gpu0"), delivered.append, 0o600)
    agent.bind("j", 0, pid=os.getpid(), uid=os.getuid())
    await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=PAIRS), "j", 30.0)
    agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), 0, 0, "forward"))
    await agent.clocks.drained()
    return agent, delivered


def _ring(agent: GpuAgent, data: bytes) -> None:
    assert agent.doorbell is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, agent.doorbell.path)


async def test_the_loop_applies_a_change_whose_event_came_first(tmp_path):
    gpu = thread_gpu(tmp_path)
    agent, _ = await _gpu_agent(tmp_path, gpu)
    agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), 1, 0,
                                 "backward"))  # before any ring: the loop claims it
    await agent.clocks.drained()
    assert gpu.locks[-1] == (HIGH, "gpu0-set_0")
    assert agent.doorbell is not None and agent.doorbell.counters["claimed"] == 1
    _ring(agent, _instruction(1, "backward"))  # late: nothing is armed for it any more
    await wait_for(lambda: agent.doorbell.counters["datagrams"] == 1, 3.0, "the late ring")
    assert agent.doorbell.counters["taken"] == 0
    assert [mhz for mhz, _ in gpu.locks] == [LOW, HIGH]


async def test_a_restore_racing_a_rung_change_leaves_the_gpu_unlocked(tmp_path):
    gpu = thread_gpu(tmp_path)
    agent, delivered = await _gpu_agent(tmp_path, gpu)
    gpu.gate, gpu.entered = threading.Event(), threading.Event()
    _ring(agent, _instruction(1, "backward"))
    assert await asyncio.to_thread(gpu.entered.wait, 5)  # in the lock call, in its thread
    restore = asyncio.ensure_future(agent.restore({"schedule"}, reason="clear"))
    await asyncio.sleep(0.05)
    assert not restore.done()  # the reset waits for the change in flight
    gpu.gate.set()
    assert await restore == ["schedule", "sm_clocks"]
    assert [mhz for mhz, _ in gpu.locks[-2:]] == [HIGH, 0]
    assert gpu.locks[-2][1].startswith("gpu0-doorbell") and gpu.locks[-1][1] == "gpu0-set_0"
    assert gpu.get_locked_sm_clocks_mhz() is None
    assert len(delivered) == 1  # the batch went to the loop all the same


async def test_a_change_armed_before_a_new_schedule_is_dropped(tmp_path):
    gpu = thread_gpu(tmp_path)
    agent, _ = await _gpu_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    epoch = agent.clocks.epoch
    await agent.install_schedule(  # invalidates and disarms
        "j", FrequencySchedule(rank=0, frequencies=[("forward", LOW)]), "j", 30.0)
    _ring(agent, _instruction(1, "backward"))
    await wait_for(lambda: agent.doorbell.counters["datagrams"] == 1, 3.0, "the ring")
    agent.clocks.ring(HIGH, epoch, time.monotonic_ns(), agent.clocks.asked, 1)  # taken before
    await agent.clocks.drained()
    assert [mhz for mhz, _ in gpu.locks] == [LOW]
    assert agent.doorbell.counters["taken"] == 0


def _hello(pub: Publisher, gateway: socket.socket, doorbell: str) -> None:
    """`pub.hello`, answered by a fake agent on `gateway` that names `doorbell`."""

    def agent_side() -> None:
        data, addr = gateway.recvfrom(65536)
        request = dg.decode_datagram(data)
        assert isinstance(request, dg.RequestDatagram) and request.kind is Kind.HELLO
        reply = Reply.success(node="n", doorbell=doorbell)
        gateway.sendto(dg.encode_reply(request.request_id, reply), addr)

    answer = threading.Thread(target=agent_side)
    answer.start()
    reply = pub.hello(TrainerHello(job_id="j", rank=0, gpu_index=0))
    answer.join()
    assert reply is not None and reply.ok


def test_the_publisher_falls_back_to_the_trainers_socket_without_its_doorbell(tmp_path):
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gateway.bind(str(tmp_path / "agent.sock"))
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bell.bind(str(tmp_path / "agent.sock.gpu0"))
    gateway.settimeout(5)
    bell.settimeout(5)
    pub = Publisher(socket_path=str(tmp_path / "agent.sock"), gpu_index=0,
                    reconnect_interval_s=0.001)
    _hello(pub, gateway, str(tmp_path / "agent.sock.gpu0"))
    try:
        pub.instruction_begin("forward")
        assert dg.decode_datagram(bell.recv(512)).kind is Kind.INSTRUCTION_BEGIN
        bell.close()
        os.unlink(tmp_path / "agent.sock.gpu0")
        pub.step_begin()  # refused: counted as no agent; the publisher reconnects
        time.sleep(0.01)
        pub.step_end()
        rebind = dg.decode_datagram(gateway.recv(512))  # re-introduced, from its own socket
        assert isinstance(rebind, dg.RequestDatagram) and rebind.kind is Kind.HELLO
        event = dg.decode_datagram(gateway.recv(512))
        assert isinstance(event, EventDatagram) and event.kind is Kind.STEP_END
        assert pub.stats().dropped_by_reason["no_agent"] == 1
    finally:
        pub.close()
        gateway.close()


async def test_shutdown_ends_the_doorbell_and_removes_its_socket(nats_server, tmp_path):
    gpu = thread_gpu(tmp_path)
    async with running_agent(nats_server.url, gpus=[gpu]) as server:
        doorbell = server.agents[0].doorbell
        assert doorbell is not None and os.path.exists(doorbell.path)
        threads = doorbell._threads
        assert len(threads) == 2 and all(t.is_alive() for t in threads)
    assert not os.path.exists(doorbell.path)
    assert not any(t.is_alive() for t in threads)
    assert server.agents[0].doorbell is None


async def test_a_rung_change_the_loop_overtook_is_dropped(tmp_path):
    """The thread took instruction 1's arm, but the loop handled 1 and 2 before it rang."""
    gpu = thread_gpu(tmp_path)
    handled = threading.Event()
    agent = await wired_agent(tmp_path, gpu, on_batch=lambda batch: handled.set())
    assert agent.doorbell is not None
    ring = agent.clocks.ring

    def late_ring(*change: int) -> bool:
        handled.wait(5)  # The loop runs first ...
        time.sleep(0.05)  # ... and the setters' thread applies what it asked for.
        return ring(*change)

    agent.clocks.ring = late_ring  # type: ignore[method-assign]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(agent.doorbell.path)
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 0, "forward"))
        await wait_for(lambda: gpu.locks == [(LOW, "gpu0-set_0")], 3.0, "forward's clock")
        handled.clear()
        for data in (doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"),
                     doorbell_event(Kind.STEP_END), doorbell_event(Kind.STEP_BEGIN, 1),
                     doorbell_event(Kind.INSTRUCTION_BEGIN, 2, "forward")):
            s.send(data)  # (one batch, most likely)
        await wait_for(lambda: agent.doorbell.counters["datagrams"] == 5, 3.0, "all read")
        await asyncio.sleep(0.2)
        await agent.clocks.drained()
    assert gpu.get_locked_sm_clocks_mhz() == (LOW, LOW)  # instruction 2's, the latest
    assert agent.schedule.clock_mhz == LOW


async def test_a_schedule_pending_for_the_next_step_disarms_the_doorbell(tmp_path):
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    for index, (name, _) in enumerate(PAIRS):  # one iteration: armed for the next one's
        agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), index,
                                     0, name))
        await agent.clocks.drained()  # (else the two coalesce to the latest)
    assert agent.doorbell._arm is not None and agent.doorbell._arm.mhz == LOW
    new = [("forward", 1200), ("backward", HIGH)]
    await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=new), "j", 30.0,
                                 version=1, from_step=1)
    assert agent.doorbell._arm is None  # the next iteration may run the new schedule
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(agent.doorbell.path)
        for data in (doorbell_event(Kind.STEP_END), doorbell_event(Kind.STEP_BEGIN, 1),
                     doorbell_event(Kind.INSTRUCTION_BEGIN, 2, "forward")):
            s.send(data)
        await wait_for(lambda: agent.doorbell.counters["datagrams"] == 3, 3.0, "all read")
    await asyncio.sleep(0.05)
    await agent.clocks.drained()
    assert [mhz for mhz, _ in gpu.locks] == [LOW, HIGH, 1200]  # never the old LOW again


async def test_the_loop_applies_its_own_clock_when_the_doorbell_rang_another(tmp_path):
    """An iteration that ended early: the cursor went back to the schedule's start, which the
    arm (the next position) did not foresee; the names happen to match."""
    pairs = [("forward", LOW), ("backward", HIGH), ("forward", 1200)]
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=pairs), "j",
                                 30.0, version=1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(agent.doorbell.path)
        for data in (doorbell_event(Kind.STEP_BEGIN, 0),
                     doorbell_event(Kind.INSTRUCTION_BEGIN, 0, "forward")):
            s.send(data)
        await wait_for(lambda: len(gpu.locks) == 1, 3.0, "forward's clock")
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
        await wait_for(lambda: len(gpu.locks) == 2, 3.0, "backward's clock")
        for data in (doorbell_event(Kind.STEP_END), doorbell_event(Kind.STEP_BEGIN, 1),
                     doorbell_event(Kind.INSTRUCTION_BEGIN, 2, "forward")):  # armed: 1200
            s.send(data)
        await wait_for(lambda: agent.doorbell.counters["datagrams"] == 6, 3.0, "all read")
    await asyncio.sleep(0.05)
    await agent.clocks.drained()
    assert gpu.get_locked_sm_clocks_mhz() == (LOW, LOW)  # the cursor's: forward at LOW
    assert agent.schedule.clock_mhz == LOW


async def test_events_keep_flowing_while_a_rung_change_waits_in_the_driver(tmp_path):
    gpu = thread_gpu(tmp_path)
    delivered: list[int] = []
    agent = await wired_agent(tmp_path, gpu, on_batch=lambda batch: delivered.append(len(batch)))
    assert agent.doorbell is not None
    try:
        agent.on_event(EventDatagram(Kind.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), 0, 0,
                                     "forward"))
        await agent.clocks.drained()
        gpu.gate, gpu.entered = threading.Event(), threading.Event()  # the next lock hangs
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(agent.doorbell.path)
            s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
            assert await asyncio.to_thread(gpu.entered.wait, 5)  # a doorbell thread is in it
            s.setblocking(False)  # (A full queue raises BlockingIOError: the test fails.)
            for _ in range(100):  # ten times what the socket queues (net.unix.max_dgram_qlen)
                s.send(doorbell_event(Kind.STEP_END))
                await asyncio.sleep(0.001)
            await wait_for(lambda: sum(delivered) == 101, 3.0, "every event delivered")
        assert not gpu.gate.is_set()  # ... while the lock call still hangs
        gpu.gate.set()
        await agent.clocks.drained()
        assert gpu.get_locked_sm_clocks_mhz() == (HIGH, HIGH), (gpu.locks, agent.doorbell.counters)
    finally:
        assert gpu.gate is not None
        gpu.gate.set()  # (else closing waits for the hung call)


def test_a_doorbell_not_there_yet_is_used_once_a_later_hello_names_it(tmp_path):
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gateway.bind(str(tmp_path / "agent.sock"))
    gateway.settimeout(5)
    path = str(tmp_path / "agent.sock.gpu0")
    pub = Publisher(socket_path=str(tmp_path / "agent.sock"), gpu_index=0)

    try:
        _hello(pub, gateway, path)  # a doorbell nobody has opened yet: the trainers' socket
        pub.step_begin()
        assert dg.decode_datagram(gateway.recv(512)).kind is Kind.STEP_BEGIN
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
            bell.bind(path)
            bell.settimeout(5)
            _hello(pub, gateway, path)  # the same path, there now
            pub.step_end()
            assert dg.decode_datagram(bell.recv(512)).kind is Kind.STEP_END
            pub.close()  # the goodbye goes the events' way
            bye = dg.decode_datagram(bell.recv(512))
            assert isinstance(bye, dg.RequestDatagram) and bye.kind is Kind.BYE
    finally:
        pub.close()
        gateway.close()


async def test_an_iteration_that_ends_early_never_keeps_the_rung_forecast(tmp_path):
    """Three forwards a step for a schedule of four: the arm (the fourth, at HIGH) matches the
    next step's first forward, whose clock the loop already believes in; it must win."""
    pairs = [("forward", LOW), ("forward", LOW), ("forward", LOW), ("forward", HIGH)]
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    await agent.install_schedule("j", FrequencySchedule(rank=0, frequencies=pairs), "j",
                                 30.0, version=1)
    index = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(agent.doorbell.path)
        for step in range(3):
            events = [doorbell_event(Kind.STEP_BEGIN, step)]
            for _ in range(3):
                events.append(doorbell_event(Kind.INSTRUCTION_BEGIN, index, "forward"))
                index += 1
            for data in [*events, doorbell_event(Kind.STEP_END, step)]:
                s.send(data)
                await asyncio.sleep(0.01)
                await agent.clocks.drained()
                assert gpu.get_locked_sm_clocks_mhz() in (None, (LOW, LOW)) or (
                    data[2] == Kind.STEP_END), gpu.locks
    await agent.clocks.drained()
    assert gpu.get_locked_sm_clocks_mhz() == (LOW, LOW), gpu.locks
    assert agent.schedule.clock_mhz == LOW


def test_a_doorbell_that_refuses_is_dropped_and_the_event_goes_to_the_trainers_socket(tmp_path):
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gateway.bind(str(tmp_path / "agent.sock"))
    gateway.settimeout(5)
    pub = Publisher(socket_path=str(tmp_path / "agent.sock"), gpu_index=0)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
            bell.bind(str(tmp_path / "agent.sock.gpu0"))
            pub._transport.use_doorbell(str(tmp_path / "agent.sock.gpu0"))
            assert pub._transport._bell is not None

            def refuse(data: bytes) -> None:
                raise PermissionError(errno.EPERM, "refused")

            pub._transport.send = refuse  # as a doorbell that refuses this sender would
            pub.step_begin()
            assert pub._transport._bell is None
            assert dg.decode_datagram(gateway.recv(512)).kind is Kind.STEP_BEGIN
            assert pub.stats().dropped == 0
            pub.step_end()  # and so on, on the trainers' socket
            assert dg.decode_datagram(gateway.recv(512)).kind is Kind.STEP_END
    finally:
        pub.close()
        gateway.close()


async def test_a_ring_dropped_after_a_failed_raise_leaves_the_loop_to_apply_it(tmp_path):
    """The raise issued ahead of `backward` fails; its want made the ring stale: the loop must
    not take the dropped ring for applied, and asks for the clock on the event."""
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        fail = [True]
        lock = gpu.lock_sm_clocks_mhz

        def flaky(low: int, high: int) -> None:
            if fail and fail.pop():
                raise GPUError("transient: the GPU is busy")
            lock(low, high)

        gpu.lock_sm_clocks_mhz = flaky  # type: ignore[method-assign]
        agent.raises._fire(HIGH, agent.raises._seen, agent.clocks.epoch, agent.schedule._raise_now)
        await agent.clocks.drained()
        await wait_for(lambda: agent.schedule.clock_mhz is None, 3.0, "the failure reported")
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
        await wait_for(lambda: agent.doorbell.counters["datagrams"] == 3, 3.0, "the ring read")
        await asyncio.sleep(0.05)
        await agent.clocks.drained()
    assert gpu.get_locked_sm_clocks_mhz() == (HIGH, HIGH), gpu.locks
    assert agent.schedule.clock_mhz == HIGH


async def test_a_late_ring_of_a_trainer_that_left_never_counts_for_the_next(tmp_path):
    """A thread took the old trainer's arm and stalls until a new trainer has bound: its ring
    is stale, and the new trainer's own changes are applied."""
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    go, first = threading.Event(), [True]
    ring = agent.clocks.ring

    def stalled_ring(*change: Any) -> bool:
        if first and first.pop():
            go.wait(5)
        return ring(*change)

    agent.clocks.ring = stalled_ring  # type: ignore[method-assign]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))  # taken; its ring stalls
        s.send(doorbell_event(Kind.STEP_END, 0))
        await wait_for(lambda: agent.doorbell.counters["datagrams"] == 4, 3.0, "all read")
        await asyncio.sleep(0.02)
        agent.unbind()
        agent.bind("j", 0, pid=os.getpid(), uid=os.getuid())  # the next trainer
        go.set()
        await asyncio.sleep(0.05)
        await agent.clocks.drained()
        assert agent.doorbell.counters["stale"] == 1
        s.send(doorbell_event(Kind.STEP_BEGIN, 0))
        for index, (name, mhz) in enumerate(PAIRS):  # its indices start at 0 again
            s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, index, name))
            await asyncio.sleep(0.05)
            await agent.clocks.drained()
            assert gpu.get_locked_sm_clocks_mhz() == (mhz, mhz), gpu.locks
            assert agent.schedule.clock_mhz == mhz


async def test_a_ring_applied_late_does_not_override_a_lock_by_hand_issued_after_it(tmp_path):
    """Backward's ring is accepted (the loop counts it applied) but its thread stalls before
    the call; a lock by hand comes and goes meanwhile: the late change must not undo it (the
    setters' lane kept the two in order)."""
    gpu = thread_gpu(tmp_path)
    agent = await wired_agent(tmp_path, gpu)
    assert agent.doorbell is not None
    go = threading.Event()
    drain = agent.clocks._drain

    def stalled_drain() -> None:
        if threading.current_thread().name.startswith("gpu0-doorbell"):
            go.wait(5)
        drain()

    agent.clocks._drain = stalled_drain  # type: ignore[method-assign]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)  # (armed for backward, at HIGH)
        s.send(doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward"))
        await wait_for(lambda: agent.schedule.clock_mhz == HIGH, 3.0,
                       "the ring counted by the loop")
        await agent.lock_clocks(1200, 1200, "j", 30.0)
        go.set()
        await asyncio.sleep(0.05)
        await agent.clocks.drained()
    assert gpu.get_locked_sm_clocks_mhz() == (1200, 1200), gpu.locks


async def test_a_ring_the_gateway_would_refuse_applies_nothing(tmp_path):
    """The armed instruction's fields in a datagram of another protocol version, too long, or
    truncated: nothing applied by the doorbell; the gateway gets them and refuses them."""
    gpu = thread_gpu(tmp_path)
    delivered: list[int] = []
    agent = await wired_agent(tmp_path, gpu, on_batch=lambda batch: delivered.append(len(batch)))
    assert agent.doorbell is not None
    good = doorbell_event(Kind.INSTRUCTION_BEGIN, 1, "backward")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        await first_forward(agent, gpu, s)
        delivered.clear()
        for data in (msgpack.packb([2, int(Kind.INSTRUCTION_BEGIN), os.getpid(),
                                    time.monotonic_ns(), 1, 0, "backward"]),
                     good[:-3], good + bytes(66_000), bytes([0x97])):
            s.send(data)
        await wait_for(lambda: sum(delivered) == 4, 3.0, "the four delivered")
    await asyncio.sleep(0.05)
    await agent.clocks.drained()
    assert agent.doorbell.counters["taken"] == 0
    assert [mhz for mhz, _ in gpu.locks] == [LOW]
