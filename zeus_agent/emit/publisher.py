"""`Publisher`: the event hot path a training loop calls every step, over three collaborators.

The six event methods stamp `time.monotonic_ns()` on the caller's thread, count, encode and
hand the datagram to `Transport.send` (a socket's own `send` while connected and nothing
waits) directly; they never block and never raise. They read only module globals and
attributes of the publisher and its transport, so this module is the whole cost of an event.
The rest of `Publisher` delegates: to its `Transport` (`transport.py`: the socket, backlog,
drops, reconnecting, close), its `Requests` (`requests.py`: requests with a reply,
registrations, windows' energy, schedule notices) and its `Windows` (`windows.py`: the stack
of profiling windows). The constructor builds them, each from what it needs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from zeus_agent.emit.environment import default_gpu_index, physical_gpu_index, resolve_socket_path
from zeus_agent.emit.records import ProfilingResult, PublisherStats, WindowEnergy, WindowHandle
from zeus_agent.emit.requests import Requests
from zeus_agent.emit.transport import ERROR, Transport
from zeus_agent.emit.windows import Windows
from zeus_agent.models import JobInfo
from zeus_agent.wire.messages import PowerLimitOptions, RegisterRank, Reply
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
        path = resolve_socket_path(socket_path)
        self.gpu_index = default_gpu_index() if gpu_index is None else gpu_index
        self.gpu_indices = [self.gpu_index] if gpu_indices is None else list(gpu_indices)
        if not self.gpu_indices:
            raise ValueError("gpu_indices must not be empty")
        self.physical_gpu_index = physical_gpu_index(self.gpu_index)
        self.physical_gpu_indices = [physical_gpu_index(i) for i in self.gpu_indices]

        # The hot path's counters (this module).
        self._pid = os.getpid()
        self._epoch = 0
        self._step = -1
        self._instruction = -1
        self._n = 0
        self._sync_failures = 0
        self._unsendable = 0
        """Events never sent: a name msgpack cannot encode, or too long (counted as `error`)."""
        self._sync: Callable[[], None] | None = None
        sync_device: Callable[[int], None] | None = None
        if sync_cuda:
            import torch  # Only when asked: importing torch is slow.

            self._sync = torch.cuda.synchronize
            sync_device = torch.cuda.synchronize

        ids = itertools.count(1)  # Request ids: the requests' and the goodbye's.
        self._detached = False
        """`detached`: the transport asks it before it warns about dropped events."""
        self._transport = Transport(
            path,
            pid=self._pid,
            ids=ids,
            backlog=backlog,
            reconnect_interval_s=reconnect_interval_s,
            on_reconnect=self._reintroduce,
            detached=lambda: self._detached,
        )
        self._requests = Requests(
            self._transport,
            pid=self._pid,
            ids=ids,
            timeout_s=timeout_s,
            gpu_indices=self.gpu_indices,
            physical_gpu_indices=self.physical_gpu_indices,
        )
        self._windows = Windows(self.measure, self.gpu_indices, sync_device)

    def _reintroduce(self) -> None:
        """The transport found the agent again: introduce the process (`on_reconnect`).

        A method of the publisher because the transport is built before the requests.
        """
        self._requests.reintroduce()

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
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

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
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

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
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

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
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

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
            self._unsendable += 1
            return
        try:
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

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
            self._unsendable += 1
            return
        if len(data) > MAX_DATAGRAM_BYTES:
            self._unsendable += 1
            return
        try:
            self._transport.send(data)
        except Exception as e:
            self._transport.failed(data, e)

    def stats(self) -> PublisherStats:
        """Counters of this publisher (events sent, queued and dropped, by reason)."""
        transport = self._transport
        drops = transport.dropped_by_reason()
        drops[ERROR] += self._unsendable
        dropped = sum(drops.values())
        queued = transport.queued
        return PublisherStats(
            events=self._n,
            sent=self._n - dropped - queued,
            queued=queued,
            dropped=dropped,
            dropped_by_reason=drops,
            windows_unanswered=self._requests.windows_unanswered,
            sync_failures=self._sync_failures,
            connected=transport.connected,
            detached=self._detached,
        )

    # ------------------------------------------------------------------ delivery (transport.py)
    @property
    def socket_path(self) -> str:
        """The agent's socket."""
        return self._transport.socket_path

    @property
    def connected(self) -> bool:
        """Whether the socket is connected to an agent."""
        return self._transport.connected

    @property
    def detached(self) -> bool:
        """Whether the process runs without an agent on purpose (`init` found none).

        Dropped events are then expected: they are counted but not warned about.
        """
        return self._detached

    @detached.setter
    def detached(self, value: bool) -> None:
        self._detached = value

    def flush(self) -> None:
        """Try to send events waiting in the backlog (never blocks, never raises)."""
        self._transport.flush()

    def close(self) -> None:
        """Flush the backlog (at most 0.1 s), send BYE (best effort), close. Idempotent."""
        self._transport.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests (requests.py)
    @property
    def timeout_s(self) -> float:
        """How long requests wait for a reply, by default."""
        return self._requests.session.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._requests.carry(timeout_s=value)

    @property
    def job_id(self) -> str | None:
        """The job this rank is bound to (`init` or the HELLO sets it), or None."""
        return self._requests.session.job_id

    @job_id.setter
    def job_id(self, value: str | None) -> None:
        self._requests.carry(job_id=value)

    @property
    def join_token(self) -> str | None:
        """The job's join token (rank 0: from the registration; other ranks: from rank 0)."""
        return self._requests.session.join_token

    @join_token.setter
    def join_token(self, value: str | None) -> None:
        self._requests.carry(join_token=value)

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 until `init` or the HELLO sets it)."""
        return self._requests.session.rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._requests.carry(rank=value)

    @property
    def node(self) -> str | None:
        """The agent's node, as the HELLO reply named it, or None."""
        return self._requests.session.node

    def remember_hello(self, hello: TrainerHello) -> None:
        """Keep `hello` to send when an agent shows up (`init` with no agent yet)."""
        self._requests.remember_hello(hello)

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
        return self._requests.request(kind, payload, timeout_s)

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
        return self._requests.register_job(job_info, power_limit, scheduler)

    def hello(self, hello: TrainerHello) -> Reply | None:
        """Bind this process to a job rank and GPU on the agent.

        Returns:
            The agent's reply (its `result` names the node and the GPU's clocks), or None
            when no agent answered.

        Raises:
            RegistrationError: The agent refused the binding.
        """
        return self._requests.hello(hello)

    def register_rank(self, registration: RegisterRank) -> Reply | None:
        """Register this rank and its GPU with the coordinator, through the agent.

        Returns:
            The reply, or None when no agent answered.

        Raises:
            RegistrationError: The coordinator refused the rank.
        """
        return self._requests.register_rank(registration)

    def latest_schedule(self) -> ScheduleNotice | None:
        """The newest frequency schedule the agent pushed for this rank (non-blocking).

        The agent applies the frequencies itself; a drop-in uses this to check instruction
        names locally. None until the coordinator has installed a schedule.
        """
        return self._requests.latest_schedule()

    def pending_selection(self) -> SelectRequest | None:
        """The coordinator's unanswered question to this rank, if one came (non-blocking).

        Asked of rank 0 of a job with a custom optimum selector, once profiling is over.
        """
        return self._requests.pending_selection()

    def answer_selection(self, question: SelectRequest, power_limit_w: int | None,
                         error: str = "") -> Reply | None:
        """Answer the coordinator's question with the chosen limit, or why there is none."""
        return self._requests.answer_selection(question, power_limit_w, error)

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
        return self._requests.measure_window(t0_ns, t1_ns, gpu_indices, exact, cpu_indices)

    # ------------------------------------------------------------------ windows (windows.py)
    def push_window(self, name: str | None = None) -> None:
        """Open a profiling window (windows nest, like a stack).

        Args:
            name: Optional name; `pop_window(name)` checks it.
        """
        self._windows.push_window(name)

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
        return self._windows.pop_window(name, exact)

    @contextlib.contextmanager
    def window(self, name: str | None = None) -> Iterator[WindowHandle]:
        """Measure the block: `with pub.window("fwd") as w: ...`, then `w.result`."""
        handle = WindowHandle(name)
        self.push_window(name)
        try:
            yield handle
        finally:
            handle.result = self.pop_window(name)
