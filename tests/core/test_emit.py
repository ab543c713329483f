"""zeus_agent.emit against a fake agent: a bound Unix datagram socket served by a thread."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.emit_kit import CLOCKS, TOKEN, FakeAgent, default_handler
from zeus_agent import emit
from zeus_agent.emit import api as emit_api  # init reads _distributed from there
from zeus_agent.models import JobInfo
from zeus_agent.wire.codec import validate
from zeus_agent.wire.messages import PowerLimitOptions, RegisterJob, RegisterRank, Reply
from zeus_agent.wire.trainer import (
    EventDatagram,
    Kind,
    RequestDatagram,
    TrainerHello,
    WindowRequest,
    decode_datagram,
)

pytestmark = pytest.mark.usefixtures("clean_emit")


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "agent.sock")


@pytest.fixture
def agent(sock_path: str) -> Iterator[FakeAgent]:
    fake = FakeAgent(sock_path)
    yield fake
    fake.stop()


# ----------------------------------------------------------------------------- events
def test_event_layout_and_counters(agent: FakeAgent) -> None:
    pub = emit.Publisher(socket_path=agent.path)
    pub.epoch_begin()
    pub.step_begin()
    pub.instruction_begin("forward")
    pub.instruction_end("forward")
    pub.instruction_begin("backward")
    pub.instruction_end("backward")
    pub.step_end()
    pub.step_begin()
    pub.step_end()
    pub.epoch_end()
    pub.epoch_begin()
    pub.step_begin()
    events = agent.wait_events(12, pub)
    got = [(e.kind, e.a, e.b, e.name) for e in events]
    assert got == [
        (Kind.EPOCH_BEGIN, 0, 0, ""),
        (Kind.STEP_BEGIN, 0, 0, ""),
        (Kind.INSTRUCTION_BEGIN, 0, 0, "forward"),
        (Kind.INSTRUCTION_END, 0, 0, "forward"),
        (Kind.INSTRUCTION_BEGIN, 1, 0, "backward"),
        (Kind.INSTRUCTION_END, 1, 0, "backward"),
        (Kind.STEP_END, 0, 0, ""),
        (Kind.STEP_BEGIN, 1, 0, ""),
        (Kind.STEP_END, 1, 0, ""),
        (Kind.EPOCH_END, 0, 0, ""),
        (Kind.EPOCH_BEGIN, 1, 0, ""),
        (Kind.STEP_BEGIN, 2, 1, ""),
    ]
    assert all(e.pid == os.getpid() for e in events)
    stamps = [e.t_ns for e in events]
    assert stamps == sorted(stamps)
    stats = pub.stats()
    assert (stats.events, stats.sent, stats.dropped, stats.queued) == (12, 12, 0, 0)
    pub.close()


def test_no_agent_never_raises_and_counts_drops(sock_path: str) -> None:
    pub = emit.Publisher(socket_path=sock_path)
    assert not pub.connected
    for _ in range(100):
        pub.step_begin()
        pub.instruction_begin("forward")
        pub.step_end()
    stats = pub.stats()
    assert stats.events == 300
    assert stats.sent == 0
    assert stats.dropped == stats.dropped_by_reason["no_agent"] == 300
    pub.close()
    pub.step_begin()  # Even after close: counted, not raised.
    assert pub.stats().dropped == 301


def test_full_agent_queue_backlogs_then_drops_and_flushes(sock_path: str) -> None:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(sock_path)  # Never reads until the end.
    try:
        pub = emit.Publisher(socket_path=sock_path, backlog=50)
        for _ in range(500):
            pub.step_begin()
        stats = pub.stats()
        assert stats.queued == 50
        assert stats.dropped_by_reason["buffer_full"] > 0
        assert stats.sent + stats.queued + stats.dropped == stats.events == 500
        receiver.setblocking(False)
        received = []
        deadline = time.monotonic() + 2
        while len(received) < 500 - stats.dropped and time.monotonic() < deadline:
            try:
                received.append(decode_datagram(receiver.recv(65536)))
            except BlockingIOError:
                pub.flush()
        assert pub.stats().queued == 0
        steps = [e.a for e in received if isinstance(e, EventDatagram)]
        assert steps == sorted(steps)  # The backlog keeps the order.
        # Nothing sent or queued was lost; past the backlog the newest were dropped.
        assert len(steps) == 500 - stats.dropped
        assert steps == list(range(len(steps)))
        pub.close()
    finally:
        receiver.close()


def test_late_agent_is_picked_up(sock_path: str) -> None:
    pub = emit.Publisher(socket_path=sock_path, reconnect_interval_s=0.01)
    pub.step_begin()
    assert pub.stats().dropped_by_reason["no_agent"] == 1
    fake = FakeAgent(sock_path)
    try:
        time.sleep(0.02)
        pub.step_begin()
        events = fake.wait_events(1)
        assert [(e.kind, e.a) for e in events] == [(Kind.STEP_BEGIN, 1)]
        assert pub.connected
    finally:
        fake.stop()
        pub.close()


def test_restarted_agent_is_picked_up_and_rebound(sock_path: str) -> None:
    first = FakeAgent(sock_path)
    emit.init(job_id="job-1", join_token=TOKEN, rank=0, socket_path=sock_path)
    pub = emit.get_publisher()
    pub._transport._retry_interval_ns = 10_000_000
    emit.step_begin()
    assert first.wait_events(1)
    first.stop()
    emit.step_begin()  # Refused: the agent is gone.
    second = FakeAgent(sock_path)
    try:
        time.sleep(0.02)
        emit.step_begin()
        events = second.wait_events(1)
        assert [e.a for e in events] == [2]
        # The new agent learns who we are without a blocking round trip.
        hello = second.wait_requests(Kind.HELLO)
        assert validate(TrainerHello, hello[0].payload).job_id == "job-1"
        assert second.wait_requests(Kind.REGISTER_RANK)
        assert emit.stats().dropped_by_reason["no_agent"] >= 1
    finally:
        emit.close()
        second.stop()


def test_bad_names_are_counted_not_raised(agent: FakeAgent) -> None:
    pub = emit.Publisher(socket_path=agent.path)
    pub.instruction_begin(object())  # type: ignore[arg-type]
    pub.instruction_end("x" * 70_000)  # Larger than a datagram.
    assert pub.stats().dropped_by_reason["error"] == 2
    pub.close()


# ----------------------------------------------------------------------------- windows
def test_push_pop_nesting_and_energies(agent: FakeAgent) -> None:
    pub = emit.Publisher(socket_path=agent.path, gpu_index=2)
    pub.push_window("outer")
    pub.push_window("inner")
    time.sleep(0.01)
    inner = pub.pop_window("inner")
    outer = pub.pop_window()
    assert 0.01 <= inner.time <= outer.time
    assert inner.energy == outer.energy == [30.0]
    windows = [validate(WindowRequest, r.payload) for r in agent.requests if r.kind is Kind.WINDOW]
    assert [w.gpus for w in windows] == [[2], [2]]
    assert windows[1].t0_ns < windows[0].t0_ns < windows[0].t1_ns < windows[1].t1_ns
    pub.close()


def test_pop_errors() -> None:
    pub = emit.Publisher(socket_path="/nonexistent/agent.sock")
    with pytest.raises(RuntimeError, match="No profiling window active. Consider calling"):
        pub.pop_window()
    pub.push_window("a")
    with pytest.raises(ValueError, match="innermost window 'a'"):
        pub.pop_window("b")
    assert pub.pop_window("a").time >= 0  # The mismatch left the stack alone.
    pub.close()


def test_window_without_agent_is_nan(sock_path: str) -> None:
    emit.init(socket_path=sock_path, gpu_indices=[0, 1])
    emit.push_window()
    time.sleep(0.005)
    result = emit.pop_window()
    assert result.time >= 0.005
    assert len(result.energy) == 2 and all(math.isnan(e) for e in result.energy)
    assert emit.stats().windows_unanswered == 1


def test_window_context_manager_and_wider_gpus(agent: FakeAgent) -> None:
    emit.init(socket_path=agent.path, gpu_index=0, gpu_indices=[0, 1])
    with emit.window("fwd") as w:
        pass
    assert w.result is not None and w.result.energy == [10.0, 20.0]


def test_window_refused_by_agent_is_nan(sock_path: str) -> None:
    fake = FakeAgent(sock_path, lambda r: Reply.failure("out_of_range", "too old"))
    try:
        pub = emit.Publisher(socket_path=sock_path)
        pub.push_window()
        assert math.isnan(pub.pop_window().energy[0])
        assert pub.stats().windows_unanswered == 1
        pub.close()
    finally:
        fake.stop()


# ----------------------------------------------------------------------------- init
def test_init_registers_job_hello_and_rank(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setenv(emit.ENV_SOCKET, agent.path)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    pub = emit.init(job_info=job, power_limit=PowerLimitOptions(selector="Energy"))
    assert pub.job_id == "job-1" and pub.node == "node-a" and not pub.detached
    kinds = [r.kind for r in agent.requests]
    assert kinds == [Kind.REGISTER_JOB, Kind.HELLO, Kind.REGISTER_RANK]
    reg_job = validate(RegisterJob, agent.requests[0].payload)
    assert reg_job.job == job and reg_job.power_limit is not None
    assert reg_job.power_limit.selector == "Energy"
    hello = validate(TrainerHello, agent.requests[1].payload)
    assert (hello.job_id, hello.rank, hello.gpu_index) == ("job-1", 0, 0)
    assert hello.join_token == TOKEN  # the agent checks it once it has relayed a rank with it
    reg_rank = validate(RegisterRank, agent.requests[2].payload)
    assert (reg_rank.job_id, reg_rank.join_token) == ("job-1", TOKEN)
    assert pub.join_token == TOKEN  # for the other ranks, with the id
    assert reg_rank.rank_info.available_frequencies == CLOCKS
    assert (reg_rank.gpu.node, reg_rank.gpu.gpu_index) == ("node-a", 0)
    assert "pid" not in agent.requests[2].payload  # the agent takes the pid from the kernel
    emit.step_begin()
    assert agent.wait_events(1)[0].kind is Kind.STEP_BEGIN
    emit.close()
    assert agent.wait_requests(Kind.BYE)


def test_init_other_rank_uses_given_job_id(agent: FakeAgent) -> None:
    emit.init(job_id="job-7", join_token=TOKEN, rank=3, dp_rank=3, gpu_index=1,
              socket_path=agent.path)
    assert [r.kind for r in agent.requests] == [Kind.HELLO, Kind.REGISTER_RANK]
    reg = validate(RegisterRank, agent.requests[1].payload)
    assert (reg.job_id, reg.rank_info.rank, reg.rank_info.dp_rank, reg.gpu.gpu_index) == (
        "job-7",
        3,
        3,
        1,
    )
    assert reg.join_token == TOKEN


def test_init_other_rank_without_the_join_token_is_an_error(agent: FakeAgent) -> None:
    """The coordinator would refuse the rank: say so before anything is sent."""
    with pytest.raises(ValueError, match="rank 3 needs the job's join token"):
        emit.init(job_id="job-7", rank=3, dp_rank=3, gpu_index=1, socket_path=agent.path)
    assert agent.requests == []


def test_rank_0_broadcasts_the_job_id_with_its_join_token(agent: FakeAgent, monkeypatch) -> None:
    """With torch.distributed, rank 0 broadcasts (id, token, error); the others use both."""
    sent: list[Any] = []

    class Dist:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def broadcast_object_list(self, box: list[Any], src: int) -> None:
            assert src == 0
            if self.rank == 0:
                sent.append(box[0])
            else:
                box[0] = sent[0]

    job = JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2)
    monkeypatch.setattr(emit_api, "_distributed", lambda: Dist(0))
    emit.init(job_info=job, rank=0, socket_path=agent.path)
    assert sent == [("job-1", TOKEN, None)]
    monkeypatch.setattr(emit_api, "_distributed", lambda: Dist(1))
    emit.init(job_info=job, rank=1, dp_rank=1, gpu_index=1, socket_path=agent.path)
    ranks = [validate(RegisterRank, r.payload) for r in agent.requests
             if r.kind is Kind.REGISTER_RANK]
    assert [(r.rank_info.rank, r.job_id, r.join_token) for r in ranks] == [
        (0, "job-1", TOKEN), (1, "job-1", TOKEN)]


def test_other_ranks_run_unregistered_when_rank_0_could_not_register(
    agent: FakeAgent, monkeypatch, caplog
) -> None:
    """Rank 0's agent did not answer: it broadcasts no id; the others warn and run on (they
    raised "needs the job id", which sent users looking for a job id they could not have)."""

    class Dist:
        def broadcast_object_list(self, box: list[Any], src: int) -> None:
            box[0] = (None, None, None)

    job = JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2)
    monkeypatch.setattr(emit_api, "_distributed", lambda: Dist())
    with caplog.at_level(logging.WARNING, logger="zeus_agent.emit"):
        pub = emit.init(job_info=job, rank=1, dp_rank=1, gpu_index=1, socket_path=agent.path)
    assert pub.job_id is None and agent.requests == []
    assert "rank 0 could not register the job" in caplog.text


def test_init_other_rank_without_job_id_is_an_error(agent: FakeAgent) -> None:
    job = JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2)
    with pytest.raises(ValueError, match="rank 1 needs the job id"):
        emit.init(job_info=job, rank=1, socket_path=agent.path)


@pytest.mark.parametrize("refused", [Kind.REGISTER_JOB, Kind.HELLO, Kind.REGISTER_RANK])
def test_refusal_raises_at_init(sock_path: str, refused: Kind) -> None:
    def handler(req: RequestDatagram) -> Reply | None:
        if req.kind is refused:
            return Reply.failure("bad_request", "world_size does not match")
        return default_handler(req)

    fake = FakeAgent(sock_path, handler)
    try:
        job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
        with pytest.raises(emit.RegistrationError, match="world_size does not match") as info:
            emit.init(job_info=job, socket_path=sock_path)
        assert info.value.code == "bad_request"
        assert isinstance(info.value, emit.ZeusAgentError)
    finally:
        fake.stop()


def test_init_without_agent_warns_and_detaches(sock_path: str, caplog) -> None:
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with caplog.at_level(logging.WARNING, logger="zeus_agent.emit"):
        pub = emit.init(job_info=job, socket_path=sock_path)
    text = caplog.text
    assert "zeus-agent run --backend sim" in text and sock_path in text
    assert text.count("cannot reach the node agent") == 1
    assert pub.detached and pub.job_id is None
    emit.step_begin()
    assert emit.stats().dropped == 1


def test_init_silent_agent_times_out_and_detaches(sock_path: str, caplog) -> None:
    fake = FakeAgent(sock_path, lambda r: None)
    try:
        job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="zeus_agent.emit"):
            pub = emit.init(job_info=job, socket_path=sock_path, timeout_s=0.1)
        assert time.monotonic() - start < 1.0
        assert pub.detached and "no reply within" in caplog.text
    finally:
        fake.stop()


# ----------------------------------------------------------------------------- GPU indices
def test_cuda_visible_devices_mapping(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    pub = emit.init(job_id="j", join_token=TOKEN, socket_path=agent.path)
    assert (pub.gpu_index, pub.physical_gpu_index) == (1, 5)
    hello = validate(TrainerHello, agent.requests[0].payload)
    assert hello.gpu_index == 5
    pub.push_window()
    pub.pop_window()
    window = validate(WindowRequest, agent.wait_requests(Kind.WINDOW)[0].payload)
    assert window.gpus == [5]


def test_physical_gpu_index() -> None:
    assert emit.physical_gpu_index(2, {}) == 2
    assert emit.physical_gpu_index(1, {"CUDA_VISIBLE_DEVICES": "6, 7"}) == 7
    assert emit.physical_gpu_index(1, {"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == 1
    with pytest.raises(ValueError, match="not visible"):
        emit.physical_gpu_index(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError):
        emit.physical_gpu_index(-1, {})
