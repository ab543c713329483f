"""Shell-test fixtures: `nc` unsubscribes the tests' inboxes before it drains."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.shell.agent_kit import Inbox
from zeus_agent.broker import EmbeddedNats, connect


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    """A client connection to the module's nats-server, drained after the test."""
    conn = await connect(nats_server.url, "test-client")
    yield conn
    await Inbox.close_all()
    await conn.drain()
