"""Shell-test fixtures: `nc` unsubscribes the tests' inboxes before it drains; untimed GPUs.

The agent's settings default to the `h200` NVML timing model (a counter read costs ~3 ms);
shell tests exercise the agent's logic and default to the free simulator
(ZEUS_AGENT_SIM_NVML_TIMING=none); a test that wants the costs passes
`sim_nvml_timing="h200"`, which wins over the environment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.shell.agent_kit import Inbox
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
