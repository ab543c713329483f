"""`AgentServer`: the node agent process (config in, `run()` -> startup / main loop / shutdown).

Startup: start an embedded nats-server if asked, connect, open the GPUs (nvml or sim), start
one `GpuAgent` per GPU, serve each GPU's commands as a `nats.micro` endpoint (discoverable
through `$SRV.PING/INFO/STATS`), listen for lease renewals, open the trainers' socket, and
announce the node. One `asyncio.TaskGroup` owns the loops (sampling, publishing, heartbeat,
lease expiry, trainer reaping, event measurement).

Shutdown order (aiohttp's): stop intake (socket, endpoints), cancel the loops, restore every
GPU setting the agent changed, publish what is pending, drain NATS, stop the embedded server.
The first SIGINT/SIGTERM starts it; a second one skips the graceful waits (GPUs are still
restored).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from zeus_agent import __version__
from zeus_agent.agent.commands import handle_command
from zeus_agent.agent.gateway import Gateway
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.aio import ExitSignals, every
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.config import AgentSettings
from zeus_agent.errors import BrokerError, GPUUnavailableError, PayloadError, ZeusAgentError
from zeus_agent.gpu.base import GPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import AgentHello, LeaseRenewal

LOG = logging.getLogger(__name__)


def open_gpus(settings: AgentSettings) -> list[GPU]:
    """Open the GPUs the settings select, with the configured backend."""
    if settings.backend == "sim":
        from zeus_agent.gpu.sim import SimGPU

        indices = settings.gpus if settings.gpus is not None else list(range(settings.sim_count))
        if settings.sim_attach:
            return [SimGPU.open(settings.sim_state_dir, i) for i in indices]
        return [
            SimGPU.create(settings.sim_state_dir, i, preset=settings.sim_preset) for i in indices
        ]
    from zeus_agent.gpu.nvml import nvml_gpus

    try:
        return list(nvml_gpus(settings.gpus))
    except GPUUnavailableError as e:
        raise GPUUnavailableError(
            f"{str(e).rstrip('.')}. No NVIDIA driver on this host? To try the system without "
            "GPUs, run the agent with --backend sim."
        ) from e


class AgentServer(ExitSignals):
    """One node agent. `await serve()` runs until `should_exit` is set (signals set it)."""

    def __init__(self, settings: AgentSettings, gpus: list[GPU] | None = None) -> None:
        self.settings = settings
        self._gpus = gpus
        self.agent_id = uuid.uuid4().hex[:12]
        super().__init__()
        self.started = asyncio.Event()
        self.agents: dict[int, GpuAgent] = {}
        self.gateway: Gateway | None = None
        self.nc: Any = None
        self._embedded: EmbeddedNats | None = None
        self._service: Any = None
        self._subs: list[Any] = []
        self._transport: asyncio.DatagramTransport | None = None
        self._metrics_server: Any = None
        self.metrics_port: int | None = None
        """Port of /metrics once started (useful with `metrics_port=0`: any free port)."""

    # ------------------------------------------------------------------ bus helpers
    async def publish(self, subject: str, payload: bytes) -> None:
        """Publish, never raising: while NATS is away messages are buffered or dropped."""
        try:
            await self.nc.publish(subject, payload)
        except Exception as e:  # noqa: BLE001 - OutboundBufferLimitError, ConnectionClosedError
            LOG.debug("publish to %s dropped: %s", subject, e)

    async def request(self, subject: str, payload: bytes, timeout_s: float) -> bytes:
        """NATS request returning the reply payload."""
        msg = await self.nc.request(subject, payload, timeout=timeout_s)
        return bytes(msg.data)

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        """Start, run the loops until asked to exit, shut down (always)."""
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()

    async def main_loop(self) -> None:
        """Run every loop in one TaskGroup until `should_exit` is set."""
        try:
            async with asyncio.TaskGroup() as tg:
                for coro in self._loops():
                    tg.create_task(coro)
                self.started.set()
                await self.should_exit.wait()
                raise _Stop
        except* _Stop:
            pass

    async def startup(self) -> None:
        """Connect, open GPUs, start agents, endpoints and the trainers' socket."""
        s = self.settings
        url = s.nats_url
        if s.embedded_nats:
            self._embedded = await asyncio.to_thread(EmbeddedNats().start)
            url = self._embedded.url
            LOG.info("embedded nats-server at %s", url)
        if not url:
            raise BrokerError(
                "no NATS: pass --nats-url URL (or ZEUS_AGENT_NATS_URL), or --embedded-nats"
            )
        self.nc = await connect(url, f"zeus-agent:{s.node}", on_reconnect=self.announce)
        gpus = self._gpus if self._gpus is not None else await asyncio.to_thread(open_gpus, s)
        for gpu in gpus:
            agent = GpuAgent(
                gpu, s.node, self.publish, s.prefix, s.sample_hz, s.ring_seconds, s.default_lease_s
            )
            await agent.start(reset=s.reset_on_start)
            self.agents[agent.index] = agent
        renewals = subjects.all_lease_renewals(s.prefix)
        self._subs.append(await self.nc.subscribe(renewals, cb=self._on_lease_renewal))
        ping = subjects.agent_ping(s.prefix)
        self._subs.append(await self.nc.subscribe(ping, cb=self._on_ping))
        await self._serve_commands()
        await self._open_socket()
        if s.metrics_port is not None:
            self._start_metrics(s.metrics_port)
        # The server has every subscription before anyone hears of us: a command sent right
        # after the announcement (or after `started`) finds its responder.
        await confirm_subscriptions(self.nc)
        await self.announce()
        LOG.info(
            "agent %s on node %s: %d GPU(s) [%s], socket %s",
            self.agent_id,
            s.node,
            len(self.agents),
            ", ".join(f"{a.index}:{a.info.name if a.info else '?'}" for a in self.agents.values()),
            s.socket_path,
        )

    async def _serve_commands(self) -> None:
        from nats import micro

        self._service = await micro.add_service(
            self.nc,
            name="zeus-agent",
            version=__version__,
            description=f"GPU agent of node {self.settings.node}",
            metadata={"node": self.settings.node, "agent_id": self.agent_id},
        )
        for agent in self.agents.values():
            await self._service.add_endpoint(
                name=f"gpu{agent.index}",
                subject=subjects.gpu_command(self.settings.node, agent.index, self.settings.prefix),
                handler=self._command_handler(agent),
                queue_group=f"agent-{self.settings.node}",
            )

    @staticmethod
    def _command_handler(agent: GpuAgent) -> Callable[[Any], Awaitable[None]]:
        async def handler(req: Any) -> None:
            reply = await handle_command(agent, req.data)
            await req.respond(codec.encode(reply))

        return handler

    async def _open_socket(self) -> None:
        path = Path(self.settings.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        sock.bind(str(path))
        os.chmod(path, int(self.settings.socket_mode, 8))
        if self.settings.socket_group is not None:
            import grp

            try:
                gid = grp.getgrnam(self.settings.socket_group).gr_gid
            except KeyError:
                sock.close()
                raise ZeusAgentError(
                    f"socket group {self.settings.socket_group!r} does not exist on this node; "
                    "create it or pass another --socket-group"
                ) from None
            os.chown(path, -1, gid)
        gateway = Gateway(
            self.agents,
            self.settings.node,
            self.settings.prefix,
            self.request,
            self.publish,
            self.settings.request_timeout_s,
        )
        self.gateway = gateway
        reply_socket = sock.dup()
        reply_socket.setblocking(False)
        gateway.reply_socket = reply_socket
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: gateway, sock=sock)
        self._transport = transport

    def _start_metrics(self, port: int) -> None:
        from prometheus_client import start_http_server

        from zeus_agent.agent.metrics import make_registry

        registry = make_registry(
            self.agents, lambda: dict(self.gateway.counters) if self.gateway else {}
        )
        host = self.settings.metrics_host
        self._metrics_server, _ = start_http_server(port, addr=host, registry=registry)
        self.metrics_port = int(self._metrics_server.server_address[1])
        LOG.info("Prometheus metrics at http://%s:%d/metrics", host, self.metrics_port)

    async def announce(self) -> None:
        """Publish the node's GPUs (also the heartbeat)."""
        hello = AgentHello(
            node=self.settings.node,
            agent_id=self.agent_id,
            backend=self.settings.backend,
            heartbeat_s=self.settings.heartbeat_s,
            socket_path=self.settings.socket_path,
            gpus=[await a.describe() for a in self.agents.values()],
        )
        await self.publish(
            subjects.agent_hello(self.settings.node, self.settings.prefix), codec.encode(hello)
        )

    async def _on_ping(self, msg: Any) -> None:
        await self.announce()

    async def _on_lease_renewal(self, msg: Any) -> None:
        try:
            renewal = codec.decode(msg.data, LeaseRenewal)
        except PayloadError as e:
            LOG.warning("ignored a bad lease renewal on %s: %s", msg.subject, e)
            return
        now = time.monotonic_ns()
        for agent in self.agents.values():
            agent.leases.renew(renewal.holder, now, renewal.lease_s)

    # ------------------------------------------------------------------ loops
    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        s = self.settings
        loops = [
            every(1.0 / s.sample_hz, self._sample_all, "sampling"),
            every(s.publish_interval_s, self._publish_samples, "publishing"),
            every(s.heartbeat_s, self.announce, "heartbeat"),
            every(0.1, self._expire_leases, "lease expiry"),
            every(0.5, self._reap, "trainer reaping"),
        ]
        loops += [a.process_events() for a in self.agents.values()]
        return loops

    async def _sample_all(self) -> None:
        await asyncio.gather(*(a.sample() for a in self.agents.values()))

    async def _publish_samples(self) -> None:
        for a in self.agents.values():
            await a.flush_samples()

    async def _expire_leases(self) -> None:
        for a in self.agents.values():
            await a.expire_leases()

    async def _reap(self) -> None:
        if self.gateway is not None:
            await self.gateway.reap_dead_trainers()

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        """Stop intake, restore every GPU, flush, drain NATS, stop the embedded server."""
        LOG.info("agent shutting down%s", " (forced)" if self.force_exit.is_set() else "")
        if self._transport is not None:
            self._transport.close()
            if self.gateway is not None and self.gateway.reply_socket is not None:
                self.gateway.reply_socket.close()
            with contextlib.suppress(FileNotFoundError):
                Path(self.settings.socket_path).unlink()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._service.stop(), 2)
        for agent in self.agents.values():
            try:
                await agent.restore(reason="agent shutting down")
            except Exception:  # noqa: BLE001 - restore the others anyway
                LOG.exception("GPU %d: restore at shutdown failed", agent.index)
        if self.nc is not None and not self.force_exit.is_set():
            for agent in self.agents.values():
                await agent.flush_measurements()
                await agent.flush_samples()
        for agent in self.agents.values():
            agent.caller.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                if self.force_exit.is_set():
                    await self.nc.close()
                else:
                    await asyncio.wait_for(self.nc.drain(), 5)
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)
        LOG.info("agent stopped")


class _Stop(Exception):
    """Raised inside the TaskGroup to cancel every loop at once."""
