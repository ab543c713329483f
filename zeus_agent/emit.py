"""The trainer publisher: what a training script imports to talk to its node's agent.

Tiny and unprivileged: one non-blocking Unix datagram socket (autobound to an abstract address,
so the agent can answer with `sendto`), no thread, no NATS. Events are stamped with
`time.monotonic_ns()` on the caller's thread and sent at once; they never block and never raise.

Pieces:

* `Publisher`: the socket, the rank's running counters and the hot-path event methods
  (`epoch_begin`, `epoch_end`, `step_begin`, `step_end`, `instruction_begin`,
  `instruction_end`); requests with a reply (`register_job`, `hello`, `register_rank`,
  `measure`); profiling windows (`push_window`/`pop_window`/`window`, as in Zeus 0.16); `stats()`;
  `close()`.
* `ProfilingResult`: time (s) and per-GPU energy (J) of one window (Zeus 0.16's dataclass).
* `PublisherStats`: counters of emitted, sent, queued and dropped events.
* `RegistrationError`: the coordinator or agent refused a registration at `init`.
* `init(...)`: build the default publisher, register the job (rank 0) and the rank.
* Module-level `epoch_begin()` ... `instruction_end(name)`, `push_window`, `pop_window`,
  `window`, `stats`, `close`: delegate to the default publisher (`get_publisher()`).
* `physical_gpu_index(i)`: a CUDA device index -> the node's index, via `CUDA_VISIBLE_DEVICES`.

Delivery: a datagram the agent's queue cannot take right now (`EAGAIN`; Linux queues only
`net.unix.max_dgram_qlen` datagrams per receiver, 10 by default) waits in a small bounded
backlog that the next calls flush first, in order; past the bound, events are dropped and
counted. Without an agent, events are dropped and counted, and the socket reconnects at most
once per `reconnect_interval_s` so an agent that starts later is picked up.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import itertools
import logging
import math
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeus_agent.errors import PayloadError, ZeusAgentError
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import (
    GpuBinding,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
)
from zeus_agent.wire.trainer import (
    DEFAULT_SOCKET_PATH,
    MAX_DATAGRAM_BYTES,
    Kind,
    ReplyDatagram,
    ScheduleNotice,
    TrainerHello,
    WindowRequest,
    decode_datagram,
    encode_event,
    encode_request,
)

__all__ = [
    "ENV_SOCKET",
    "ProfilingResult",
    "Publisher",
    "PublisherStats",
    "RegistrationError",
    "close",
    "epoch_begin",
    "epoch_end",
    "get_publisher",
    "init",
    "instruction_begin",
    "instruction_end",
    "physical_gpu_index",
    "pop_window",
    "push_window",
    "stats",
    "step_begin",
    "step_end",
    "window",
]

logger = logging.getLogger(__name__)

ENV_SOCKET = "ZEUS_AGENT_SOCKET"
"""Environment variable naming the agent's socket (else `DEFAULT_SOCKET_PATH`)."""

_EPOCH_BEGIN = int(Kind.EPOCH_BEGIN)
_EPOCH_END = int(Kind.EPOCH_END)
_STEP_BEGIN = int(Kind.STEP_BEGIN)
_STEP_END = int(Kind.STEP_END)
_INSTRUCTION_BEGIN = int(Kind.INSTRUCTION_BEGIN)
_INSTRUCTION_END = int(Kind.INSTRUCTION_END)

_NO_AGENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE}
)
_NO_AGENT = "no_agent"
_BUFFER_FULL = "buffer_full"
_ERROR = "error"

_monotonic_ns = time.monotonic_ns
_encode = encode_event


class RegistrationError(ZeusAgentError):
    """The agent or the coordinator refused a registration (`Reply.ok` False).

    Raised by `init` (never on the hot path). `code` is the reply's stable code
    (`bad_request`, `unknown_job`, `duplicate`, `unavailable`, ...).

    Attributes:
        code: The reply's error code.
        message: The reply's error message.
        what: What was being registered: "job", "hello" or "rank".
    """

    def __init__(self, what: str, code: str, message: str) -> None:
        super().__init__(f"registering the {what} failed: [{code}] {message}")
        self.what = what
        self.code = code
        self.message = message


