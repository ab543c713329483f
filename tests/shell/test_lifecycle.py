"""Start-up and shutdown of both services, and their bus health (issue 35 item 5).

* The agent and the coordinator push each resource on their `Releases` where they acquire it:
  after start-up the pending releases are the start-up read backwards; a failing release, or a
  start-up that failed half-way, still releases the rest (GPUs restored, NATS drained, ports
  and files freed).
* `BusHealth`: the connection's state, `/healthz`'s view of it, the exit after a closed one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from tests.shell.agent_kit import command, running_agent, stop_agent
from zeus_agent.agent.server import AgentServer
from zeus_agent.aio import ExitSignals
from zeus_agent.bus import BusHealth
from zeus_agent.cli_kit import BUS_LOST
from zeus_agent.config import AgentSettings
from zeus_agent.errors import BrokerError
from zeus_agent.wire.messages import SetPowerLimitCmd

# ------------------------------------------------------------------------------ BusHealth


async def test_bus_health_follows_the_connection_and_exits_when_it_is_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    exits = ExitSignals()
    reconnects: list[int] = []

    async def on_reconnect() -> None:
        reconnects.append(1)

    bus = BusHealth("tester", exits, on_reconnect=on_reconnect)
    assert bus.problem() == ("starting", "not connected yet") and not bus.is_connected
    bus.connected(SimpleNamespace(last_error="Authorization Violation"))
    assert bus.is_connected and bus.problem() is None
    assert bus.report()["state"] == "connected"
    assert bus.report()["since"].startswith(time.strftime("%Y-", time.gmtime()))
    await bus.on_disconnect()
    status, reason = bus.problem() or ("", "")
    assert status == "disconnected" and reason.startswith("disconnected from NATS since ")
    await bus.on_reconnect()
    assert bus.is_connected and reconnects == [1] and bus.exit_code == 0
    await bus.on_closed()
    assert bus.problem() == ("closed", "the NATS server closed the connection "
                                       "(Authorization Violation)")
    assert bus.exit_code == BUS_LOST and exits.should_exit.is_set()
    assert "supervisor starts a fresh tester" in caplog.text


# ------------------------------------------------------------------------------ the agent


async def test_the_agent_releases_in_the_reverse_order_of_its_start(nats_server, nc) -> None:
    async with running_agent(nats_server.url, metrics_port=0) as agent:
        assert agent._releases.pending == [
            "the gateway", "the doorbells", "the command endpoints", "the GPUs",
            "the NATS connection", "the trainers' socket", "the status server"]
        await stop_agent(agent)
        assert agent._releases.pending == []
        assert agent.nc.is_closed
        assert not os.path.exists(agent.settings.socket_path)
        assert not _listening(agent.metrics_port)


async def test_a_failing_release_still_restores_the_gpus_and_drains(nats_server, nc,
                                                                    caplog) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        set_pl = SetPowerLimitCmd(power_limit_w=120, holder="h", lease_s=60)
        assert (await command(nc, agent.settings.node, 1, set_pl)).ok
        gateway = agent.gateway
        assert gateway is not None

        def broken() -> None:
            raise RuntimeError("the gateway would not close")

        gateway.close = broken  # type: ignore[method-assign]
        await stop_agent(agent)
        assert "releasing the gateway failed" in caplog.text
        assert [a.gpu.get_power_limit_w() for a in agent.agents.values()] == [300, 300]
        assert agent.nc.is_closed
        assert not os.path.exists(agent.settings.socket_path)


async def test_an_agent_that_cannot_connect_releases_what_it_opened() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="zl-", dir="/tmp"))  # AF_UNIX paths are short
    try:
        settings = AgentSettings(nats_url="nats://127.0.0.1:1", connect_timeout_s=1,
                                 backend="sim", sim_state_dir=str(tmp / "sim"),
                                 socket_path=str(tmp / "agent.sock"), metrics_port=0)
        agent = AgentServer(settings)
        with pytest.raises(BrokerError):
            await agent.serve()
        assert agent._releases.pending == []
        assert not (tmp / "agent.sock").exists()
        assert agent.metrics_port is not None and not _listening(agent.metrics_port)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------ the coordinator


def _coordinator(state_dir: Path, **kw: Any) -> CoordinatorService:
    bucket = "t-" + hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]
    return CoordinatorService(CoordinatorSettings(state_dir=str(state_dir), state_bucket=bucket,
                                                  command_timeout_s=1.0, **kw))


async def test_the_coordinator_releases_in_the_reverse_order_of_its_start(tmp_path) -> None:
    coord = _coordinator(tmp_path / "s", embedded_nats=True, status_port=0)
    try:
        await coord.startup()
        assert coord._releases.pending == [
            "the endpoints and subscriptions", "the jobs' leases", "the state buckets",
            "the NATS connection", "the status server", "the embedded nats-server"]
        embedded = coord._embedded
        assert embedded is not None and embedded.running
        assert coord.bus.is_connected and coord.health()[1]["nats"]["state"] == "connected"
    finally:
        await coord.shutdown()
    assert coord._releases.pending == [] and coord.nc is None and not embedded.running
    assert coord._status_server is None
    await coord.shutdown()  # idempotent


async def test_a_failing_give_up_still_drains_and_stops(nats_server, tmp_path, caplog) -> None:
    coord = _coordinator(tmp_path / "s", nats_url=nats_server.url, status_port=0)
    order: list[str] = []

    async def dies() -> None:
        order.append("give up")
        raise RuntimeError("the state bucket is gone")

    coord.replicas.give_up_jobs = dies  # type: ignore[method-assign]
    await coord.startup()
    nc, port = coord.nc, coord._status_server.port if coord._status_server else 0
    await coord.shutdown()
    assert order == ["give up"] and "releasing the jobs' leases failed" in caplog.text
    assert coord.nc is None and nc.is_closed and not _listening(port)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
