"""`Gateway`: the node's local datagram socket where trainers send events and requests.

A trainer (`zeus_agent.emit`) sends each event as one datagram from its own thread; the
gateway hands it to the `GpuAgent` bound to the trainer's process at once (so a schedule's next
frequency is applied within microseconds), and relays requests: registrations go to the
coordinator over NATS, profiling windows are answered from the GPUs' energy rings.

Who sent a datagram is the kernel's word, never the payload's: the socket has `SO_PASSCRED`
set and every datagram is read with `recvmsg`, which hands over the sender's pid and uid
(`SCM_CREDENTIALS`). The pid field of the datagram format is kept (old emitters still work)
and ignored. So a trainer can only bind, drive, register and release GPUs as itself: a BYE
releases the GPUs bound to the sender's own process, events are attributed to the sender's own
binding, and a REGISTER_RANK is relayed only for a GPU of this node that the sender said HELLO
for. A datagram without credentials, or with pid 0 (a sender in a PID namespace the agent
cannot see), is dropped, counted and reported.

Bad datagrams are counted and reported on the node's error subject (rate limited); they never
stop the gateway. Trainers that exit without saying goodbye (SIGKILL included) are noticed by
`reap_dead_trainers`, and their GPUs are restored.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from zeus_agent.agent.credentials import (
    ANCILLARY_BYTES,
    RECV_BYTES,
    Received,
    pass_credentials,
    sender,
)
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.rank_relay import RankRelay
from zeus_agent.agent.rapl import RaplReader, cpu_reply
from zeus_agent.errors import (
    ForbiddenError,
    PayloadError,
    ReplyError,
    SettingRefusedError,
    UnansweredError,
    ZeusAgentError,
    reply_for,
)
from zeus_agent.models import MAX_NAME_CHARS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    ErrorEvent,
    GpuDescription,
    JobQuery,
    RegisterJob,
    RegisterRank,
    Reply,
    TrainerEvent,
    join_token_digest,
)
from zeus_agent.wire.text import bounded
from zeus_agent.wire.trainer import (
    MAX_DATAGRAM_BYTES,
    EventDatagram,
    Kind,
    RequestDatagram,
    ScheduleNotice,
    SelectionAnswer,
    SelectRequest,
    TrainerHello,
    WindowRequest,
    decode_datagram,
    encode_notice,
    encode_reply,
)

LOG = logging.getLogger(__name__)
Request = Callable[[str, bytes, float], Awaitable[bytes]]
Publish = Callable[[str, bytes], Awaitable[None]]

_MAX_PER_WAKEUP = 256
"""Datagrams read per wake-up before the loop gets a turn (the reader is called again)."""
_MSG_TRUNC = socket.MSG_TRUNC

ANNOUNCE_AFTER_BIND_S = 0.2
"""Bindings within this time share one announcement (a flood of HELLOs is not a flood of
announcements)."""
MAX_JOIN_DIGESTS = 4096
"""Jobs whose join token's digest the gateway remembers (the most recently registered)."""

