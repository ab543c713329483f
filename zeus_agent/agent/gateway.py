"""`Gateway`: the node's local datagram socket where trainers send events and requests.

A trainer (`zeus_agent.emit`) sends each event as one datagram from its own thread; the
gateway hands it to the `GpuAgent` bound to the trainer's pid at once (so a schedule's next
frequency is applied within microseconds), and relays requests: registrations go to the
coordinator over NATS, profiling windows are answered from the GPUs' energy rings.

Bad datagrams are counted and reported on the node's error subject (rate limited); they never
stop the gateway. Trainers that exit without saying goodbye (SIGKILL included) are noticed by
`reap_dead_trainers`, and their GPUs are restored.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from zeus_agent.agent.core.energy_ring import WindowOutOfRange
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import ErrorEvent, RegisterJob, RegisterRank, Reply
from zeus_agent.wire.trainer import (
    EventDatagram,
    Kind,
    ReplyDatagram,
    RequestDatagram,
    TrainerHello,
    WindowRequest,
    decode_datagram,
    encode_reply,
)

LOG = logging.getLogger(__name__)
Request = Callable[[str, bytes, float], Awaitable[bytes]]
Publish = Callable[[str, bytes], Awaitable[None]]


class Gateway(asyncio.DatagramProtocol):
    """Receives trainer datagrams on the node's Unix socket.

    Args:
        agents: The node's GPU agents by GPU index.
        node: Node name.
        prefix: Subject prefix.
        request: `request(subject, payload, timeout_s) -> reply bytes` over NATS.
        publish: `publish(subject, payload)` over NATS.
        request_timeout_s: Timeout of relayed requests.
    """

    def __init__(
        self,
        agents: dict[int, GpuAgent],
        node: str,
        prefix: str,
        request: Request,
        publish: Publish,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.agents = agents
        self.node = node
        self.prefix = prefix
        self._request = request
        self._publish = publish
        self.request_timeout_s = request_timeout_s
        self.transport: asyncio.DatagramTransport | None = None
        self.reply_socket: socket.socket | None = None
        """A non-blocking handle on the gateway's socket to answer requests with (see `_send`)."""
        self.by_pid: dict[int, list[GpuAgent]] = {}
        self.counters: Counter[str] = Counter()
        self._last_report_ns: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:  # noqa: D102
        self.counters["datagrams"] += 1
        try:
            dg = decode_datagram(data)
        except PayloadError as e:
            self.counters["malformed"] += 1
            self._report(
                "malformed_datagram",
                f"dropped a malformed datagram from {addr or 'an unbound socket'}: {e}",
            )
            return
        if isinstance(dg, EventDatagram):
            agents = self.by_pid.get(dg.pid)
            if not agents:
                self.counters["unbound"] += 1
                self._report(
                    "unbound_trainer",
                    f"dropped events of pid {dg.pid}: it has not said hello (call "
                    "zeus_agent.emit.init(...) before emitting events)",
                )
                return
            for agent in agents:
                agent.on_event(dg)
        elif isinstance(dg, RequestDatagram):
            self._spawn(self._answer(dg, addr))
        elif isinstance(dg, ReplyDatagram):
            self.counters["malformed"] += 1
            self._report("malformed_datagram", "dropped a reply datagram sent to the agent")

    def error_received(self, exc: Exception) -> None:  # noqa: D102
        LOG.warning("gateway socket error: %s", exc)

    # ------------------------------------------------------------------ helpers
    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _report(self, code: str, message: str, **detail: Any) -> None:
        """Publish an error event, at most one per second and code (counters carry totals)."""
        now = time.monotonic_ns()
        last = self._last_report_ns.get(code)
        if last is not None and now - last < 1_000_000_000:
            return
        self._last_report_ns[code] = now
        LOG.warning("%s", message)
        event = ErrorEvent(
            source=f"agent:{self.node}",
            code=code,
            message=message,
            detail={**detail, "counters": dict(self.counters)},
        )
        self._spawn(
            self._publish(subjects.agent_errors(self.node, self.prefix), codec.encode(event))
        )

    def _send(self, addr: Any, request_id: int, reply: Reply) -> None:
        if isinstance(addr, bytes):
            # An autobound (abstract) trainer address. uvloop reports it padded with NULs to
            # the full sun_path and then refuses to send to it; the name has no trailing NUL.
            addr = addr.rstrip(b"\0")
        if not addr or self.transport is None:
            self.counters["unanswerable"] += 1
            return
        data = encode_reply(request_id, reply)
        try:
            if self.reply_socket is not None:
                # Trainers autobind to abstract addresses; uvloop's transport cannot send to
                # those (it pads them to the full sun_path, which names another socket).
                self.reply_socket.sendto(data, addr)
            else:
                self.transport.sendto(data, addr)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            self.counters["reply_failed"] += 1  # the trainer left (e.g. right after its BYE)
            LOG.debug("reply to trainer %r failed: %s", addr, e)
        except (OSError, ValueError) as e:
            self.counters["reply_failed"] += 1
            LOG.warning("reply to trainer %r failed: %s", addr, e)

    async def _answer(self, req: RequestDatagram, addr: Any) -> None:
        try:
            reply = await self._handle(req)
        except PayloadError as e:
            reply = Reply.failure("bad_request", f"{req.kind.name}: {e}")
        except WindowOutOfRange as e:
            reply = Reply.failure("out_of_range", str(e))
        except Exception:  # noqa: BLE001
            LOG.exception("gateway request %s failed", req.kind.name)
            reply = Reply.failure(
                "internal", f"internal error in the agent on {self.node}; see its log"
            )
        self._send(addr, req.request_id, reply)

    def _agent(self, index: int) -> GpuAgent:
        agent = self.agents.get(index)
        if agent is None:
            raise PayloadError(
                f"GPU {index} is not managed by the agent on node {self.node!r} "
                f"(it manages GPUs {sorted(self.agents)})",
                "gpu_index",
            )
        return agent

    async def _handle(self, req: RequestDatagram) -> Reply:
        if req.kind is Kind.HELLO:
            hello = codec.validate(TrainerHello, req.payload)
            agent = self._agent(hello.gpu_index)
            agent.bind(hello.job_id, hello.rank, req.pid)
            bound = self.by_pid.setdefault(req.pid, [])
            if agent not in bound:
                bound.append(agent)
            assert agent.info is not None
            return Reply.success(
                node=self.node,
                gpu_index=agent.index,
                gpu_uuid=agent.info.uuid,
                gpu_name=agent.info.name,
                supported_graphics_clocks_mhz=list(agent.info.supported_graphics_clocks_mhz),
                supported_memory_clocks_mhz=list(agent.info.supported_memory_clocks_mhz),
            )
        if req.kind is Kind.REGISTER_JOB:
            job = codec.validate(RegisterJob, req.payload)
            return await self._relay(subjects.coord_register_job(self.node, self.prefix), codec.encode(job))
        if req.kind is Kind.REGISTER_RANK:
            rank = codec.validate(RegisterRank, req.payload)
            if rank.pid is None:
                rank = rank.model_copy(update={"pid": req.pid})
            return await self._relay(subjects.coord_register_rank(self.node, self.prefix), codec.encode(rank))
        if req.kind is Kind.WINDOW:
            window = codec.validate(WindowRequest, req.payload)
            if window.t1_ns < window.t0_ns:
                raise PayloadError("t1_ns must not precede t0_ns", "t1_ns")
            agents = [self._agent(i) for i in window.gpus]
            await asyncio.gather(*(a.read_energy_now() for a in agents))
            energy = [a.energy_between(window.t0_ns, window.t1_ns) for a in agents]
            return Reply.success(energy_j=energy, time_s=(window.t1_ns - window.t0_ns) / 1e9)
        if req.kind is Kind.BYE:
            restored = await self.release_pid(req.pid, reason="trainer said goodbye", crashed=False)
            return Reply.success(restored=restored)
        raise PayloadError(f"unsupported request kind {req.kind.name}")

    async def _relay(self, subject: str, payload: bytes) -> Reply:
        try:
            raw = await self._request(subject, payload, self.request_timeout_s)
        except Exception as e:  # noqa: BLE001 - nats raises TimeoutError / NoRespondersError
            self.counters["relay_failed"] += 1
            return Reply.failure(
                "unavailable",
                f"no coordinator answered on {subject} within {self.request_timeout_s:g} s "
                f"({type(e).__name__}); is `zeus-coordinator run` connected to this NATS?",
            )
        try:
            return codec.decode(raw, Reply)
        except PayloadError as e:
            return Reply.failure("internal", f"the coordinator sent an unreadable reply: {e}")

    # ------------------------------------------------------------------ trainer lifetimes
    async def release_pid(self, pid: int, reason: str, crashed: bool = True) -> list[str]:
        """Restore and unbind every GPU a trainer process drove.

        A trainer that left without saying goodbye (`crashed`) is reported as an error event;
        one that said goodbye is only logged.
        """
        restored: list[str] = []
        for agent in self.by_pid.pop(pid, []):
            if agent.binding is not None and agent.binding.pid not in (pid, None):
                continue  # another trainer has taken this GPU over since
            restored += [f"gpu{agent.index}:{k}" for k in await agent.restore(reason=reason)]
            if agent.binding is not None and not crashed:
                LOG.info("GPU %d: trainer pid %d (job %s, rank %d) finished; defaults restored",
                         agent.index, pid, agent.binding.job_id, agent.binding.rank)
            elif agent.binding is not None:
                await agent.error_event(
                    "trainer_gone",
                    f"trainer pid {pid} (job {agent.binding.job_id}, rank {agent.binding.rank}) "
                    f"is gone ({reason}); GPU {agent.index} restored to defaults",
                )
            agent.unbind()
        return restored

    async def reap_dead_trainers(self) -> None:
        """Release the GPUs of trainer processes that no longer exist."""
        for pid in list(self.by_pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                await self.release_pid(pid, reason="process exited without goodbye")
            except PermissionError:
                pass  # alive, owned by another user
