"""`Publisher`: its constructor and the event hot path a training loop calls every step.

The six event methods stamp `time.monotonic_ns()` on the caller's thread, count, encode and
send at once; they never block and never raise. They read only module globals and instance
attributes and call `_send` (a socket's own `send` while connected) directly, so this
module is the whole cost of an event: the socket, backlog and drop handling they fall back on
live in `transport.py`, requests in `requests.py`, windows in `windows.py`, all base classes
of `Publisher` whose state this constructor sets.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from zeus_agent.emit.environment import default_gpu_index, physical_gpu_index, resolve_socket_path
from zeus_agent.emit.records import PublisherStats
from zeus_agent.emit.transport import BUFFER_FULL, ERROR, NO_AGENT
from zeus_agent.emit.windows import Windows
from zeus_agent.wire.messages import RegisterRank
from zeus_agent.wire.trainer import (
    MAX_DATAGRAM_BYTES,
    Kind,
    ScheduleNotice,
    SelectRequest,
    TrainerHello,
    encode_event,
)

_EPOCH_BEGIN = int(Kind.EPOCH_BEGIN)
_EPOCH_END = int(Kind.EPOCH_END)
_STEP_BEGIN = int(Kind.STEP_BEGIN)
_STEP_END = int(Kind.STEP_END)
_INSTRUCTION_BEGIN = int(Kind.INSTRUCTION_BEGIN)
_INSTRUCTION_END = int(Kind.INSTRUCTION_END)

_monotonic_ns = time.monotonic_ns
_encode = encode_event


class Publisher(Windows):
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
        self.socket_path = resolve_socket_path(socket_path)
        self.gpu_index = default_gpu_index() if gpu_index is None else gpu_index
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

        # The hot path's counters (this module).
        self._pid = os.getpid()
        self._epoch = 0
        self._step = -1
        self._instruction = -1
        self._n = 0
        self._sync_failures = 0
        # Delivery (transport.py).
        self._drops: dict[str, int] = {NO_AGENT: 0, BUFFER_FULL: 0, ERROR: 0}
        self._warned_drops = False
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_max = backlog
        self._retry_interval_ns = int(reconnect_interval_s * 1e9)
        self._retry_at_ns = 0
        self._closed = False
        # Requests (requests.py) and windows (windows.py).
        self._windows_unanswered = 0
        self._hello: TrainerHello | None = None
        self._rank_registration: RegisterRank | None = None
        self._ids = itertools.count(1)
        self._request_lock = threading.Lock()
        self._windows: list[tuple[str | None, int]] = []
        self._notice: ScheduleNotice | None = None
        self._selection: SelectRequest | None = None
        self._doorbell: str | None = None
        """The bound GPU's doorbell (the HELLO reply's): events go there (`transport.py`)."""
        self._bell: socket.socket | None = None

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

    @property
    def next_step(self) -> int:
        """The step counter the next `step_begin()` will carry (a running count from 0)."""
        return self._step + 1

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
            self._drops[ERROR] += 1
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
            self._drops[ERROR] += 1
            return
        if len(data) > MAX_DATAGRAM_BYTES:
            self._drops[ERROR] += 1
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

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