def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (any owner) and has not exited.

    A zombie (exited, not yet reaped by its parent) is not alive. Never raises: a pid that
    cannot name a process (<= 0, too large) is not alive.
    """
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    except (OverflowError, ValueError, OSError):
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False  # no procfs (or it just went): trust kill()
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z"


class Gateway:
    """Receives trainer datagrams on the node's Unix socket.

    Args:
        agents: The node's GPU agents by GPU index.
        node: Node name.
        prefix: Subject prefix.
        request: `request(subject, payload, timeout_s) -> reply bytes` over NATS.
        publish: `publish(subject, payload)` over NATS.
        request_timeout_s: Timeout of relayed requests.
        rapl: The node's RAPL counters (CPU and DRAM energy of windows), or None.
        rank_columns: Whether to try a node's rank registrations in columns now.

    `attach(sock)` starts reading a bound socket on the running loop; `close()` stops.
    """

    def __init__(
        self,
        agents: dict[int, GpuAgent],
        node: str,
        prefix: str,
        request: Request,
        publish: Publish,
        request_timeout_s: float = 5.0,
        on_bind: Callable[[], Awaitable[None]] | None = None,
        rapl: RaplReader | None = None,
        rank_columns: Callable[[], bool] = lambda: True,
    ) -> None:
        self.agents = agents
        self.rapl = rapl
        """The node's RAPL counters: windows that ask for CPU energy are answered from them."""
        self._on_bind = on_bind
        self._announce_pending = False
        """Run when a trainer binds a GPU anew (the server announces the node at once, so the
        coordinator reconciles a GPU whose trainer came back to a restarted agent)."""
        self.node = node
        self.prefix = prefix
        self._request = request
        self._publish = publish
        self.request_timeout_s = request_timeout_s
        self.sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.by_pid: dict[int, list[GpuAgent]] = {}
        self._dead_once: set[int] = set()  # pids `reap_dead_trainers` saw gone on its last pass
        """GPUs bound to each trainer process (kernel pid)."""
        self.counters: Counter[str] = Counter()
        self._last_report_ns: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._join_digests: OrderedDict[str, str] = OrderedDict()
        """Job id -> SHA-256 of the join token of a rank the coordinator accepted through this
        agent: a HELLO for the job must present the same token."""
        self.ranks = RankRelay(self._relay, subjects.coord_register_rank(node, prefix),
                               lambda: len(self.agents), columns=rank_columns)
        """The node's rank registrations, relayed together when they arrive together."""

    # ------------------------------------------------------------------ socket
    def attach(self, sock: socket.socket) -> None:
        """Read `sock` (a bound AF_UNIX datagram socket) on the running loop from now on.

        Sets `SO_PASSCRED` so every datagram carries its sender's pid and uid.
        """
        sock.setblocking(False)
        pass_credentials(sock)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def close(self) -> None:
        """Stop reading and close the socket (idempotent)."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.fileno())
        sock.close()

    def _on_readable(self) -> None:
        """Drain the socket (up to `_MAX_PER_WAKEUP` datagrams) with the senders' credentials."""
        sock = self.sock
        if sock is None:
            return
        recvmsg = sock.recvmsg
        for _ in range(_MAX_PER_WAKEUP):
            try:
                data, ancillary, flags, addr = recvmsg(RECV_BYTES, ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                LOG.warning("gateway socket error: %s", e)
                return
            self.received(data, ancillary, flags, addr)

    def received(self, data: bytes, ancillary: Any, flags: int, addr: Any) -> None:
        """Handle one datagram as `recvmsg` returned it, from this socket or a GPU's doorbell."""
        pid, uid = sender(ancillary)
        try:
            if flags & _MSG_TRUNC:
                self._too_long(pid, addr)
                return
            self.datagram_received(data, addr, pid, uid)
        except Exception:  # noqa: BLE001 - one datagram never stops the gateway
            self.counters["internal_error"] += 1
            LOG.exception("gateway: handling a datagram failed; continuing")

    def received_all(self, batch: list[Received]) -> None:
        """On the loop: the datagrams a doorbell read, in order (dropped once closed)."""
        if self.sock is None:
            return
        for data, ancillary, flags, addr in batch:
            self.received(data, ancillary, flags, addr)

    def _too_long(self, pid: int | None, addr: Any) -> None:
        self.counters["datagrams"] += 1
        self.counters["malformed"] += 1
        self._report(
            "malformed_datagram",
            f"dropped a datagram longer than {RECV_BYTES} bytes from {_who(pid, addr)}",
        )

    def datagram_received(self, data: bytes, addr: Any, pid: int | None, uid: int | None) -> None:
        """Handle one datagram sent by process `pid` of user `uid` (the kernel's credentials)."""
        self.counters["datagrams"] += 1
        try:
            dg = decode_datagram(data)
        except PayloadError as e:
            self.counters["malformed"] += 1
            self._report(
                "malformed_datagram",
                f"dropped a malformed datagram from {_who(pid, addr)}: {e}",
            )
            return
        if not pid or uid is None:
            self._refuse_sender(dg, addr, pid)
            return
        if isinstance(dg, EventDatagram):
            agents = self.by_pid.get(pid)
            if not agents:
                self.counters["unbound"] += 1
                self._report(
                    "unbound_trainer",
                    f"dropped events of pid {pid}: it has not said hello (call "
                    "zeus_agent.emit.init(...) before emitting events)",
                )
                return
            for agent in agents:
                agent.on_event(dg)
        elif isinstance(dg, RequestDatagram):
            self._spawn(self._answer(dg, addr, pid, uid))
        else:  # A reply or a schedule notice: only the agent sends those.
            self.counters["malformed"] += 1
            self._report("malformed_datagram",
                         "dropped a reply or schedule datagram sent to the agent")

    def _refuse_sender(self, dg: Any, addr: Any, pid: int | None) -> None:
        """Drop a datagram whose sender the kernel could not name; answer a request anyway."""
        if pid is None:
            reason = "no_credentials"
            message = (
                "dropped a datagram without sender credentials (the kernel attached no "
                "SCM_CREDENTIALS): the agent cannot tell which process sent it"
            )
        else:
            reason = "foreign_pid_namespace"
            message = (
                "dropped a datagram from a process outside the agent's PID namespace (the "
                "kernel reports its pid as 0): run trainers in the agent's PID namespace "
                "(same container, or hostPID on Kubernetes), so the agent can tell them apart "
                "and restore a GPU when its trainer dies"
            )
        self.counters[reason] += 1
        self._report(reason, message)
        if isinstance(dg, RequestDatagram):
            self._send(addr, dg.request_id, reply_for(ForbiddenError(message)))

    # ------------------------------------------------------------------ helpers
    async def _bound(self) -> None:
        """Announce new bindings: at most one announcement per `ANNOUNCE_AFTER_BIND_S`."""
        if self._on_bind is None or self._announce_pending:
            return
        self._announce_pending = True
        try:
            await asyncio.sleep(ANNOUNCE_AFTER_BIND_S)  # many bindings, one announcement
            await self._on_bind()
        except Exception as e:  # noqa: BLE001 - the next heartbeat announces anyway
            LOG.warning("announcing a new binding failed: %s", e)
        finally:
            self._announce_pending = False

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
            source=f"agent:{self.node}"[:MAX_NAME_CHARS],
            code=code,
            message=bounded(message),
            detail={**detail, "counters": dict(self.counters)},
        )
        self._spawn(
            self._publish(subjects.agent_errors(self.node, self.prefix), codec.encode(event))
        )

    def _send(self, addr: Any, request_id: int, reply: Reply) -> None:
        if isinstance(addr, bytes):
            # An autobound (abstract) trainer address; never padded here, but be lenient.
            addr = addr.rstrip(b"\0")
        if not addr or self.sock is None:
            self.counters["unanswerable"] += 1
            return
        data = encode_reply(request_id, reply)
        if len(data) > MAX_DATAGRAM_BYTES:
            self.counters["reply_too_large"] += 1
            data = encode_reply(request_id, Reply.failure(
                "too_large",
                f"the answer is {len(data)} bytes, more than a datagram carries "
                f"({MAX_DATAGRAM_BYTES}): ask for less (one job_id, or a smaller limit)",
            ))
        try:
            self.sock.sendto(data, addr)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            self.counters["reply_failed"] += 1  # the trainer left (e.g. right after its BYE)
            LOG.debug("reply to trainer %r failed: %s", addr, e)
        except (OSError, ValueError) as e:
            self.counters["reply_failed"] += 1
            LOG.warning("reply to trainer %r failed: %s", addr, e)

    def _notify(self, addr: Any, notice: ScheduleNotice | SelectRequest) -> None:
        """Push a notice to a trainer's socket (best effort, never blocks)."""
        if isinstance(addr, bytes):
            addr = addr.rstrip(b"\0")
        data = encode_notice(notice)
        if self.sock is None or len(data) > MAX_DATAGRAM_BYTES:
            self.counters["notice_failed"] += 1
            return
        try:
            self.sock.sendto(data, addr)
        except (OSError, ValueError) as e:
            self.counters["notice_failed"] += 1
            LOG.debug("schedule notice to trainer %r failed: %s", addr, e)

    async def _answer(self, req: RequestDatagram, addr: Any, pid: int, uid: int) -> None:
        try:
            reply = await self._handle(req, pid, uid, addr)
        except PayloadError as e:  # Say which request did not validate.
            reply = reply_for(e.within(req.kind.name))
        except Exception as e:  # noqa: BLE001 - every failure becomes a reply
            if not isinstance(e, ReplyError):
                LOG.exception("gateway request %s failed", req.kind.name)
            reply = reply_for(e, f"internal error in the agent on {self.node}; see its log")
        if req.kind is Kind.BYE and not addr:
            return  # Sent through a doorbell, which has no address: nobody waits for it.
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

    async def _handle(
        self, req: RequestDatagram, pid: int, uid: int, addr: Any = None
    ) -> Reply:
        """Answer one request of process `pid` (user `uid`), as the kernel named them."""
        if req.kind is Kind.HELLO:
            return await self._hello(codec.validate(TrainerHello, req.payload), pid, uid, addr)
        if req.kind is Kind.REGISTER_JOB:
            job = codec.validate(RegisterJob, req.payload)
            job = job.model_copy(update={"uid": uid})  # the kernel's word, not the payload's
            subject = subjects.coord_register_job(self.node, self.prefix)
            return await self._relay(subject, codec.encode(job))
        if req.kind is Kind.REGISTER_RANK:
            payload = dict(req.payload)
            payload.pop("pid", None)  # older emitters sent their pid: the kernel's counts
            rank = codec.validate(RegisterRank, payload).model_copy(update={"uid": uid})
            return await self._register_rank(rank, pid)
        if req.kind is Kind.QUERY_JOB:
            query = codec.validate(JobQuery, req.payload)
            if query.job_id is None:
                raise PayloadError(
                    "QUERY_JOB names one job (job_id): trainers do not list other jobs", "job_id"
                )
            return await self._relay(subjects.coord_job_query(self.prefix), codec.encode(query))
        if req.kind is Kind.WINDOW:
            window = codec.validate(WindowRequest, req.payload)
            if window.t1_ns < window.t0_ns:
                raise PayloadError("t1_ns must not precede t0_ns", "t1_ns")
            if len(window.gpus) > len(self.agents) or len(set(window.gpus)) != len(window.gpus):
                raise PayloadError(
                    f"gpus must list distinct GPUs of this agent ({sorted(self.agents)})", "gpus"
                )
            agents = [self._agent(i) for i in window.gpus]
            for agent in agents:  # A monitor measures again soon: read every update meanwhile.
                agent.counter.hold_active()
            time_s = (window.t1_ns - window.t0_ns) / 1e9
            if not window.exact:  # At once, from the reads so far: no read per request.
                energy = [a.energy_between(window.t0_ns, window.t1_ns) for a in agents]
                return Reply.success(energy_j=energy, time_s=time_s,
                                     **cpu_reply(self.rapl, window))
            answers = await asyncio.gather(
                *(a.energy_between_exact(window.t0_ns, window.t1_ns) for a in agents))
            return Reply.success(energy_j=[e for e, _ in answers], time_s=time_s,
                                 exact=all(x for _, x in answers),
                                 **cpu_reply(self.rapl, window))  # fmt: skip
        if req.kind is Kind.BYE:
            restored = await self.release_pid(pid, reason="trainer said goodbye", crashed=False)
            return Reply.success(restored=restored)
        if req.kind is Kind.SELECTED:
            return self._selected(codec.validate(SelectionAnswer, req.payload), pid)
        raise PayloadError(f"unsupported request kind {req.kind.name}")

    def _selected(self, answer: SelectionAnswer, pid: int) -> Reply:
        """Rank 0's choice of power limit: forwarded as its rank's `selection` event.

        Only from the process the kernel names as the trainer bound to a GPU of the job here.
        """
        agent = next((a for a in self.by_pid.get(pid, [])
                      if a.binding is not None and a.binding.job_id == answer.job_id), None)
        if agent is None or agent.binding is None:
            raise ForbiddenError(f"this process drives no GPU of job "
                                 f"{answer.job_id!r} on node {self.node!r}: say HELLO first")
        agent.measurer.forward(TrainerEvent(
            kind="selection", t_ns=time.monotonic_ns(), index=answer.request,
            power_limit_w=answer.power_limit_w, name=_printable(answer.error)))
        self._spawn(agent.measurer.flush())
        return Reply.success(forwarded=True)

    async def _hello(self, hello: TrainerHello, pid: int, uid: int, addr: Any = None) -> Reply:
        agent = self._agent(hello.gpu_index)
        presented = None if hello.join_token is None else join_token_digest(hello.join_token)
        digest = self._join_digests.get(hello.job_id)
        if digest is not None and not (
            presented is not None and hmac.compare_digest(presented, digest)
        ):
            raise ForbiddenError(
                f"job {hello.job_id!r} has ranks on this node that joined with its join token: "
                "a HELLO for it must present the token too (zeus_agent.emit.init sends it; pass "
                "init(job_id=..., join_token=...) without torch.distributed)",
            )
        bound = agent.binding
        if bound is not None and bound.pid is not None and bound.pid != pid:
            if process_alive(bound.pid):
                raise SettingRefusedError(
                    f"GPU {agent.index} on node {self.node!r} is driven by trainer pid "
                    f"{bound.pid} (job {bound.job_id!r}, rank {bound.rank}), which is still "
                    "running: one trainer process per GPU",
                )
            await self.release_pid(bound.pid, reason="process exited without goodbye")
        before = agent.binding
        agent.bind(hello.job_id, hello.rank, pid, uid, presented,
                   notify=functools.partial(self._notify, addr) if addr else None)
        if before != agent.binding:
            self._spawn(self._bound())
        mine = self.by_pid.setdefault(pid, [])
        if agent not in mine:
            mine.append(agent)
        assert agent.info is not None
        doorbell = {} if agent.doorbell is None else {"doorbell": agent.doorbell.path}
        return Reply.success(
            **doorbell,
            node=self.node,
            gpu_index=agent.index,
            gpu_uuid=agent.info.uuid,
            gpu_name=agent.info.name,
            supported_graphics_clocks_mhz=list(agent.info.supported_graphics_clocks_mhz),
            supported_memory_clocks_mhz=list(agent.info.supported_memory_clocks_mhz),
        )

    async def _register_rank(self, rank: RegisterRank, pid: int) -> Reply:
        """Relay a rank's registration only for a GPU of this node the sender said HELLO for."""
        index = rank.gpu.gpu_index
        agent = self.agents.get(index)
        if rank.gpu.node != self.node or agent is None:
            raise ForbiddenError(
                f"this agent relays only bindings to its own GPUs (node {self.node!r}, GPUs "
                f"{sorted(self.agents)}); got node {rank.gpu.node[:80]!r}, GPU {index}",
            )
        assert agent.info is not None
        if rank.gpu.gpu_uuid and rank.gpu.gpu_uuid != agent.info.uuid:
            raise ForbiddenError(
                f"GPU {index} on node {self.node!r} is {agent.info.uuid}, not "
                f"{rank.gpu.gpu_uuid[:80]!r}",
            )
        bound = agent.binding
        if bound is None or bound.pid != pid:
            holder = f"pid {bound.pid}" if bound is not None and bound.pid else "no process"
            raise ForbiddenError(
                f"REGISTER_RANK for GPU {index} must come from the process that said HELLO for "
                f"it ({holder} did); this process (pid {pid}) must say HELLO first",
            )
        if (bound.job_id, bound.rank) != (rank.job_id, rank.rank_info.rank):
            raise SettingRefusedError(
                f"this process said HELLO as job {bound.job_id!r} rank {bound.rank} on GPU "
                f"{index}, not as job {rank.job_id!r} rank {rank.rank_info.rank}",
            )
        # The GPU's clocks as its agent knows them, not as the trainer said (highest first).
        clocks = sorted(agent.info.supported_graphics_clocks_mhz, reverse=True)
        # With the GPU's description (limits, uuid), so the coordinator need not ask for it.
        limit = agent.power_limit_w or agent.info.default_power_limit_w
        rank = rank.model_copy(update={
            "rank_info": rank.rank_info.model_copy(update={"available_frequencies": clocks}),
            "gpu_info": GpuDescription.from_info(agent.info, limit, bound.job_id,
                                                 agent.counter.update_period_ms)})
        reply = await self.ranks.relay(rank)  # (With the node's other ranks registering now.)
        if reply.ok and rank.join_token is not None:
            # The coordinator checked the token: later HELLOs for the job must present it.
            self._join_digests[rank.job_id] = join_token_digest(rank.join_token)
            self._join_digests.move_to_end(rank.job_id)
            while len(self._join_digests) > MAX_JOIN_DIGESTS:
                self._join_digests.popitem(last=False)
        return reply

    async def _relay(self, subject: str, payload: bytes) -> Reply:
        """The coordinator's reply to `payload` sent on `subject`.

        Raises:
            UnansweredError: No coordinator answered in time.
            ZeusAgentError: Its reply could not be read (code `internal`).
        """
        try:
            raw = await self._request(subject, payload, self.request_timeout_s)
        except Exception as e:  # noqa: BLE001 - nats raises TimeoutError / NoRespondersError
            self.counters["relay_failed"] += 1
            raise UnansweredError(
                f"no coordinator answered on {subject} within {self.request_timeout_s:g} s "
                f"({type(e).__name__}); is `zeus-coordinator run` connected to this NATS?"
            ) from None
        try:
            return codec.decode(raw, Reply)
        except PayloadError as e:
            raise ZeusAgentError(f"the coordinator sent an unreadable reply: {e}") from None

    # ------------------------------------------------------------------ trainer lifetimes
    async def release_pid(self, pid: int, reason: str, crashed: bool = True) -> list[str]:
        """Restore and unbind every GPU bound to trainer process `pid` (and no other).

        A trainer that left without saying goodbye (`crashed`) is reported as an error event
        (`trainer_gone`, a warning); one that said goodbye as `trainer_left` (logged as info):
        the coordinator then lets go of what it kept of the rank's measurements.
        """
        restored: list[str] = []
        for agent in self.by_pid.pop(pid, []):
            bound = agent.binding
            if bound is not None and bound.pid not in (pid, None):
                continue  # another trainer process has taken this GPU over since
            restored += [f"gpu{agent.index}:{k}" for k in await agent.restore(reason=reason)]
            if agent.binding is bound:
                # At once, before anything else awaits: a setting of the job that waited for the
                # restore to finish is then refused, not applied to a GPU whose trainer is gone.
                agent.unbind()
            if bound is not None and not crashed:
                await agent.error_event(
                    "trainer_left",
                    f"trainer pid {pid} (job {bound.job_id}, rank {bound.rank}) said goodbye; "
                    f"GPU {agent.index} restored to defaults",
                    binding=bound,
                    log_level=logging.INFO,
                )
            elif bound is not None:
                await agent.error_event(
                    "trainer_gone",
                    f"trainer pid {pid} (job {bound.job_id}, rank {bound.rank}) is gone "
                    f"({reason}); GPU {agent.index} restored to defaults",
                    binding=bound,
                )
        return restored

    async def reap_dead_trainers(self) -> None:
        """Release the GPUs of trainer processes that no longer exist.

        A pid is released when seen gone on two passes in a row: a trainer's goodbye can still
        be in the socket's queue when its process has exited (seen with torchrun's ranks), and
        it must be read as a goodbye, not a crash. Never stops at one entry: a pid that cannot
        name a process counts as gone, and a failing release is logged and the next pid checked.
        """
        gone = {pid for pid in self.by_pid if not process_alive(pid)}
        confirmed, self._dead_once = gone & self._dead_once, gone - self._dead_once
        for pid in confirmed:
            if pid not in self.by_pid:  # (Released meanwhile, by a goodbye read in between.)
                continue
            try:
                await self.release_pid(pid, reason="process exited without goodbye")
            except Exception:  # noqa: BLE001 - the other trainers still get reaped
                LOG.exception("releasing the GPUs of trainer pid %r failed", pid)
                self.by_pid.pop(pid, None)

    def close_tasks(self) -> None:
        """Cancel requests still being answered (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        self.ranks.close()


def _who(pid: int | None, addr: Any) -> str:
    if pid:
        return f"pid {pid}"
    return str(addr or "an unbound socket")


def _printable(text: str) -> str:
    """A trainer's text for a `Name` field: control characters replaced."""
    return "".join(c if c.isprintable() else "?" for c in text)[:MAX_NAME_CHARS]
