"""CPU and DRAM energy on the wire (`WindowRequest.cpus`) and in `ZeusMonitor`, on fake agents."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.emit_kit import FakeAgent, rapl_agent
from zeus_agent import emit
from zeus_agent.errors import PayloadError
from zeus_agent.integrations import ZeusMonitor
from zeus_agent.wire.codec import validate
from zeus_agent.wire.messages import Reply
from zeus_agent.wire.trainer import Kind, RequestDatagram, WindowRequest

pytestmark = pytest.mark.usefixtures("clean_emit")


def no_rapl_agent(req: RequestDatagram) -> Reply | None:
    if req.kind is not Kind.WINDOW:
        return None
    window = validate(WindowRequest, req.payload)
    return Reply.success(energy_j=[1.5 for _ in window.gpus], cpus=[], cpu_energy_j=[],
                         dram_energy_j=[], cpu_error="no RAPL counters on this node")


def exact_agent(req: RequestDatagram) -> Reply | None:
    """An agent that knows `exact` but predates `cpus`."""
    if req.kind is not Kind.WINDOW:
        return None
    if "cpus" in req.payload:
        return Reply.failure("bad_request", "WINDOW: field 'cpus': Extra inputs are not permitted")
    window = validate(WindowRequest, req.payload)
    return Reply.success(energy_j=[2.5 if window.exact else 1.5 for _ in window.gpus])


def first_agent(req: RequestDatagram) -> Reply | None:
    """An agent of protocol 1 as shipped: neither `exact` nor `cpus`."""
    if req.kind is not Kind.WINDOW:
        return None
    for field in ("exact", "cpus"):
        if field in req.payload:
            return Reply.failure("bad_request",
                                 f"WINDOW: field '{field}': Extra inputs are not permitted")
    validate(WindowRequest, req.payload)
    return Reply.success(energy_j=[1.5])


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    agents: list[FakeAgent] = []

    def start(handler) -> FakeAgent:
        agent = FakeAgent(str(tmp_path / f"{handler.__name__}.sock"), handler)
        monkeypatch.setenv(emit.ENV_SOCKET, agent.path)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


def windows(agent: FakeAgent) -> list[dict]:
    return [r.payload for r in agent.requests if r.kind is Kind.WINDOW]


def test_cpus_are_sent_only_when_asked_and_validated() -> None:
    plain = WindowRequest(t0_ns=1, t1_ns=2, gpus=[0]).model_dump(mode="python")
    assert plain == {"t0_ns": 1, "t1_ns": 2, "gpus": [0]}  # byte for byte as before
    assert WindowRequest(t0_ns=1, t1_ns=2, gpus=[0], cpus="all").model_dump()["cpus"] == "all"
    assert validate(WindowRequest, {"t0_ns": 1, "t1_ns": 2, "gpus": [], "cpus": [0, 1]}).cpus == [
        0, 1]
    for bad in ("some", [-1], [1.5], list(range(2000))):
        with pytest.raises(PayloadError, match="cpus"):
            validate(WindowRequest, {"t0_ns": 1, "t1_ns": 2, "gpus": [], "cpus": bad})


def test_measure_window_carries_cpu_and_dram_energy(serve) -> None:
    serve(rapl_agent)
    pub = emit.Publisher(gpu_index=0)
    try:
        w = pub.measure_window(0, 10, cpu_indices="all")
        assert w.gpu_energy == [1.5]
        assert w.cpu_energy == {0: 30.0, 1: 20.0} and w.dram_energy == {0: 4.0}
        assert w.cpu_note == ""
        w = pub.measure_window(0, 10, cpu_indices=[1, 7])
        assert w.cpu_energy == {1: 20.0} and w.dram_energy is None
        assert "not on this node" in w.cpu_note
        w = pub.measure_window(0, 10)
        assert (w.cpu_energy, w.dram_energy, w.cpu_note) == (None, None, "")
        assert pub.measure(0, 10) == [1.5]
    finally:
        pub.close()


@pytest.mark.parametrize("handler", [exact_agent, first_agent])
def test_an_agent_that_predates_cpus_is_asked_again_without_them(serve, handler, caplog) -> None:
    agent = serve(handler)
    pub = emit.Publisher(gpu_index=0)
    try:
        with caplog.at_level(logging.INFO, logger="zeus_agent.emit"):
            w = pub.measure_window(0, 10, exact=True, cpu_indices="all")
            assert w.gpu_energy == [2.5 if handler is exact_agent else 1.5]
            assert w.cpu_energy is None and "predates CPU energy" in w.cpu_note
            pub.measure_window(0, 10, cpu_indices="all")
    finally:
        pub.close()
    sent = [(p.get("cpus"), p.get("exact")) for p in windows(agent)]
    if handler is exact_agent:
        assert sent == [("all", True), (None, True), (None, None)]  # not asked again
    else:
        assert sent[-1] == (None, None) and len(sent) == 4
    assert sum("predates CPU energy" in r.getMessage() for r in caplog.records) == 1


def test_no_agent_is_nan_and_no_cpu_energy(tmp_path: Path) -> None:
    pub = emit.Publisher(socket_path=str(tmp_path / "nobody.sock"), gpu_index=0, timeout_s=0.05)
    try:
        w = pub.measure_window(0, 10, cpu_indices="all")
        assert math.isnan(w.gpu_energy[0]) and w.cpu_energy is None and w.cpu_note
    finally:
        pub.close()


def test_monitor_measures_every_cpu_by_default(serve) -> None:
    agent = serve(rapl_agent)
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("w")
    m = monitor.end_window("w")
    assert m.gpu_energy == {0: 1.5}
    assert m.cpu_energy == {0: 30.0, 1: 20.0}
    assert m.dram_energy == {0: 4.0}  # as Zeus: packages without DRAM are left out
    assert m.total_energy == 1.5  # GPUs only, as Zeus
    assert windows(agent)[-1]["cpus"] == "all"
    monitor.begin_window("c")
    cancelled = monitor.end_window("c", cancel=True)
    assert cancelled.cpu_energy == {0: 0.0, 1: 0.0} and cancelled.dram_energy is None


def test_monitor_honours_cpu_indices(serve) -> None:
    agent = serve(rapl_agent)
    monitor = ZeusMonitor(gpu_indices=[0], cpu_indices=[1])
    monitor.begin_window("w")
    m = monitor.end_window("w")
    assert (m.cpu_energy, m.dram_energy) == ({1: 20.0}, None)
    assert windows(agent)[-1]["cpus"] == [1]
    none = ZeusMonitor(gpu_indices=[0], cpu_indices=[])  # Zeus: CPU measurement off
    none.begin_window("w")
    m = none.end_window("w")
    assert (m.cpu_energy, m.dram_energy) == (None, None)
    assert "cpus" not in windows(agent)[-1]
    none.begin_window("c")
    assert none.end_window("c", cancel=True).cpu_energy == {}  # as Zeus with no CPU


@pytest.mark.parametrize("bad", [[-1], [0, 0]])
def test_monitor_refuses_bad_cpu_indices(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="cpu_indices"):
        ZeusMonitor(gpu_indices=[0], cpu_indices=bad)


def test_monitor_on_a_node_without_rapl_says_so_once(serve, caplog) -> None:
    serve(no_rapl_agent)
    monitor = ZeusMonitor(gpu_indices=[0])
    with caplog.at_level(logging.INFO, logger="zeus_agent.integrations.monitor"):
        for _ in range(3):
            monitor.begin_window("w")
            m = monitor.end_window("w")
            assert (m.cpu_energy, m.dram_energy) == (None, None)
    said = [r for r in caplog.records if "no RAPL counters" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_monitor_warns_once_when_cpus_it_was_given_are_missing(serve, caplog) -> None:
    serve(rapl_agent)
    monitor = ZeusMonitor(gpu_indices=[0], cpu_indices=[0, 7])
    with caplog.at_level(logging.INFO, logger="zeus_agent.integrations.monitor"):
        for _ in range(2):
            monitor.begin_window("w")
            assert monitor.end_window("w").cpu_energy == {0: 30.0}
    said = [r for r in caplog.records if "not on this node" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
