"""`AgentServer`: the node agent process (config in, `run()` -> startup / main loop / shutdown).

Startup: open the status server (with `--metrics-port`) and bind the trainers' socket (a bad
path or port fails before anything slow), start an embedded nats-server if asked, connect, open
the GPUs (nvml or sim), start one `GpuAgent` per GPU, find the CPU packages' RAPL counters
(`RaplReader`; a node without readable ones says so once), listen for the lease renewals of
the holders of its GPUs' leases (`RenewalSubscriptions`: a renewal reaches its job's nodes
only), serve each GPU's commands as a `nats.micro` endpoint (discoverable through
`$SRV.PING/INFO/STATS`), open the doorbells, start reading the trainers' socket, and announce
the node. One `asyncio.TaskGroup` owns the loops (sampling, publishing, heartbeat, lease
expiry, trainer reaping, event measurement, RAPL reading).

Shutdown (aiohttp's order): the loops are cancelled, then everything start-up acquired is
released in the reverse order (`zeus_agent.aio.Releases`, each pushed where it is acquired):
stop intake (the trainers' socket, the doorbells, the command endpoints), restore every GPU
setting the agent changed and publish what is pending, drain NATS, stop the embedded server,
remove the socket's file, close the status server (opened first: `/healthz` says "stopping"
throughout). One release failing skips no other. The first SIGINT/SIGTERM starts it; a second
one skips the graceful waits (GPUs are still restored).

Never deaf: nats-py reconnects a lost connection forever, but a connection the *server* closed
with an error (an authorization violation, a protocol error) stays closed. The agent then
restores its GPUs and exits with `EXIT_BUS_LOST` (4), so its supervisor (systemd
`Restart=on-failure`, a Kubernetes DaemonSet) starts a fresh one, which connects anew, resets
the GPUs and announces itself; trainers re-introduce themselves (`zeus_agent.emit` re-sends
HELLO when the socket comes back).

Health: with `--metrics-port`, `GET /healthz` answers 200 `{"ok": true, "status": "ok", ...}`
while the agent is connected and its event loop turns, else 503 with the status
("starting", "disconnected" since when, "closed", "stalled", "stopping") and a reason
(`zeus_agent.status_http`; the connection's part is `zeus_agent.bus.BusHealth`'s, as the
coordinator's); `layout` says whether batches go out in columns now ("columns": those of the
jobs whose owners are heard reading them, the others' in rows; "rows": every job's) or rows
(`--measurement-columns`, `zeus_agent.agent.core.formats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import stat
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from zeus_agent import __version__, status_http
from zeus_agent.agent import recording
from zeus_agent.agent.commands import answer, handle_command
from zeus_agent.agent.core.formats import ColumnsChoice
from zeus_agent.agent.credentials import pass_credentials
from zeus_agent.agent.doorbell import doorbell_path
from zeus_agent.agent.gateway import Gateway
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.node_batch import NodeMeasurements
from zeus_agent.agent.node_commands import node_handler
from zeus_agent.agent.rapl import RaplReader
from zeus_agent.agent.renewals import RenewalSubscriptions
from zeus_agent.aio import ExitSignals, Releases, every
from zeus_agent.broker import (
    EmbeddedNats,
    confirm_subscriptions,
    connect,
    drain,
    refused_publish,
)
from zeus_agent.bus import BusHealth
from zeus_agent.cli_kit import BUS_LOST
from zeus_agent.config import AgentSettings
from zeus_agent.errors import GPUUnavailableError, PayloadError, ZeusAgentError, reply_for
from zeus_agent.gpu.base import GPU
from zeus_agent.gpu.observe_only import OBSERVE_ONLY_HELP
from zeus_agent.history import History
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.formats import reads_columns
from zeus_agent.wire.messages import AgentHello, LeaseRenewal
from zeus_agent.wire.node_power import NodePower
from zeus_agent.wire.text import bounded

LOG = logging.getLogger(__name__)

EXIT_BUS_LOST = BUS_LOST
"""Exit code (4) when the NATS server closed the agent's connection for good (GPUs restored)."""
STALL_S = 10.0
"""`/healthz` reports the agent unhealthy when its event loop has not turned for this long."""


