"""Shell-test fixtures: `nc` unsubscribes the tests' inboxes before it drains; untimed GPUs;
`agent` (two simulated A40s on node `NODE`) and `coord` (a coordinator beside it).

The agent's settings default to the `h200` NVML timing model (a counter read costs ~3 ms);
shell tests exercise the agent's logic and default to the free simulator
(ZEUS_AGENT_SIM_NVML_TIMING=none); a test that wants the costs passes
`sim_nvml_timing="h200"`, which wins over the environment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from coordinator.service import CoordinatorService
from tests.shell.agent_kit import Inbox
from tests.shell.coordinator_kit import start, start_agent, stop
from tests.shell.doorbell_kit import OPEN_AGENTS
from zeus_agent.agent.server import AgentServer
from zeus_agent.broker import EmbeddedNats, connect


@pytest.fixture(autouse=True)
def _untimed_sim_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents built from settings in these tests get untimed simulated GPUs by default."""
    monkeypatch.setenv("ZEUS_AGENT_SIM_NVML_TIMING", "none")


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    """A client connection to the module's nats-server, drained after the test."""
    conn = await connect(nats_server.url, "test-client")
    yield conn
    await Inbox.close_all()
    await conn.drain()


@pytest.fixture
async def agent(nats_server, tmp_path_factory) -> AsyncIterator[AgentServer]:
    """One agent with two simulated A40s (100-300 W) on node `NODE`."""
    server, task = await start_agent(nats_server, tmp_path_factory.mktemp("agent"))
    yield server
    server.handle_exit()
    await task


@pytest.fixture
async def coord(nats_server, agent, tmp_path) -> AsyncIterator[CoordinatorService]:
    coord, task = await start(nats_server, tmp_path / "coord")
    yield coord
    await stop(coord, task)


@pytest.fixture
def close_doorbell_agents() -> Iterator[None]:
    """Closes the `GpuAgent`s the doorbell kit made during the test (their doorbells, callers)."""
    yield
    while OPEN_AGENTS:
        agent = OPEN_AGENTS.pop()
        agent.close_doorbell()
        agent.caller.close()
