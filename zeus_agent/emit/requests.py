"""Requests that wait for the agent's reply: registrations, window energies, schedule notices.

Unlike the events, these block the caller's thread, each for at most `timeout_s`, and run
only at start-up (`init`) or when a window closes, never inside a step. One lock serialises
them, so a reply is read by the request that waits for it; what arrives meanwhile (late
replies, the schedule notices the agent pushes) is drained and the newest notice kept.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import threading
import time
from collections.abc import Sequence
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


class Requests(Transport):
    """Request-and-reply over the publisher's socket (state set by `Publisher.__init__`)."""

    gpu_indices: list[int]
    physical_gpu_indices: list[int]
    timeout_s: float
    job_id: str | None
    join_token: str | None
    rank: int
    node: str | None
    _windows_unanswered: int
    _hello: TrainerHello | None
    _rank_registration: RegisterRank | None
    _request_lock: threading.Lock
    _notice: ScheduleNotice | None
    _selection: SelectRequest | None

    def _rebind(self) -> None:
        """Re-introduce the process to an agent found after a failure (no reply awaited)."""
        try:
            if self._request_lock.acquire(blocking=False):  # Never steal a waited-for reply.
                try:
                    self._drain_incoming()
                finally:
                    self._request_lock.release()
            # From the trainers' socket, never the doorbell: the agent answers and pushes
            # schedule notices to the HELLO's address.
            if self._hello is not None:
                self._sock.send(
                    encode_request(Kind.HELLO, self._pid, next(self._ids), self._hello))
            if self._rank_registration is not None:
                self._sock.send(
                    encode_request(
                        Kind.REGISTER_RANK, self._pid, next(self._ids), self._rank_registration
                    )
                )
        except OSError:
            pass  # The next event sees the same failure and handles it.

    # ------------------------------------------------------------------ incoming
    def _drain_incoming(self) -> None:
        """Read datagrams already received: keep schedule notices, drop late replies."""
        recv = self._sock.recv
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
            if notice.job_id == self.job_id:
                self._selection = notice
            return
        if isinstance(notice, ScheduleNotice) and (
            self._notice is None or notice.version >= self._notice.version
        ):
            self._notice = notice

    def latest_schedule(self) -> ScheduleNotice | None:
        """The newest frequency schedule the agent pushed for this rank (non-blocking).

        The agent applies the frequencies itself; a drop-in uses this to check instruction
        names locally. None until the coordinator has installed a schedule.
        """
        if self.connected and not self._closed:
            with contextlib.suppress(Exception):
                if self._request_lock.acquire(blocking=False):
                    try:
                        self._drain_incoming()
                    finally:
                        self._request_lock.release()
        return self._notice

    def pending_selection(self) -> SelectRequest | None:
        """The coordinator's unanswered question to this rank, if one came (non-blocking).

        Asked of rank 0 of a job with a custom optimum selector, once profiling is over.
        """
        if self.connected and not self._closed:
            with contextlib.suppress(Exception):
                if self._request_lock.acquire(blocking=False):
                    try:
                        self._drain_incoming()
                    finally:
                        self._request_lock.release()
        return self._selection

    def answer_selection(self, question: SelectRequest, power_limit_w: int | None,
                         error: str = "") -> Reply | None:
        """Answer the coordinator's question with the chosen limit, or why there is none."""
        self._selection = None
        answer = SelectionAnswer(job_id=question.job_id, request=question.request,
                                 power_limit_w=power_limit_w, error=error[:255])
        return self.request(Kind.SELECTED, answer)

    # ------------------------------------------------------------------ request and reply
    def request(self, kind: Kind, payload: Any, timeout_s: float | None = None) -> Reply | None:
        """Send a request datagram and wait for its reply on the caller's thread.

        Args:
            kind: A request kind (`HELLO`, `REGISTER_JOB`, `REGISTER_RANK`, `WINDOW`).
            payload: A pydantic model or a dict.
            timeout_s: How long to wait; default the publisher's `timeout_s`.

        Returns:
            The agent's `Reply`, or None when no agent is connected or it did not answer
            in time.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._request_lock:
            if not self.connected and not self._connect(_monotonic_ns()):
                return None
            self._drain_incoming()
            self.flush()
            request_id = next(self._ids)
            data = encode_request(kind, self._pid, request_id, payload)
            poller = select.poll()
            while True:  # Send, waiting (bounded) while the agent's queue is full.
                try:
                    self._sock.send(data)
                    break
                except BlockingIOError:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    poller.register(self._sock, select.POLLOUT)
                    poller.poll(min(remaining, 0.01) * 1000)
                    poller.unregister(self._sock)
                except OSError as e:
                    if e.errno in NO_AGENT_ERRNOS:
                        self._disconnect()
                    else:
                        logger.warning("zeus_agent.emit: sending a %s failed: %r", kind.name, e)
                    return None
            poller.register(self._sock, select.POLLIN)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not poller.poll(max(1, math.ceil(remaining * 1000))):
                    continue
                try:
                    raw = self._sock.recv(MAX_DATAGRAM_BYTES)
                except BlockingIOError:
                    continue
                except OSError as e:
                    if e.errno in NO_AGENT_ERRNOS:
                        self._disconnect()
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
        """Register a job through the agent (relayed to the coordinator).

        Returns:
            The job id the coordinator generated, or None when no agent answered. The job's
            join token, which every rank must present, is kept in `join_token`.

        Raises:
            RegistrationError: The coordinator refused the job.
        """
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
        self.join_token = token if isinstance(token, str) and token else None
        return job_id

    def hello(self, hello: TrainerHello) -> Reply | None:
        """Bind this process to a job rank and GPU on the agent.

        Returns:
            The agent's reply (its `result` names the node and the GPU's clocks), or None
            when no agent answered.

        Raises:
            RegistrationError: The agent refused the binding.
        """
        reply = self._registration("hello", Kind.HELLO, hello)
        self._hello = hello
        self.job_id = hello.job_id
        self.rank = hello.rank
        if reply is not None:
            node = reply.result.get("node")
            self.node = node if isinstance(node, str) else None
            doorbell = reply.result.get("doorbell")
            if isinstance(doorbell, str) and doorbell and (
                    doorbell != self._doorbell or self._bell is None):
                self._doorbell = doorbell
                self._open_bell()
        return reply

    def register_rank(self, registration: RegisterRank) -> Reply | None:
        """Register this rank and its GPU with the coordinator, through the agent.

        Returns:
            The reply, or None when no agent answered.

        Raises:
            RegistrationError: The coordinator refused the rank.
        """
        reply = self._registration("rank", Kind.REGISTER_RANK, registration)
        self._rank_registration = registration
        return reply

    # ------------------------------------------------------------------ energy
    _cpus_refused: bool = False
    """The agent refused a window's `cpus` (it predates CPU energy): windows no longer ask."""

    def measure(
        self,
        t0_ns: int,
        t1_ns: int,
        gpu_indices: Sequence[int] | None = None,
        exact: bool = False,
    ) -> list[float]:
        """Energy (J) of GPUs between two `time.monotonic_ns()` stamps of this host.

        By default the agent answers at once from its counter reads (past the newest read,
        with the last update period's power: median error ~2% at 54 ms, ~0.4% at 1.3 s on an
        H200). With `exact`, it answers once a read brackets `t1_ns` (~60 ms later, ~200 ms at
        most), interpolating between reads. An agent too old to know `exact` is asked again
        without it.

        Args:
            t0_ns: Start stamp.
            t1_ns: End stamp.
            gpu_indices: CUDA device indices; default the publisher's `gpu_indices`.
            exact: Wait for the read that brackets the end (see above).

        Returns:
            One energy per GPU, in order; NaN for every GPU when the agent did not answer or
            could not measure (counted in `stats().windows_unanswered`). Never raises.
        """
        return self.measure_window(t0_ns, t1_ns, gpu_indices, exact).gpu_energy

    def measure_window(
        self,
        t0_ns: int,
        t1_ns: int,
        gpu_indices: Sequence[int] | None = None,
        exact: bool = False,
        cpu_indices: Sequence[int] | Literal["all"] | None = None,
    ) -> WindowEnergy:
        """`measure`, and the CPU and DRAM energy (RAPL) of the node's CPU packages.

        Args:
            t0_ns: Start stamp.
            t1_ns: End stamp.
            gpu_indices: CUDA device indices; default the publisher's `gpu_indices`.
            exact: Wait for the GPU counter read that brackets the end (see `measure`).
            cpu_indices: CPU packages (Zeus's CPU indices, `intel-rapl:<index>`) to measure
                too; "all": every package of the node; None: none. An agent too old to
                measure them is asked again without them (and not asked again).

        Returns:
            The GPUs' energies as `measure` gives them, and each CPU package's and its DRAM's
            energy where the agent measured them (`cpu_note` says why not). Never raises.
        """
        logical = self.gpu_indices if gpu_indices is None else list(gpu_indices)
        cpus = None if cpu_indices is None or cpu_indices == "all" else list(cpu_indices)
        wanted: list[int] | Literal["all"] | None = "all" if cpu_indices == "all" else cpus
        try:
            gpus = (
                self.physical_gpu_indices
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
        self._windows_unanswered += 1
        return WindowEnergy([math.nan] * len(logical),
                            cpu_note="" if wanted is None else "the agent did not answer")


_UNSET: dict[str, Any] = {"cpus": None, "exact": False}
"""Fields of `WindowRequest` added after protocol 1 shipped, and their unset values."""


def _refused_field(reply: Reply | None, request: WindowRequest) -> str | None:
    """The added field an agent that predates it refused, or None."""
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