def open_gpus(settings: AgentSettings) -> list[GPU]:
    """Open the GPUs the settings select, with the configured backend."""
    if settings.backend == "sim":
        from zeus_agent.gpu.sim import SimGPU

        indices = settings.gpus if settings.gpus is not None else list(range(settings.sim_count))
        timing, set_ms = settings.sim_nvml_timing, settings.sim_set_latency_ms
        if settings.sim_attach:  # the counter's update model is the file's creator's
            return [SimGPU.open(settings.sim_state_dir, i, timing=timing, set_latency_ms=set_ms)
                    for i in indices]
        return [
            SimGPU.create(settings.sim_state_dir, i, preset=settings.sim_preset,
                          energy_update_ms=settings.sim_energy_update_ms, timing=timing,
                          set_latency_ms=set_ms)
            for i in indices
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
        self.formats = ColumnsChoice(settings.measurement_columns)
        """Whether batches go out in columns: the coordinators' renewals say if they read them."""
        self.measurements = NodeMeasurements(
            settings.node, settings.prefix, self.publish, settings.measurement_flush_s,
            lambda job_id: self.formats.columns(time.monotonic(), job_id))
        """The node's marks and measurements, all its GPUs' in one batch per job per flush."""
        self.rapl = RaplReader(settings.rapl_root, settings.rapl_period_s, settings.ring_seconds)
        """The node's CPU package and DRAM energy counters (opened at startup)."""
        self._announcing: set[asyncio.Future[None]] = set()
        self.gateway: Gateway | None = None
        self.nc: Any = None
        self._service: Any = None
        self._subs: list[Any] = []
        self.renewals = RenewalSubscriptions(settings.prefix, self.agents, self._on_lease_renewal)
        """The lease renewal subjects followed: one per holder of a lease here."""
        self._socket_inode = -1  # the inode this agent bound (it removes only that one)
        self._socket_gid: int | None = None
        self._status_server: status_http.StatusServer | None = None
        self.metrics_port: int | None = None
        """Port of /metrics and /healthz once started (with `metrics_port=0`: any free port)."""
        self.bus = BusHealth("agent", self, on_reconnect=self.announce,
                             before_exit="restoring the GPUs and ")
        """The NATS connection's state (`/healthz`); the exit when the server closed it."""
        self._releases = Releases(LOG)
        """What start-up acquired, released in the reverse order at shutdown."""
        self._stopping = False
        self._send_node_power = True  # (False once NATS refused them: `_publish_samples`)
        self._tick = time.monotonic()
        self.counters: Counter[str] = Counter()
        """Bus messages dropped, by reason (`zeus_agent_bus_messages_dropped_total`)."""
        self.history = (History(settings.history, f"agent:{settings.node}")
                        if settings.history else None)
        """Where commands, renewals and restores are recorded (`--history`), if anywhere."""

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

    @property
    def exit_code(self) -> int:
        """What the process should exit with: 0, or `EXIT_BUS_LOST` (GPUs restored)."""
        return self.bus.exit_code

    @property
    def bus_state(self) -> tuple[str, float, str]:
        """(state, since (Unix time), reason) of the NATS connection (`BusHealth.state`)."""
        return self.bus.state

    async def startup(self) -> None:
        """Open the status server and the trainers' socket, connect, open GPUs, start agents.

        Each resource is pushed on `_releases` as it is acquired: `shutdown` releases what a
        start-up that failed half-way acquired, in the reverse order.
        """
        s, release = self.settings, self._releases.push
        if s.metrics_port is not None:
            self._start_status_server(s.metrics_port)
            release("the status server", self._close_status_server)
        sock = self._bind_socket()
        release("the trainers' socket", lambda: self._remove_socket(sock))
        await self._connect()
        # Restored, flushed and closed together, whichever started: one hung GPU delays no other.
        release("the GPUs", self._release_gpus)
        await self._start_agents()
        self.rapl.open()
        self.renewals.nc = self.nc
        await self.renewals.sync()  # (Leases an agent restarted with.)
        ping = subjects.agent_ping(s.prefix)
        self._subs.append(await self.nc.subscribe(ping, cb=self._on_ping))
        release("the command endpoints", self._stop_commands)
        await self._serve_commands()
        release("the doorbells", self._close_doorbells)
        release("the gateway", self._close_gateway)
        self._open_gateway(sock)
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

    async def _connect(self) -> None:
        """Start the embedded nats-server if asked, and connect (both pushed on `_releases`)."""
        s = self.settings
        embedded_url = None
        if s.embedded_nats:
            embedded = await asyncio.to_thread(EmbeddedNats().start)
            self._releases.push("the embedded nats-server",
                                lambda: asyncio.to_thread(embedded.stop))
            embedded_url = embedded.url
            LOG.info("embedded nats-server at %s", embedded_url)
        self.nc = await connect(
            s.bus_url(embedded_url),
            f"zeus-agent:{s.node}",
            timeout_s=s.connect_timeout_s,
            inbox_prefix=subjects.inbox_prefix("node", s.node, s.prefix),
            on_disconnect=self.bus.on_disconnect,
            on_reconnect=self.bus.on_reconnect,
            on_closed=self.bus.on_closed,
            **s.nats_options(),
        )
        nc = self.nc
        self._releases.push("the NATS connection",
                            lambda: drain(nc, forced=self.force_exit.is_set()))
        self.bus.connected(nc)

    async def _start_agents(self) -> None:
        """Open the GPUs and start one `GpuAgent` each (those started are in `agents`)."""
        s = self.settings
        gpus = self._gpus if self._gpus is not None else await asyncio.to_thread(open_gpus, s)
        on_restored = (None if self.history is None
                       else functools.partial(recording.record_restore, self.history))
        for gpu in gpus:
            agent = GpuAgent(gpu, s.node, self.publish, s.prefix, s.sample_hz, s.ring_seconds,
                             s.default_lease_s, s.fence_skew_s, on_restored=on_restored,
                             on_control_lost=self._announce_soon, measurements=self.measurements)
            if s.observe_only:
                agent.observe_only(OBSERVE_ONLY_HELP)
            await agent.start(reset=s.reset_on_start)
            self.agents[agent.index] = agent
        if s.observe_only:
            LOG.info("observe-only: no GPU setting is ever changed by this agent")

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
                handler=self._command_handler(agent, self.history, self.renewals.sync),
                queue_group=f"agent-{self.settings.node}",
            )
        await self._service.add_endpoint(
            name="node",
            subject=subjects.node_command(self.settings.node, self.settings.prefix),
            handler=node_handler(self.settings.node, self.agents, self.history,
                                 self.renewals.sync),
            queue_group=f"agent-{self.settings.node}",
        )

    @staticmethod
    def _command_handler(
        agent: GpuAgent, history: History | None = None,
        before_reply: Callable[[], Awaitable[None]] | None = None,
    ) -> Callable[[Any], Awaitable[None]]:
        """The endpoint of one GPU: nothing that goes wrong with one command leaves it.

        `before_reply` runs after the command, before its answer (the lease renewals' subjects
        follow the leases the command granted or released).
        """

        async def handler(req: Any) -> None:
            try:
                reply = await handle_command(agent, req.data, req.headers)
                data = codec.encode(reply)
                if history is not None:
                    recording.record_command(history, agent, recording.decoded(req.data),
                                             req.headers, reply)
            except Exception as e:  # noqa: BLE001 - handle_command should not raise; never go silent
                LOG.exception("GPU %d: command handling failed", agent.index)
                data = codec.encode(reply_for(
                    e, f"internal error in the agent of GPU {agent.index}; see its log"))
            await answer(req, data, before_reply, f"GPU {agent.index}", "a command")

        return handler

    def _bind_socket(self) -> socket.socket:
        """Create and bind the trainers' socket (before anything else, so a bad path fails fast).

        Raises:
            ZeusAgentError: The directory cannot be created, the path cannot be bound, or the
                group does not exist; one line saying which path and what to do.
        """
        path = Path(self.settings.socket_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ZeusAgentError(
                f"cannot create the socket directory {path.parent}: a file is in the way; "
                "remove it or choose another --socket-path"
            ) from None
        except OSError as e:
            raise ZeusAgentError(
                f"cannot create the socket directory {path.parent}: {e.strerror or e}; "
                "choose another --socket-path"
            ) from None
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
            # Before bind: a datagram queued before the gateway attaches must carry its
            # sender's credentials too (a trainer re-introducing itself to a restarted agent).
            pass_credentials(sock)
            sock.bind(str(path))
            self._socket_inode = os.stat(path).st_ino
            os.chmod(path, int(self.settings.socket_mode, 8))
            if self.settings.socket_group is not None:
                import grp

                try:
                    gid = grp.getgrnam(self.settings.socket_group).gr_gid
                except KeyError:
                    raise ZeusAgentError(
                        f"socket group {self.settings.socket_group!r} does not exist on this "
                        "node; create it or pass another --socket-group"
                    ) from None
                os.chown(path, -1, gid)
                self._socket_gid = gid
        except OSError as e:
            sock.close()
            raise ZeusAgentError(
                f"cannot open the trainers' socket at {path}: {e.strerror or e}; "
                "choose another --socket-path"
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _open_gateway(self, sock: socket.socket) -> None:
        """Open the GPUs' doorbells and start reading the trainers' socket."""
        gateway = Gateway(
            self.agents,
            self.settings.node,
            self.settings.prefix,
            self.request,
            self.publish,
            self.settings.request_timeout_s,
            on_bind=self.announce,
            rapl=self.rapl,
            rank_columns=lambda: self.formats.try_columns(time.monotonic()),
        )
        self.gateway = gateway
        s = self.settings
        if not s.observe_only:  # (observe-only: no clock is ever locked)
            for agent in self.agents.values():
                agent.open_doorbell(doorbell_path(s.socket_path, agent.index),
                                    gateway.received_all, int(s.socket_mode, 8), self._socket_gid,
                                    s.doorbell_spin_us)
        gateway.attach(sock)

    def _start_status_server(self, port: int) -> None:
        from zeus_agent.agent.metrics import make_registry

        registry = make_registry(
            self.agents,
            lambda: dict(self.gateway.counters) if self.gateway else {},
            lambda: dict(self.counters),
            lambda: self.bus.is_connected,
            rapl=self.rapl,
            node=self.settings.node,
        )
        host = self.settings.metrics_host
        try:
            self._status_server = status_http.start(host, port, self.health, registry=registry)
        except ZeusAgentError as e:
            raise ZeusAgentError(f"{e} (--metrics-port, --metrics-host)") from None
        self.metrics_port = self._status_server.port
        LOG.info("metrics at http://%s:%d/metrics, health at /healthz", host, self.metrics_port)

    # ------------------------------------------------------------------ health
    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, detail) for `/healthz`; called on the status server's thread."""
        detail: dict[str, Any] = {
            "node": self.settings.node,
            "agent_id": self.agent_id,
            "gpus": len(self.agents),
            "nats": self.bus.report(),
            "layout": "columns" if self.formats.columns(time.monotonic()) else "rows",
        }
        stalled_s = time.monotonic() - self._tick
        if self._stopping and self.bus.state[0] != "closed":
            return False, {"status": "stopping", "reason": "the agent is shutting down", **detail}
        problem = self.bus.problem()
        if problem is not None:
            return False, {"status": problem[0], "reason": problem[1], **detail}
        if not self.started.is_set():
            return False, {"status": "starting", "reason": "the agent is starting", **detail}
        if stalled_s > STALL_S:
            return False, {
                "status": "stalled",
                "reason": f"the agent's event loop has not turned for {stalled_s:.1f} s",
                **detail,
            }
        return True, {"status": "ok", **detail}

    async def announce(self) -> None:
        """Publish the node's GPUs (also the heartbeat)."""
        hello = AgentHello(
            node=self.settings.node,
            agent_id=self.agent_id,
            backend=self.settings.backend,
            heartbeat_s=self.settings.heartbeat_s,
            socket_path=self.settings.socket_path,
            gpus=[await a.describe() for a in self.agents.values()],
            labels=dict(label.split("=", 1) for label in self.settings.labels),
        )
        await self.publish(
            subjects.agent_hello(self.settings.node, self.settings.prefix), codec.encode(hello)
        )

    def _announce_soon(self) -> None:
        """A GPU can no longer be controlled (NVML: NO_PERMISSION): say so now.

        Not at the next heartbeat; the start-up announcement carries it when it happens before.
        """
        if self.nc is None or not self.started.is_set():
            return
        task = asyncio.ensure_future(self._announce_quietly())
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    async def _announce_quietly(self) -> None:
        try:
            await self.announce()
        except Exception as e:  # noqa: BLE001 - the heartbeat says it again
            LOG.warning("could not announce: %s", bounded(e, 300))

    async def _on_ping(self, msg: Any) -> None:
        await self.announce()

    async def _on_lease_renewal(self, msg: Any) -> None:
        try:
            renewal = codec.decode(msg.data, LeaseRenewal)
            self.formats.heard(reads_columns(msg.headers), renewal.lease_s, time.monotonic(),
                               renewal.holder)
            for agent in self.agents.values():
                renewed = agent.renew_leases(renewal.holder, renewal.lease_s)
                if self.history is not None:
                    recording.record_renewal(self.history, agent, renewal.holder, renewed)
        except PayloadError as e:
            # Counted always; logged the first time and every 1000th (the subject and the
            # error are a peer's to choose: one WARNING line each would be a log flood).
            self.counters["bad_lease_renewal"] += 1
            n = self.counters["bad_lease_renewal"]
            if n == 1 or n % 1000 == 0:
                LOG.warning("ignored a bad lease renewal on %s (%d so far): %s",
                            bounded(msg.subject, 300), n, e)

    # ------------------------------------------------------------------ loops
    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        s = self.settings
        loops = [
            every(1.0 / s.sample_hz, self._sample_all, "sampling"),
            every(s.publish_interval_s, self._publish_samples, "publishing"),
            every(s.heartbeat_s, self.announce, "heartbeat"),
            every(0.1, self._expire_leases, "lease expiry"),
            every(1.0, self._heartbeat_tick, "liveness"),
            every(0.5, self._reap, "trainer reaping"),
        ]
        loops += [a.process_events() for a in self.agents.values()]
        if self.rapl.available:
            loops.append(every(s.rapl_period_s, self._read_rapl, "RAPL reading"))
        return loops

    async def _read_rapl(self) -> None:
        self.rapl.poll()  # A few sysfs reads of microseconds each: on the loop.

    async def _sample_all(self) -> None:
        await asyncio.gather(*(a.sample() for a in self.agents.values()))

    async def _publish_samples(self) -> None:
        """Each GPU's samples, then the node's latest power draws in one `NodePower`."""
        latest = [(a.index, await a.flush_samples()) for a in self.agents.values()]
        readings = [(index, s.power_w) for index, s in latest if s is not None]
        subject = subjects.agent_power(self.settings.node, self.settings.prefix)
        if self._send_node_power and self.nc is not None and refused_publish(self.nc, subject):
            self._send_node_power = False  # (Coordinators then follow the per-GPU samples.)
            LOG.warning("the NATS server refuses this agent's power readings on %s: its "
                        "permissions predate them (rerun `zeus-coordinator nats-auth` and "
                        "reload nats-server); sending per-GPU samples only", subject)
        if readings and self._send_node_power:
            power = NodePower(node=self.settings.node, gpus=[i for i, _ in readings],
                              power_w=[w for _, w in readings])
            await self.publish(subject, codec.encode(power))

    async def _expire_leases(self) -> None:
        self._tick = time.monotonic()
        # Side by side: a hung GPU (each call waits out its timeout) delays no other GPU's.
        await asyncio.gather(*(a.expire_leases() for a in self.agents.values()))
        await self.renewals.sync()

    async def _heartbeat_tick(self) -> None:
        self._tick = time.monotonic()

    async def _reap(self) -> None:
        if self.gateway is not None:
            await self.gateway.reap_dead_trainers()

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        """Release what start-up acquired, in the reverse order (see the module docstring)."""
        LOG.info("agent shutting down%s", " (forced)" if self.force_exit.is_set() else "")
        self._stopping = True
        await self._releases.aclose()
        LOG.info("agent stopped")

    def _close_gateway(self) -> None:
        """Stop reading the trainers' socket (closing it) and cancel the requests in flight."""
        if self.gateway is not None:
            self.gateway.close()
            self.gateway.close_tasks()

    async def _stop_commands(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._service.stop(), 2)

    def _close_doorbells(self) -> None:
        """Wake every doorbell at once, then wait for each (1 s in all)."""
        for agent in self.agents.values():
            if agent.doorbell is not None:
                agent.doorbell.stop()
        deadline = time.monotonic() + 1.0
        for agent in self.agents.values():
            agent.close_doorbell(max(0.0, deadline - time.monotonic()))

    async def _release_gpus(self) -> None:
        """Restore every GPU (side by side), publish what is pending unless forced, close."""

        async def restore(agent: GpuAgent) -> None:
            try:
                await agent.drop_node_cap()
                await agent.restore(reason="agent shutting down")
            except Exception:  # noqa: BLE001 - restore the others anyway
                LOG.exception("GPU %d: restore at shutdown failed", agent.index)

        await asyncio.gather(*(restore(a) for a in self.agents.values()))
        try:
            if not self.force_exit.is_set():
                for agent in self.agents.values():
                    await agent.measurer.flush()  # (Its marks and measurements: to the node's.)
                await self.measurements.flush()
                for agent in self.agents.values():
                    await agent.flush_samples()
        finally:
            for agent in self.agents.values():
                agent.caller.close()

    def _remove_socket(self, sock: socket.socket) -> None:
        """Close the trainers' socket and remove its file, unless a newer agent's is there."""
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            path = Path(self.settings.socket_path)
            if os.stat(path).st_ino == self._socket_inode:
                path.unlink()

    async def _close_status_server(self) -> None:
        if self._status_server is not None:
            await asyncio.to_thread(self._status_server.close)


class _Stop(Exception):
    """Raised inside the TaskGroup to cancel every loop at once."""


def _remove_stale_socket(path: Path) -> None:
    """Make way for the trainers' socket: remove a socket nobody serves, and nothing else.

    Raises:
        ZeusAgentError: The path is a directory or a file that is not a socket (never deleted),
            or another agent serves the socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a file that is not a socket"
        raise ZeusAgentError(
            f"the socket path {path} is {what}; it is left alone: choose another --socket-path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: its agent is gone
    except OSError as e:
        raise ZeusAgentError(f"cannot check the socket {path}: {e.strerror or e}") from None
    else:
        raise ZeusAgentError(
            f"another agent serves {path}; stop it first or choose another --socket-path"
        )
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