@dataclass
class ProfilingResult:
    """Profiling result of one window (as in Zeus 0.16).

    Attributes:
        time: Time elapsed within the window (s).
        energy: Energy of each of the publisher's GPUs within the window (J), in the order of
            its `gpu_indices`; NaN when no agent answered.
    """

    time: float
    energy: list[float]


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's counters.

    Attributes:
        events: Event calls so far.
        sent: Events handed to the kernel.
        queued: Events waiting in the local backlog (the agent's queue was full).
        dropped: Events lost, all reasons.
        dropped_by_reason: `no_agent` (nobody at the socket), `buffer_full` (backlog full
            too), `error` (anything else).
        windows_unanswered: Window requests without an answer (their energies are NaN).
        sync_failures: `torch.cuda.synchronize()` calls that raised (the event was sent).
        connected: Whether the socket is currently connected to an agent.
        detached: Whether `init` found no agent (or it did not answer).
    """

    events: int
    sent: int
    queued: int
    dropped: int
    dropped_by_reason: dict[str, int]
    windows_unanswered: int
    sync_failures: int
    connected: bool
    detached: bool


def _visible_devices(env: Any = None) -> list[int] | None:
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None or not value.strip():
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:  # UUIDs or MIG names: no integer mapping.
        return None


def physical_gpu_index(index: int, env: Any = None) -> int:
    """Map a CUDA device index of this process to the node's GPU index (what the agent uses).

    When `CUDA_VISIBLE_DEVICES` is a list of integers, CUDA index i is its i-th entry;
    otherwise (unset, or UUIDs) the index is returned unchanged. The agent numbers GPUs as
    NVML does (PCI bus order): set `CUDA_DEVICE_ORDER=PCI_BUS_ID` so both agree.

    Args:
        index: CUDA device index (as in `torch.device("cuda", index)`).
        env: Environment mapping to read (default `os.environ`).

    Raises:
        ValueError: `index` is negative or beyond the devices `CUDA_VISIBLE_DEVICES` lists.
    """
    if index < 0:
        raise ValueError(f"GPU index must be non-negative, got {index}")
    devices = _visible_devices(env)
    if devices is None:
        return index
    if index >= len(devices):
        value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"GPU index {index} is not visible: CUDA_VISIBLE_DEVICES={value!r} lists "
            f"{len(devices)} device(s); use an index below {len(devices)}"
        )
    return devices[index]


def _default_gpu_index() -> int:
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def _socket_path(socket_path: str | None) -> str:
    return socket_path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET_PATH


class Publisher:
    """One trainer process's connection to its node's agent.

    Event methods are the hot path: they stamp, count, encode and send on the caller's
    thread, never block and never raise (failures are counted; see `stats`). Requests
    (`register_job`, `hello`, `register_rank`, `measure`, `pop_window`) wait for the reply
    on the caller's thread for at most `timeout_s`.

    Counters: `step` counts `step_begin` calls from 0; `epoch` is 0 for the first epoch and
    increases after each `epoch_end`; the instruction index counts `instruction_begin` calls
    from 0. `*_end` events carry the index of the last begun step or instruction.
    """

    def __init__(
        self,
        *,
        socket_path: str | None = None,
        gpu_index: int | None = None,
        gpu_indices: Sequence[int] | None = None,
        sync_cuda: bool = False,
        timeout_s: float = 2.0,
        reconnect_interval_s: float = 1.0,
        backlog: int = 256,
    ) -> None:
        """Open the socket and try to connect (no request is sent).

        Args:
            socket_path: The agent's socket; default env `ZEUS_AGENT_SOCKET`, else
                `DEFAULT_SOCKET_PATH`.
            gpu_index: CUDA device index this process drives; default env `LOCAL_RANK`
                (else 0). Mapped to the node's index through `CUDA_VISIBLE_DEVICES`.
            gpu_indices: CUDA device indices that windows measure; default `[gpu_index]`.
            sync_cuda: Call `torch.cuda.synchronize()` before each stamp.
            timeout_s: How long requests wait for a reply.
            reconnect_interval_s: After a failure, try to reconnect at most this often.
            backlog: Events kept locally while the agent's queue is full.

        Raises:
            ValueError: An argument is out of range or a GPU index is not visible.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if backlog < 0:
            raise ValueError(f"backlog must be non-negative, got {backlog}")
        self.socket_path = _socket_path(socket_path)
        self.gpu_index = _default_gpu_index() if gpu_index is None else gpu_index
        self.gpu_indices = [self.gpu_index] if gpu_indices is None else list(gpu_indices)
        if not self.gpu_indices:
            raise ValueError("gpu_indices must not be empty")
        self.physical_gpu_index = physical_gpu_index(self.gpu_index)
        self.physical_gpu_indices = [physical_gpu_index(i) for i in self.gpu_indices]
        self.timeout_s = timeout_s
        self.job_id: str | None = None
        self.join_token: str | None = None
        """The job's join token (rank 0: from the registration; other ranks: from rank 0)."""
        self.rank = 0
        self.node: str | None = None
        self.detached = False

        self._pid = os.getpid()
        self._epoch = 0
        self._step = -1
        self._instruction = -1
        self._n = 0
        self._drops: dict[str, int] = {_NO_AGENT: 0, _BUFFER_FULL: 0, _ERROR: 0}
        self._windows_unanswered = 0
        self._sync_failures = 0
        self._warned_drops = False
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_max = backlog
        self._retry_interval_ns = int(reconnect_interval_s * 1e9)
        self._retry_at_ns = 0
        self._hello: TrainerHello | None = None
        self._rank_registration: RegisterRank | None = None
        self._ids = itertools.count(1)
        self._request_lock = threading.Lock()
        self._windows: list[tuple[str | None, int]] = []
        self._closed = False
        self._notice: ScheduleNotice | None = None

        self._sync: Callable[[], None] | None = None
        self._sync_device: Callable[[int], None] | None = None
        if sync_cuda:
            import torch  # Only when asked: importing torch is slow.

            self._sync = torch.cuda.synchronize
            self._sync_device = torch.cuda.synchronize

        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind("")  # Autobind to an abstract address: the agent replies there.
        self._send: Callable[[bytes], Any] = self._send_detached
        self.connected = False
        self._connect(_monotonic_ns())

    # ------------------------------------------------------------------ connection
    def _connect(self, now_ns: int) -> bool:
        self._retry_at_ns = now_ns + self._retry_interval_ns
        try:
            self._sock.connect(self.socket_path)
        except OSError:
            return False
        self._send = self._sock.send
        self.connected = True
        return True

    def _disconnect(self) -> None:
        self._send = self._send_detached
        self.connected = False
        self._retry_at_ns = _monotonic_ns() + self._retry_interval_ns
        if self._backlog:
            self._drops[_NO_AGENT] += len(self._backlog)
            self._backlog.clear()

    def _send_detached(self, data: bytes) -> None:
        """`_send` while disconnected: drop, unless it is time to try reconnecting."""
        now = _monotonic_ns()
        if now >= self._retry_at_ns and not self._closed and self._connect(now):
            self._rebind()
            self._send(data)  # Errors go to the caller's handler.
            return
        self._drops[_NO_AGENT] += 1
        self._first_drop()

    def _rebind(self) -> None:
        """Re-introduce the process to an agent found after a failure (no reply awaited)."""
        try:
            if self._request_lock.acquire(blocking=False):  # Never steal a waited-for reply.
                try:
                    self._drain_incoming()
                finally:
                    self._request_lock.release()
            if self._hello is not None:
                self._send(encode_request(Kind.HELLO, self._pid, next(self._ids), self._hello))
            if self._rank_registration is not None:
                self._send(
                    encode_request(
                        Kind.REGISTER_RANK, self._pid, next(self._ids), self._rank_registration
                    )
                )
        except OSError:
            pass  # The next event sees the same failure and handles it.

    def _failed(self, data: bytes, exc: Exception) -> None:
        """Slow path of an event send: classify, queue or drop, and count. Never raises."""
        try:
            if isinstance(exc, BlockingIOError):
                self._enqueue(data)
                return
            if isinstance(exc, OSError) and exc.errno in _NO_AGENT_ERRNOS:
                self._disconnect()
                self._drops[_NO_AGENT] += 1
            else:
                self._drops[_ERROR] += 1
                logger.debug("zeus_agent.emit: event send failed: %r", exc)
            self._first_drop()
        except Exception:  # the hot path must never raise.
            pass

    def _enqueue(self, data: bytes) -> None:
        """Flush the backlog, then send `data` or queue it (bounded)."""
        self._flush_backlog()
        if not self.connected:
            self._drops[_NO_AGENT] += 1
            return
        if not self._backlog:
            try:
                self._send(data)
                return
            except BlockingIOError:
                pass
            except OSError as e:
                self._failed(data, e)
                return
        if len(self._backlog) < self._backlog_max:
            self._backlog.append(data)
        else:
            self._drops[_BUFFER_FULL] += 1
            self._first_drop()

    def _flush_backlog(self) -> None:
        backlog = self._backlog
        send = self._sock.send
        while backlog and self.connected:
            try:
                send(backlog[0])
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _NO_AGENT_ERRNOS:
                    self._disconnect()  # Counts the backlog as dropped.
                    return
                self._drops[_ERROR] += 1
            backlog.popleft()

    def _first_drop(self) -> None:
        if not self._warned_drops:
            self._warned_drops = True
            if not self.detached:
                logger.warning(
                    "zeus_agent.emit: events to the agent at %s are being dropped (is it "
                    "running and keeping up?); training continues. See emit.stats().",
                    self.socket_path,
                )

    def flush(self) -> None:
        """Try to send events waiting in the backlog (never blocks, never raises)."""
        with contextlib.suppress(Exception):
            self._flush_backlog()

    # ------------------------------------------------------------------ hot path
    # The six event methods below repeat their few lines on purpose: a shared helper would
    # cost one more Python call (~0.1 us) on the training loop's hot path.
    def epoch_begin(self) -> None:
        """Mark the beginning of an epoch (a = epoch)."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        data = _encode(_EPOCH_BEGIN, self._pid, _monotonic_ns(), self._epoch, 0, "")
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def epoch_end(self) -> None:
        """Mark the end of an epoch (a = epoch); the next epoch is numbered one higher."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        epoch = self._epoch
        self._epoch = epoch + 1
        data = _encode(_EPOCH_END, self._pid, _monotonic_ns(), epoch, 0, "")
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def step_begin(self) -> None:
        """Mark the beginning of a training step (a = step, b = epoch)."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        self._step = step = self._step + 1
        data = _encode(_STEP_BEGIN, self._pid, _monotonic_ns(), step, self._epoch, "")
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def step_end(self) -> None:
        """Mark the end of the current training step (a = step, b = epoch)."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        step = self._step if self._step >= 0 else 0
        data = _encode(_STEP_END, self._pid, _monotonic_ns(), step, self._epoch, "")
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def instruction_begin(self, name: str) -> None:
        """Mark the beginning of a pipeline instruction (a = index, b = step, name)."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        self._instruction = index = self._instruction + 1
        step = self._step if self._step >= 0 else 0
        try:
            data = _encode(_INSTRUCTION_BEGIN, self._pid, _monotonic_ns(), index, step, name)
        except Exception:  # a name msgpack cannot encode.
            self._drops[_ERROR] += 1
            return
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def instruction_end(self, name: str) -> None:
        """Mark the end of the current pipeline instruction (a = index, b = step, name)."""
        try:
            if self._sync is not None:
                self._sync()
        except Exception:
            self._sync_failures += 1
        self._n += 1
        index = self._instruction if self._instruction >= 0 else 0
        step = self._step if self._step >= 0 else 0
        try:
            data = _encode(_INSTRUCTION_END, self._pid, _monotonic_ns(), index, step, name)
        except Exception:
            self._drops[_ERROR] += 1
            return
        if len(data) > MAX_DATAGRAM_BYTES:
            self._drops[_ERROR] += 1
            return
        try:
            if self._backlog:
                self._enqueue(data)
            else:
                self._send(data)
        except Exception as e:
            self._failed(data, e)

    def stats(self) -> PublisherStats:
        """Counters of this publisher (events sent, queued and dropped, by reason)."""
        drops = dict(self._drops)
        dropped = sum(drops.values())
        queued = len(self._backlog)
        return PublisherStats(
            events=self._n,
            sent=self._n - dropped - queued,
            queued=queued,
            dropped=dropped,
            dropped_by_reason=drops,
            windows_unanswered=self._windows_unanswered,
            sync_failures=self._sync_failures,
            connected=self.connected,
            detached=self.detached,
        )

    # ------------------------------------------------------------------ requests
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
        """Keep `raw` if it is a schedule notice for this publisher's rank."""
        if len(raw) < 3 or raw[2] != int(Kind.SCHEDULE):  # [1, kind, ...]: cheap pre-check
            return
        try:
            notice = decode_datagram(raw)
        except PayloadError as e:
            logger.warning("zeus_agent.emit: ignoring a bad schedule notice from the agent: %s", e)
            return
        if isinstance(notice, ScheduleNotice) and (
            self._notice is None or notice.version >= self._notice.version
        ):
            self._notice = notice

    @property
    def next_step(self) -> int:
        """The step counter the next `step_begin()` will carry (a running count from 0)."""
        return self._step + 1

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
                    if e.errno in _NO_AGENT_ERRNOS:
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
                    if e.errno in _NO_AGENT_ERRNOS:
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
        logical = self.gpu_indices if gpu_indices is None else list(gpu_indices)
        try:
            gpus = (
                self.physical_gpu_indices
                if gpu_indices is None
                else [physical_gpu_index(i) for i in logical]
            )
            request = WindowRequest(t0_ns=t0_ns, t1_ns=t1_ns, gpus=gpus, exact=exact)
            reply = self.request(Kind.WINDOW, request)
            old_agent = reply is not None and reply.code == "bad_request" and "exact" in reply.error
            if exact and old_agent:
                logger.info("zeus_agent.emit: the agent predates exact windows; measuring at once")
                reply = self.request(Kind.WINDOW, request.model_copy(update={"exact": False}))
        except Exception as e:  # measuring never raises into training.
            logger.warning("zeus_agent.emit: window request failed: %r", e)
            reply = None
        if reply is not None and reply.ok:
            energy = reply.result.get("energy_j")
            if isinstance(energy, list) and len(energy) == len(logical):
                return [float(e) for e in energy]
            logger.warning("zeus_agent.emit: malformed window reply: %s", reply.result)
        elif reply is not None:
            logger.warning(
                "zeus_agent.emit: the agent could not measure the window: [%s] %s",
                reply.code,
                reply.error,
            )
        self._windows_unanswered += 1
        return [math.nan] * len(logical)

    # ------------------------------------------------------------------ windows
    def _sync_windows(self) -> None:
        if self._sync_device is not None:
            for index in self.gpu_indices:
                self._sync_device(index)

    def push_window(self, name: str | None = None) -> None:
        """Open a profiling window (windows nest, like a stack).

        Args:
            name: Optional name; `pop_window(name)` checks it.
        """
        self._sync_windows()
        self._windows.append((name, _monotonic_ns()))

    def pop_window(self, name: str | None = None, exact: bool = False) -> ProfilingResult:
        """Close the innermost window and measure it.

        Args:
            name: When given, it must be the innermost window's name.
            exact: Wait for the counter read that brackets the window's end (see `measure`).

        Returns:
            Its time (s) and the energy (J) of each of the publisher's GPUs (NaN without an
            agent).

        Raises:
            RuntimeError: No window is open.
            ValueError: `name` is not the innermost window's name (the stack is unchanged).
        """
        self._sync_windows()
        t1 = _monotonic_ns()
        if not self._windows:
            raise RuntimeError("No profiling window active. Consider calling `push_window` first.")
        top, t0 = self._windows[-1]
        if name is not None and name != top:
            raise ValueError(
                f"pop_window({name!r}) does not match the innermost window {top!r}; windows "
                "nest: pop the innermost first"
            )
        self._windows.pop()
        return ProfilingResult(time=(t1 - t0) / 1e9, energy=self.measure(t0, t1, exact=exact))

    @contextlib.contextmanager
    def window(self, name: str | None = None) -> Iterator[_WindowHandle]:
        """Measure the block: `with pub.window("fwd") as w: ...`, then `w.result`."""
        handle = _WindowHandle(name)
        self.push_window(name)
        try:
            yield handle
        finally:
            handle.result = self.pop_window(name)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Flush the backlog (at most 0.1 s), send BYE (best effort), close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            deadline = time.monotonic() + 0.1  # Bounded: let the agent take the backlog.
            self._flush_backlog()
            while self._backlog and self.connected and time.monotonic() < deadline:
                select.select([], [self._sock], [], 0.01)
                self._flush_backlog()
            if self.connected:
                self._sock.send(encode_request(Kind.BYE, self._pid, next(self._ids), {}))
        except Exception:  # Best effort.
            pass
        self._send = self._send_detached
        self.connected = False
        self._sock.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _WindowHandle:
    """What `Publisher.window` yields; `result` is set when the block exits."""

    name: str | None
    result: ProfilingResult | None = field(default=None)


# ---------------------------------------------------------------------- default publisher
_default: Publisher | None = None
_default_lock = threading.Lock()


def get_publisher() -> Publisher:
    """The default publisher (created, unregistered, on first use if `init` was not called)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Publisher()
                if not _default.connected:
                    _warn_no_agent(_default)
                    _default.detached = True
    return _default


def _warn_no_agent(publisher: Publisher, why: str = "no agent listens there") -> None:
    logger.warning(
        "zeus_agent.emit: cannot reach the node agent at %s (%s); training continues without "
        "energy measurement or optimisation and events are dropped (see zeus_agent.emit.stats()). "
        "Start one with `zeus-agent run --backend sim` (or --backend nvml on a GPU node) or point "
        "%s at its socket.",
        publisher.socket_path,
        why,
        ENV_SOCKET,
    )


def _distributed() -> Any | None:
    """`torch.distributed` when it is imported and initialised with several ranks."""
    dist = sys.modules.get("torch.distributed")
    try:
        if (
            dist is not None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            return dist
    except Exception:
        return None
    return None


def _default_rank() -> int:
    dist = _distributed()
    if dist is not None:
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def init(
    *,
    job_id: str | None = None,
    join_token: str | None = None,
    job_info: JobInfo | None = None,
    power_limit: PowerLimitOptions | None = None,
    rank: int | None = None,
    dp_rank: int = 0,
    pp_rank: int = 0,
    tp_rank: int = 0,
    gpu_index: int | None = None,
    gpu_indices: Sequence[int] | None = None,
    socket_path: str | None = None,
    sync_cuda: bool = False,
    timeout_s: float = 2.0,
    scheduler: str | None = None,
) -> Publisher:
    """Create the default publisher and register this process with its node's agent.

    Order: rank 0 registers the job (`job_info`; relayed to the coordinator) and gets its id
    and join token, broadcast to the other ranks when `torch.distributed` is initialised (else
    pass `job_id` and `join_token` on them: see `Publisher.job_id` and `Publisher.join_token`
    on rank 0); then every rank sends HELLO (binds this pid to its job rank and GPU) and
    REGISTER_RANK (`RankInfo` with the GPU's SM clocks, and the GPU binding). Without a job,
    nothing is registered and the publisher only measures windows and sends events.

    If no agent answers, this logs a warning once (how to start one, the socket tried) and
    returns a detached publisher: events are dropped and counted, windows measure NaN.

    Args:
        job_id: The job's id, when it is registered already (ranks other than 0).
        join_token: The job's join token, with `job_id` (rank 0's `Publisher.join_token`): the
            coordinator accepts a rank only with it, so a process that learnt or guessed the
            job id cannot take one of its ranks. Keep it as private as the job's other secrets.
        job_info: The job's parallelism degrees; rank 0 registers it.
        power_limit: Run the coordinator's power-limit optimizer with these options.
        rank: Global rank; default `torch.distributed`'s rank, else env `RANK`, else 0.
        dp_rank: Data-parallel rank.
        pp_rank: Pipeline-parallel rank.
        tp_rank: Tensor-parallel rank.
        gpu_index: CUDA device index this process drives; default env `LOCAL_RANK`, else 0
            (mapped to the node's index through `CUDA_VISIBLE_DEVICES`).
        gpu_indices: CUDA device indices windows measure; default `[gpu_index]`.
        socket_path: The agent's socket; default env `ZEUS_AGENT_SOCKET`, else
            `DEFAULT_SOCKET_PATH`.
        sync_cuda: `torch.cuda.synchronize()` before each stamp.
        timeout_s: How long each request waits for the agent's reply.
        scheduler: Scheduler name for the job registration (default the coordinator's).

    Returns:
        The new default publisher (a previous one is closed).

    Raises:
        RegistrationError: The coordinator or the agent refused the job, the rank or the
            binding (its `code` says why).
        ValueError: Bad arguments: a GPU index that is not visible, or no `job_id` (or no
            `join_token`) on a rank other than 0 without `torch.distributed`.
    """
    global _default
    rank = _default_rank() if rank is None else rank
    publisher = Publisher(
        socket_path=socket_path,
        gpu_index=gpu_index,
        gpu_indices=gpu_indices,
        sync_cuda=sync_cuda,
        timeout_s=timeout_s,
    )
    with _default_lock:
        previous, _default = _default, publisher
    if previous is not None:
        previous.close()
    publisher.rank = rank
    if not publisher.connected:
        _warn_no_agent(publisher)
        publisher.detached = True

    error: tuple[str, str, str] | None = None
    if job_info is not None and rank == 0 and job_id is None and publisher.connected:
        try:
            job_id = publisher.register_job(job_info, power_limit, scheduler)
            join_token = publisher.join_token
        except RegistrationError as e:
            error = (e.what, e.code, e.message)
        if job_id is None and error is None:
            _warn_no_agent(publisher, f"no reply within {timeout_s} s")
            publisher.detached = True
    dist = _distributed() if job_info is not None else None
    if dist is not None:
        box: list[Any] = [(job_id, join_token, error)]
        dist.broadcast_object_list(box, src=0)
        job_id, join_token, error = box[0]
    if error is not None:
        raise RegistrationError(*error)
    if dist is not None and job_id is None and rank != 0:
        # Rank 0 could not register the job (no agent answered it): like rank 0, run on
        # unregistered (events are still sent; nothing is optimised).
        logger.warning(
            "zeus_agent.emit: rank 0 could not register the job (its agent did not answer); "
            "rank %d runs unregistered: nothing is optimised", rank
        )
        return publisher
    if job_info is not None and job_id is None and rank != 0 and not publisher.detached:
        raise ValueError(
            f"rank {rank} needs the job id: pass init(job_id=...) or initialise "
            "torch.distributed so rank 0 can broadcast it"
        )
    if job_id is not None and join_token is None:
        raise ValueError(
            f"rank {rank} needs the job's join token with its id: pass init(job_id=..., "
            "join_token=...) with rank 0's Publisher.join_token, or initialise "
            "torch.distributed so rank 0 can broadcast both"
        )
    if job_id is None:
        return publisher

    publisher.job_id = job_id
    publisher.join_token = join_token
    hello = TrainerHello(
        job_id=job_id,
        join_token=join_token,
        rank=rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        tp_rank=tp_rank,
        gpu_index=publisher.physical_gpu_index,
    )
    if publisher.detached:
        publisher._hello = hello  # Re-sent when an agent shows up.
        return publisher
    reply = publisher.hello(hello)
    if reply is None:
        _warn_no_agent(publisher, f"no reply to HELLO within {timeout_s} s")
        publisher.detached = True
        return publisher
    clocks = reply.result.get("supported_graphics_clocks_mhz", [])
    node = reply.result.get("node")
    if not isinstance(node, str) or not node:
        raise RegistrationError("hello", "internal", f"the agent's reply names no node: {reply}")
    registration = RegisterRank(
        job_id=job_id,
        join_token=join_token,
        rank_info=RankInfo(
            rank=rank,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            available_frequencies=[int(c) for c in clocks],
        ),
        gpu=GpuBinding(
            node=node,
            gpu_index=publisher.physical_gpu_index,
            gpu_uuid=str(reply.result.get("gpu_uuid", "") or ""),
        ),
    )
    if publisher.register_rank(registration) is None:
        _warn_no_agent(publisher, f"no reply to REGISTER_RANK within {timeout_s} s")
        publisher.detached = True
    return publisher


def _close_default() -> None:
    publisher = _default
    if publisher is not None:
        publisher.close()


atexit.register(_close_default)


# ---------------------------------------------------------------------- module-level calls
def epoch_begin() -> None:
    """Mark the beginning of an epoch on the default publisher."""
    (_default or get_publisher()).epoch_begin()


def epoch_end() -> None:
    """Mark the end of an epoch on the default publisher."""
    (_default or get_publisher()).epoch_end()


def step_begin() -> None:
    """Mark the beginning of a training step on the default publisher."""
    (_default or get_publisher()).step_begin()


def step_end() -> None:
    """Mark the end of a training step on the default publisher."""
    (_default or get_publisher()).step_end()


def instruction_begin(name: str) -> None:
    """Mark the beginning of a pipeline instruction on the default publisher."""
    (_default or get_publisher()).instruction_begin(name)


def instruction_end(name: str) -> None:
    """Mark the end of a pipeline instruction on the default publisher."""
    (_default or get_publisher()).instruction_end(name)


def push_window(name: str | None = None) -> None:
    """Open a profiling window on the default publisher (see `Publisher.push_window`)."""
    get_publisher().push_window(name)


def pop_window(name: str | None = None, exact: bool = False) -> ProfilingResult:
    """Close and measure the innermost window (see `Publisher.pop_window`).

    Raises:
        RuntimeError: No window is open.
        ValueError: `name` is not the innermost window's name.
    """
    return get_publisher().pop_window(name, exact)


@contextlib.contextmanager
def window(name: str | None = None) -> Iterator[_WindowHandle]:
    """Measure a block on the default publisher; the handle's `result` is set at exit."""
    with get_publisher().window(name) as handle:
        yield handle


def stats() -> PublisherStats:
    """Counters of the default publisher."""
    return get_publisher().stats()


def close() -> None:
    """Close the default publisher (sends BYE); a later call creates a fresh one."""
    global _default
    with _default_lock:
        publisher, _default = _default, None
    if publisher is not None:
        publisher.close()
