"""Requests that wait for the agent's reply: registrations, window energies, schedule notices.

Unlike the events, these block the caller's thread, each for at most `timeout_s`, and run
only at start-up (`init`) or when a window closes, never inside a step. One lock serialises
them, so a reply is read by the request that waits for it; what arrives meanwhile (late
replies, the schedule notices the agent pushes) is drained and the newest notice kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import select
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from zeus_agent.emit.environment import physical_gpu_index
from zeus_agent.emit.records import RegistrationError, WindowEnergy
from zeus_agent.emit.transport import NO_AGENT_ERRNOS, Transport
from zeus_agent.errors import PayloadError
from zeus_agent.models import JobInfo
from zeus_agent.wire.messages import PowerLimitOptions, RegisterJob, RegisterRank, Reply
from zeus_agent.wire.trainer import (
    MAX_DATAGRAM_BYTES,
    Kind,
    ReplyDatagram,
    ScheduleNotice,
    SelectionAnswer,
    SelectRequest,
    TrainerHello,
    WindowRequest,
    decode_datagram,
    encode_request,
)

logger = logging.getLogger("zeus_agent.emit")

_monotonic_ns = time.monotonic_ns


@dataclass(frozen=True)
class Session:
    """What this process's requests carry, and what their replies taught.

    Held by the `Requests`, which alone replace it: with what `init` decides (`carry`, through
    the publisher's properties) and what the replies teach (the job's registration, the
    HELLO's).
    """

    timeout_s: float
    """How long a request waits for its reply, by default."""
    job_id: str | None = None
    """The job this rank is bound to (the HELLO's), or None."""
    join_token: str | None = None
    """The job's join token (rank 0: from the registration; other ranks: from rank 0)."""
    rank: int = 0
    """The rank the HELLO bound (0 until then)."""
    node: str | None = None
    """The agent's node (the HELLO reply's), or None."""


class Requests:
    """Request-and-reply over the transport's socket; what the replies taught goes to `session`.

    Attributes:
        session: The `Session` these requests carry and complete.
        windows_unanswered: Window requests without an answer.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        pid: int,
        ids: Iterator[int],
        timeout_s: float,
        gpu_indices: Sequence[int],
        physical_gpu_indices: Sequence[int],
    ) -> None:
        """Requests over `transport`'s socket.

        Args:
            transport: The connection to the agent: its socket carries the requests.
            pid: This process's id, sent with every request.
            ids: Request ids, shared with the transport.
            timeout_s: How long a request waits for its reply, by default.
            gpu_indices: The CUDA device indices windows measure by default.
            physical_gpu_indices: The node's indices of `gpu_indices`, in order.
        """
        self.session = Session(timeout_s)
        self.windows_unanswered = 0
        self._transport = transport
        self._pid = pid
        self._ids = ids
        self._gpu_indices = gpu_indices
        self._physical_gpu_indices = physical_gpu_indices
        self._lock = threading.Lock()
        """Serialises requests, so a reply is read by the request that waits for it."""
        self._hello: TrainerHello | None = None
        self._rank_registration: RegisterRank | None = None
        self._notice: ScheduleNotice | None = None
        self._selection: SelectRequest | None = None
        self._cpus_refused = False
        """The agent refused a window's `cpus` (it predates CPU energy): windows no longer ask."""

    def carry(self, **changes: Any) -> None:
        """From now on the requests carry these `Session` fields.

        The job, its join token, the rank or the default timeout, as `init` or the owner
        decided.
        """
        self.session = dataclasses.replace(self.session, **changes)

    def remember_hello(self, hello: TrainerHello) -> None:
        """Introduce the process with `hello` to an agent found later (none answers now)."""
        self._hello = hello

    def reintroduce(self) -> None:
        """Re-introduce the process to an agent found after a failure (no reply awaited)."""
        try:
            if self._lock.acquire(blocking=False):  # Never steal a waited-for reply.
                try:
                    self._drain_incoming()
                finally:
                    self._lock.release()
            # From the trainers' socket, never the doorbell: the agent answers and pushes
            # schedule notices to the HELLO's address.
            sock = self._transport.sock
            if self._hello is not None:
                sock.send(encode_request(Kind.HELLO, self._pid, next(self._ids), self._hello))
            if self._rank_registration is not None:
                sock.send(
                    encode_request(
                        Kind.REGISTER_RANK, self._pid, next(self._ids), self._rank_registration
                    )
                )
        except OSError:
            pass  # The next event sees the same failure and handles it.

    # ------------------------------------------------------------------ incoming
    def _drain_incoming(self) -> None:
        """Read datagrams already received: keep schedule notices, drop late replies."""
        recv = self._transport.sock.recv
        for _ in range(1024):
            try:
                raw = recv(MAX_DATAGRAM_BYTES)
            except OSError:
                return
            self._keep_notice(raw)

    def _keep_notice(self, raw: bytes) -> None:
        """Keep `raw` if it is a schedule notice for this publisher's rank, or a question."""
        if len(raw) < 3 or raw[2] not in (int(Kind.SCHEDULE), int(Kind.SELECT)):  # cheap check
            return
        try:
            notice = decode_datagram(raw)
        except PayloadError as e:
            logger.warning("zeus_agent.emit: ignoring a bad notice from the agent: %s", e)
            return
        if isinstance(notice, SelectRequest):
            if notice.job_id == self.session.job_id:
                self._selection = notice
            return
        if isinstance(notice, ScheduleNotice) and (
            self._notice is None or notice.version >= self._notice.version
        ):
            self._notice = notice

    def _drain_if_free(self) -> None:
        """`_drain_incoming` while connected, unless a request is reading its reply."""
        transport = self._transport
        if transport.connected and not transport.closed:
            with contextlib.suppress(Exception):
                if self._lock.acquire(blocking=False):
                    try:
                        self._drain_incoming()
                    finally:
                        self._lock.release()

    def latest_schedule(self) -> ScheduleNotice | None:
        """`Publisher.latest_schedule`: the newest notice kept (after reading what came)."""
        self._drain_if_free()
        return self._notice

    def pending_selection(self) -> SelectRequest | None:
        """`Publisher.pending_selection`: the question kept (after reading what came)."""
        self._drain_if_free()
        return self._selection

    def answer_selection(self, question: SelectRequest, power_limit_w: int | None,
                         error: str = "") -> Reply | None:
        """`Publisher.answer_selection`: a `SELECTED` request; the question is forgotten."""
        self._selection = None
        answer = SelectionAnswer(job_id=question.job_id, request=question.request,
                                 power_limit_w=power_limit_w, error=error[:255])
        return self.request(Kind.SELECTED, answer)

    # ------------------------------------------------------------------ request and reply
    def request(self, kind: Kind, payload: Any, timeout_s: float | None = None) -> Reply | None:
        """`Publisher.request`: send, then read until its reply comes or `timeout_s` passes.

        What arrives meanwhile is kept if it is a notice (`_keep_notice`), else dropped.
        """
        timeout = self.session.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        transport = self._transport
        with self._lock:
            if not transport.connected and not transport.connect(_monotonic_ns()):
                return None
            self._drain_incoming()
            transport.flush()
            sock = transport.sock
            request_id = next(self._ids)
            data = encode_request(kind, self._pid, request_id, payload)
            poller = select.poll()
            while True:  # Send, waiting (bounded) while the agent's queue is full.
                try:
                    sock.send(data)
                    break
                except BlockingIOError:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    poller.register(sock, select.POLLOUT)
                    poller.poll(min(remaining, 0.01) * 1000)
                    poller.unregister(sock)
                except OSError as e:
                    if e.errno in NO_AGENT_ERRNOS:
                        transport.disconnect()
                    else:
                        logger.warning("zeus_agent.emit: sending a %s failed: %r", kind.name, e)
                    return None
            poller.register(sock, select.POLLIN)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not poller.poll(max(1, math.ceil(remaining * 1000))):
                    continue
                try:
                    raw = sock.recv(MAX_DATAGRAM_BYTES)
                except BlockingIOError:
                    continue
                except OSError as e:
                    if e.errno in NO_AGENT_ERRNOS:
                        transport.disconnect()
                    return None
                try:
                    reply = decode_datagram(raw)
                except PayloadError as e:
                    logger.warning("zeus_agent.emit: ignoring a bad datagram from the agent: %s", e)
                    continue
                if isinstance(reply, ReplyDatagram) and reply.request_id == request_id:
                    return reply.reply
                self._keep_notice(raw)

    # ------------------------------------------------------------------ registrations
    def _registration(self, what: str, kind: Kind, payload: Any) -> Reply | None:
        reply = self.request(kind, payload)
        if reply is not None and not reply.ok:
            raise RegistrationError(what, reply.code, reply.error)
        return reply

    def register_job(
        self,
        job_info: JobInfo,
        power_limit: PowerLimitOptions | None = None,
        scheduler: str | None = None,
    ) -> str | None:
        """`Publisher.register_job`: keeps the reply's join token in the session."""
        message = RegisterJob(job=job_info, power_limit=power_limit)
        if scheduler is not None:
            message.scheduler = scheduler
        reply = self._registration("job", Kind.REGISTER_JOB, message)
        if reply is None:
            return None
        job_id = reply.result.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise RegistrationError("job", "internal", f"reply carries no job id: {reply.result}")
        token = reply.result.get("join_token")
        self.carry(join_token=token if isinstance(token, str) and token else None)
        return job_id

    def hello(self, hello: TrainerHello) -> Reply | None:
        """`Publisher.hello`: keeps the HELLO (re-sent on reconnecting) and what the reply says.

        The rank's job and rank, the agent's node, and its GPU's doorbell (the transport
        sends events there).
        """
        reply = self._registration("hello", Kind.HELLO, hello)
        self._hello = hello
        self.carry(job_id=hello.job_id, rank=hello.rank)
        if reply is not None:
            node = reply.result.get("node")
            self.carry(node=node if isinstance(node, str) else None)
            doorbell = reply.result.get("doorbell")
            if isinstance(doorbell, str) and doorbell:
                self._transport.use_doorbell(doorbell)
        return reply

    def register_rank(self, registration: RegisterRank) -> Reply | None:
        """`Publisher.register_rank`: keeps the registration (re-sent on reconnecting)."""
        reply = self._registration("rank", Kind.REGISTER_RANK, registration)
        self._rank_registration = registration
        return reply

    # ------------------------------------------------------------------ energy
    def measure_window(
        self,
        t0_ns: int,
        t1_ns: int,
        gpu_indices: Sequence[int] | None = None,
        exact: bool = False,
        cpu_indices: Sequence[int] | Literal["all"] | None = None,
    ) -> WindowEnergy:
        """`Publisher.measure_window`: a `WINDOW` request, asked again without what is refused.

        The fields added after protocol 1 (`_UNSET`) are dropped from the request when the
        agent's `bad_request` names them; `cpus` then for good (`_cpus_refused`).
        """
        logical = list(self._gpu_indices) if gpu_indices is None else list(gpu_indices)
        cpus = None if cpu_indices is None or cpu_indices == "all" else list(cpu_indices)
        wanted: list[int] | Literal["all"] | None = "all" if cpu_indices == "all" else cpus
        try:
            gpus = (
                list(self._physical_gpu_indices)
                if gpu_indices is None
                else [physical_gpu_index(i) for i in logical]
            )
            request = WindowRequest(t0_ns=t0_ns, t1_ns=t1_ns, gpus=gpus, exact=exact,
                                    cpus=None if self._cpus_refused else wanted)
            reply = self.request(Kind.WINDOW, request)
            for _ in range(2):  # An agent that predates a field refuses it: ask without it.
                field = _refused_field(reply, request)
                if field is None:
                    break
                if field == "cpus":
                    self._cpus_refused = True
                    logger.info("zeus_agent.emit: the agent predates CPU energy; windows "
                                "measure GPUs only")
                else:
                    logger.info("zeus_agent.emit: the agent predates exact windows; measuring "
                                "at once")
                request = request.model_copy(update={field: _UNSET[field]})
                reply = self.request(Kind.WINDOW, request)
        except Exception as e:  # measuring never raises into training.
            logger.warning("zeus_agent.emit: window request failed: %r", e)
            reply = None
        if reply is not None and reply.ok:
            energy = reply.result.get("energy_j")
            if isinstance(energy, list) and len(energy) == len(logical):
                if request.cpus is None:
                    note = "" if wanted is None else "the agent predates CPU energy"
                    return WindowEnergy([float(e) for e in energy], cpu_note=note)
                return WindowEnergy([float(e) for e in energy], *_cpu_energies(reply.result))
            logger.warning("zeus_agent.emit: malformed window reply: %s", reply.result)
        elif reply is not None:
            logger.warning(
                "zeus_agent.emit: the agent could not measure the window: [%s] %s",
                reply.code,
                reply.error,
            )
        self.windows_unanswered += 1
        return WindowEnergy([math.nan] * len(logical),
                            cpu_note="" if wanted is None else "the agent did not answer")


_UNSET: dict[str, Any] = {"cpus": None, "exact": False}
"""Fields of `WindowRequest` added after protocol 1 shipped, and their unset values."""


def _refused_field(reply: Reply | None, request: WindowRequest) -> str | None:
    """The added field an agent that predates it refused, or None.

    Read from the reply's text: the agents refusing a field are those older than it, whose
    `bad_request` names it only there ("WINDOW: field 'cpus': Extra inputs are not
    permitted"). A structured field name in `Reply` could not help, as those agents would never
    send it, and peers that predate it would refuse a reply carrying it (`extra="forbid"`).
    """
    if reply is None or reply.code != "bad_request":
        return None
    for field, unset in _UNSET.items():
        if field in reply.error and getattr(request, field) != unset:
            return field
    return None


def _cpu_energies(
    result: dict[str, Any],
) -> tuple[dict[int, float] | None, dict[int, float] | None, str]:
    """`(cpu_energy, dram_energy, note)` of a window reply that was asked for CPU energy."""
    cpus, cpu_j, dram_j = result.get("cpus"), result.get("cpu_energy_j"), result.get(
        "dram_energy_j")
    note = result.get("cpu_error")
    note = note if isinstance(note, str) else ""
    if not (isinstance(cpus, list) and isinstance(cpu_j, list) and isinstance(dram_j, list)
            and len(cpus) == len(cpu_j) == len(dram_j)):
        return None, None, note or "the agent's reply carries no CPU energy"
    try:
        cpu = {int(i): float(e) for i, e in zip(cpus, cpu_j, strict=True)}
        dram = {int(i): float(e) for i, e in zip(cpus, dram_j, strict=True) if e is not None}
    except (TypeError, ValueError):
        return None, None, f"malformed CPU energy in the agent's reply: {result}"[:300]
    return cpu or None, dram or None, note
