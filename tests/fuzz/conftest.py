"""Fuzz fixtures: `bus`, the module's agent and coordinator on one nats-server (fuzz_kit.py
has the rest: what every example is held to, and the malformed-payload strategies)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fuzz.fuzz_kit import CLOCKS, Bus, LogTrap, LoopThread, audit_gpus
from tests.shell.agent_kit import running_agent
from tests.shell.coordinator_kit import start as start_coordinator
from tests.shell.coordinator_kit import stop as stop_coordinator
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect


@pytest.fixture(scope="module")
def bus(nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    """The module's agent (2 simulated A40s) and coordinator on one nats-server."""
    loop = LoopThread()
    trap = LogTrap()
    logging.getLogger().addHandler(trap)
    stack = contextlib.AsyncExitStack()
    violations: list[str] = []
    stray: list[str] = []
    state_dir = tmp_path_factory.mktemp("coord")

    async def up() -> Bus:
        agent = await stack.enter_async_context(
            running_agent(
                nats_server.url, sim_count=2, metrics_port=0, metrics_host="127.0.0.1",
                request_timeout_s=2.0,
            )
        )  # fmt: skip
        audit_gpus(agent, violations)
        coord, task = await start_coordinator(nats_server, state_dir)
        stack.push_async_callback(stop_coordinator, coord, task)
        nc = await connect(nats_server.url, "fuzz-client")
        stack.push_async_callback(nc.close)

        async def on_stray(msg: Any) -> None:
            if (msg.headers or {}).get("Status") == "503":
                return  # NATS's "no responders": nobody follows that subject (no job's owner).
            stray.append(f"{msg.subject}: {bytes(msg.data)[:200]!r}")

        await nc.subscribe("_INBOX.fuzzstray.>", cb=on_stray)
        await confirm_subscriptions(nc)
        return Bus(loop, agent, coord, nc, trap, violations, stray, state_dir)

    try:
        the_bus = loop.run(up(), 60)
        for agent in the_bus.agent.agents.values():  # the strategies assume an A40
            assert agent.info is not None
            assert (agent.info.min_power_limit_w, agent.info.max_power_limit_w) == (100, 300)
            assert tuple(agent.info.supported_graphics_clocks_mhz) == CLOCKS
        yield the_bus
    finally:
        with contextlib.suppress(Exception):
            loop.run(stack.aclose(), 60)
        loop.close()
        logging.getLogger().removeHandler(trap)
