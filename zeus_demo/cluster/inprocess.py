"""`LocalCluster`: NATS, sim agents and coordinators as services on this process's event loop.

What the demo runs (and the savings bench through it): the embedded `nats-server` (a child
process that dies with this one) or an external NATS, one `AgentServer` per simulated node and
`CoordinatorService`s, each a task on the running loop. `stop()` stops the agents and the
coordinators (intake first), waits for them (cancelling any that outstays `stop_timeout_s`),
then stops the embedded server (`stop_services` and `stop_broker` apart: a client of the
cluster may drain its connection in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from zeus_agent.aio import wait_started
from zeus_agent.wire import subjects

__all__ = ["LocalCluster"]

LOG = logging.getLogger(__name__)


class LocalCluster:
    """Services on the running loop: NATS (embedded, or `nats_url`), agents, coordinators.

    Args:
        nats_url: An external NATS; None starts the embedded nats-server.
        prefix: The subject prefix every service uses.
        log_level: Every service's log level (None: each service's default).
        error: The exception a service that does not start raises (its message says which).
        hint: Appended to the message of a service that did not start in time.
        stop_timeout_s: How long `stop` waits for the services before cancelling them.
    """

    def __init__(self, *, nats_url: str | None = None, prefix: str = subjects.DEFAULT_PREFIX,
                 log_level: str | None = "ERROR", error: type[Exception] = RuntimeError,
                 hint: str = "", stop_timeout_s: float = 15.0) -> None:
        self.nats_url = nats_url
        self.prefix = prefix
        self.log_level = log_level
        self.error = error
        self.hint = hint
        self.stop_timeout_s = stop_timeout_s
        self.embedded: Any = None
        self.url = nats_url or ""
        self.agents: list[tuple[Any, asyncio.Task[None]]] = []
        self.coordinators: list[tuple[Any, asyncio.Task[None]]] = []

    async def start_broker(self) -> str:
        """Start the embedded nats-server unless an external NATS was given; its URL.

        Raises:
            error: The embedded nats-server did not start.
        """
        from zeus_agent.broker import EmbeddedNats
        from zeus_agent.errors import BrokerError

        if self.nats_url:
            self.url = self.nats_url
            return self.url
        try:
            self.embedded = await asyncio.to_thread(EmbeddedNats().start)
        except BrokerError as e:
            raise self.error(f"the embedded nats-server did not start: {e}") from e
        self.url = self.embedded.url
        return self.url

    def add_agent(self, node: str, settings: Mapping[str, Any]) -> Any:
        """Start the agent of simulated node `node` (not waiting for it); its `AgentServer`.

        `settings` are its `AgentSettings` beyond the NATS URL, prefix, node, backend and log
        level (the simulated GPUs' count, preset, state directory, socket path...).
        """
        from zeus_agent.agent.server import AgentServer
        from zeus_agent.config import AgentSettings

        server = AgentServer(AgentSettings.model_validate({
            "nats_url": self.url, "backend": "sim", "node": node, "prefix": self.prefix,
            **self._log_level(), **settings,
        }))
        self.agents.append((server, asyncio.create_task(server.serve())))
        return server

    async def wait_agents(self) -> None:
        """Until every agent started.

        Raises:
            error: One did not start (its exception is the cause).
        """
        for server, task in self.agents:
            await wait_started(server.started, task, f"agent {server.settings.node}", self.error,
                               hint=self.hint)

    def add_coordinator(self, settings: Mapping[str, Any]) -> tuple[Any, asyncio.Task[None]]:
        """Start a coordinator (not waiting for it); its `CoordinatorService` and task.

        `settings` are its `CoordinatorSettings` beyond the NATS URL, prefix and log level.

        Raises:
            error: The settings are refused (pydantic's message names the field).
        """
        from coordinator.config import CoordinatorSettings
        from coordinator.service import CoordinatorService

        try:
            parsed = CoordinatorSettings.model_validate({
                "nats_url": self.url, "prefix": self.prefix, **self._log_level(), **settings,
            })
        except Exception as e:  # noqa: BLE001 - pydantic's message names the field
            raise self.error(f"coordinator settings: {e}") from e
        coord = CoordinatorService(parsed)
        entry = (coord, asyncio.create_task(coord.serve()))
        self.coordinators.append(entry)
        return entry

    async def wait_coordinator(self, coord: Any, task: asyncio.Task[None]) -> None:
        """Until `coord` started.

        Raises:
            error: It did not start (its exception is the cause).
        """
        await wait_started(coord.started, task, "the coordinator", self.error, hint=self.hint)

    async def stop_coordinator(self, coord: Any, task: asyncio.Task[None]) -> None:
        """Stop one coordinator and wait for it (an error it ended with is logged)."""
        coord.should_exit.set()
        await self._wait_stopped([task], "zeus-demo: the coordinator did not stop in time")
        with contextlib.suppress(ValueError):
            self.coordinators.remove((coord, task))

    async def stop_services(self) -> None:
        """Stop the agents and coordinators (intake first) and wait for them."""
        for server, _ in self.agents:
            server.handle_exit()
        for coord, _ in self.coordinators:
            coord.should_exit.set()
        tasks = [t for _, t in self.agents] + [t for _, t in self.coordinators]
        await self._wait_stopped(tasks, "zeus-demo: service did not stop within "
                                        f"{self.stop_timeout_s:g} s")
        self.agents, self.coordinators = [], []

    async def stop_broker(self) -> None:
        """Stop the embedded nats-server (if one was started)."""
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
            self.embedded = None

    async def stop(self) -> None:
        """`stop_services`, then `stop_broker`."""
        try:
            await self.stop_services()
        finally:
            await self.stop_broker()

    def _log_level(self) -> dict[str, str]:
        return {} if self.log_level is None else {"log_level": self.log_level}

    async def _wait_stopped(self, tasks: list[asyncio.Task[None]], why: str) -> None:
        if not tasks:
            return
        done, pending = await asyncio.wait(tasks, timeout=self.stop_timeout_s)
        for t in pending:
            t.cancel(msg=why)
        if pending:
            await asyncio.wait(pending, timeout=5)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                LOG.warning("a service ended with an error: %s", t.exception())
