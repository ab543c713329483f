"""A drop-in for Zeus 0.16's `zeus.optimizer.perseus.PerseusOptimizer`, run by the coordinator.

The trainer registers and reports; the coordinator runs the pipeline frequency scheduler and
the node's agent pushes this rank's frequency schedule to the trainer's socket. The agent sets
the SM clock itself when it sees `instruction_begin` (the trainer needs no SYS_ADMIN and does
not set clocks); this class only checks, as Zeus 0.16 does, that the instructions the training
loop runs match the schedule, with Zeus's exact `RuntimeError` messages.

* `PerseusOptimizer` (alias `PipelineFrequencyOptimizer`): Zeus 0.16's constructor; rank 0
  registers the job (no power-limit options: the coordinator's configured scheduler runs) and
  every rank registers through `zeus_agent.emit.init`; `on_step_begin`, `on_step_end`,
  `on_instruction_begin(name)`, `on_instruction_end(name)` emit the matching events.
* `socket_path_from_url(server_url)`: the agent socket a `unix:///path` URL names (None for
  any other URL: Zeus configs carry the Perseus server's http URL, which is not used here).

Schedules: at `on_step_begin` the drop-in reads the newest schedule notice the agent pushed
(`Publisher.latest_schedule()`, non-blocking). A notice with `from_step = S` becomes active at
the step whose `step_begin` carries a step number >= S (`Publisher.next_step`, checked before
the event is sent). Until a schedule is active (the coordinator first observes an iteration to
learn the instruction order), instructions run at the GPU's current clocks and nothing is
checked. Once active, each iteration must run exactly the schedule's instructions, in order.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from zeus_agent import emit
from zeus_agent.integrations.registration import join_or_warn
from zeus_agent.models import JobInfo
from zeus_agent.wire.trainer import ScheduleNotice

__all__ = ["PerseusOptimizer", "PipelineFrequencyOptimizer", "socket_path_from_url"]

logger = logging.getLogger(__name__)

_warned_http = False


def socket_path_from_url(server_url: str) -> str | None:
    """The agent socket a `unix://` URL names, else None.

    `unix:///run/zeus-agent/agent.sock` -> `/run/zeus-agent/agent.sock`; a relative form
    `unix://agent.sock` names `agent.sock`. Percent-escapes are decoded.

    Raises:
        ValueError: A `unix://` URL without a path.
    """
    parts = urlsplit(server_url.strip())
    if parts.scheme.lower() != "unix":
        return None
    path = unquote(parts.netloc + parts.path)
    if not path:
        raise ValueError(f"server_url {server_url!r} names no socket path (unix:///path/to.sock)")
    return path


def _default_sync_cuda() -> bool:
    """Whether torch is imported, CUDA is available and already initialised (never imports)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def _url_socket(server_url: str, socket_path: str | None) -> str | None:
    """The agent socket `server_url` names (`socket_path_from_url`); warns once if none.

    Raises:
        ValueError: `socket_path` and a `unix://` `server_url` name different sockets.
    """
    global _warned_http
    url_path = socket_path_from_url(server_url)
    if url_path is None:
        if not _warned_http:
            _warned_http = True
            logger.warning(
                "PerseusOptimizer: server_url %r is not used: the node's Zeus agent relays "
                "to the coordinator (pass unix:///path/to/agent.sock to name its socket).",
                server_url,
            )
    elif socket_path is not None and socket_path != url_path:
        raise ValueError(
            f"socket_path {socket_path!r} and server_url {server_url!r} name different "
            "agent sockets; pass one of them"
        )
    return url_path


def _init_publisher(**kwargs: Any) -> emit.Publisher:
    """`emit.init(**kwargs)`; an unreachable coordinator or an unregistered job only warns."""
    return join_or_warn(logger, "PerseusOptimizer", "at the GPUs' current clocks", **kwargs)


class PerseusOptimizer:
    """Perseus's pipeline frequency optimizer (Zeus 0.16's callback API; the coordinator plans).

    Call `on_step_begin()`/`on_step_end()` around every training iteration and
    `on_instruction_begin(name)`/`on_instruction_end(name)` around every pipeline instruction
    ("forward", "backward").

    Attributes:
        rank, dp_rank, pp_rank, tp_rank: This process's position in the job.
        device_id: CUDA device index of this process's GPU.
        server_url: As passed (only a `unix://` URL is used: the agent's socket).
        job_id: The job's id (None when the job could not be registered).
        join_token: The job's join token, which every rank presents with the id.
        publisher: The `zeus_agent.emit.Publisher` the events go through.
    """

    def __init__(
        self,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int,
        device_id: int,
        dp_degree: int,
        pp_degree: int,
        tp_degree: int,
        world_size: int,
        server_url: str,
        job_metadata: str | None = None,
        *,
        job_id: str | None = None,
        join_token: str | None = None,
        socket_path: str | None = None,
        sync_cuda: bool | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Register the job (rank 0) and this rank with the coordinator, through the agent.

        Args:
            rank: Global rank of this process.
            dp_rank: Data parallel rank.
            pp_rank: Pipeline parallel rank (stage).
            tp_rank: Tensor parallel rank.
            device_id: CUDA device index this process drives (mapped to the node's GPU
                index through `CUDA_VISIBLE_DEVICES`).
            dp_degree: Data parallel degree.
            pp_degree: Pipeline parallel degree.
            tp_degree: Tensor parallel degree.
            world_size: World size; must equal dp * pp * tp.
            server_url: `unix:///path/agent.sock` names the node agent's socket; any other
                URL (a Perseus server's http URL in Zeus configs) is not used: one warning
                is logged and the node's agent is used (env `ZEUS_AGENT_SOCKET`, else the
                default socket).
            job_metadata: Free text appended to the job id.
            job_id: The job's id on ranks other than 0 when `torch.distributed` is not
                initialised (with it, rank 0 broadcasts the id and the join token).
            join_token: The job's join token, with `job_id` (rank 0's `join_token`).
            socket_path: The agent's socket; overrides the default (not a `unix://` URL).
            sync_cuda: `torch.cuda.synchronize()` before each event; default: when torch is
                imported and CUDA is available and initialised.
            timeout_s: How long each registration request waits for the agent's reply.

        Raises:
            ValueError: Inconsistent degrees, a GPU index that is not visible, `socket_path`
                and a `unix://` `server_url` naming different sockets, or no `job_id` on a
                rank other than 0 without `torch.distributed`.
            zeus_agent.emit.RegistrationError: The coordinator refused the job or the rank
                (other than being unreachable, which only warns: training runs unoptimised).
        """
        self.rank = rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.device_id = device_id
        self.server_url = server_url
        url_path = _url_socket(server_url, socket_path)
        self.job_info = JobInfo(
            pp_degree=pp_degree, dp_degree=dp_degree, tp_degree=tp_degree,
            world_size=world_size, job_metadata=job_metadata)
        self.publisher: emit.Publisher = _init_publisher(
            job_id=job_id, join_token=join_token, job_info=self.job_info, rank=rank,
            dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_index=device_id,
            socket_path=socket_path or url_path,
            sync_cuda=_default_sync_cuda() if sync_cuda is None else sync_cuda,
            timeout_s=timeout_s, scheduler=None)
        self.job_id: str | None = self.publisher.job_id
        self.join_token: str | None = self.publisher.join_token
        self._pending: ScheduleNotice | None = None
        self._version: int | None = None
        self._schedule: list[tuple[str, int]] = []
        self._iter: Iterator[tuple[str, int]] | None = None
        self._frequency: int | None = None

    # ------------------------------------------------------------------ schedule state
    @property
    def schedule(self) -> list[tuple[str, int]]:
        """The active schedule's (instruction, SM frequency MHz) pairs; [] before any."""
        return list(self._schedule)

    @property
    def frequency(self) -> int | None:
        """The active schedule's SM frequency (MHz) for the instruction begun last; else None.

        The agent locks the GPU's SM clock at this frequency when it receives the
        instruction's `instruction_begin`.
        """
        return self._frequency

    @property
    def schedule_version(self) -> int | None:
        """Version of the active schedule; None before any."""
        return self._version

    def _poll(self) -> None:
        """Take the newest pushed notice and activate a pending one whose step has come."""
        notice = self.publisher.latest_schedule()
        if notice is not None and (self._version is None or notice.version > self._version):
            if notice.rank != self.rank:
                raise RuntimeError(
                    f"Perseus server returned a schedule for rank {notice.rank} to rank {self.rank}"
                )
            self._pending = notice
        pending = self._pending
        if pending is not None and self.publisher.next_step >= pending.from_step:
            self._pending = None
            self._version = pending.version
            self._schedule = [(str(name), int(freq)) for name, freq in pending.frequencies]
            self._iter = iter(self._schedule)

    # ------------------------------------------------------------------ callbacks
    def on_step_begin(self) -> None:
        """Mark the beginning of a step (activates a pushed schedule whose step has come)."""
        self._poll()
        self.publisher.step_begin()

    def on_step_end(self) -> None:
        """Mark the end of a step.

        Raises:
            RuntimeError: A schedule is active and the iteration left some of its
                instructions unrun (Zeus 0.16's message).
        """
        self.publisher.step_end()
        if self._iter is None:
            return
        # The schedule holds one iteration's worth of frequencies: it must be exhausted now.
        item = next(self._iter, None)
        if item is not None:
            raise RuntimeError(
                "Perseus server returned more frequencies than expected. "
                f"Next expected instruction and frequency is {item}"
            )
        self._iter = iter(self._schedule)

    def on_instruction_begin(self, name: str) -> None:
        """Mark the beginning of an instruction, like forward and backward.

        The agent sets the schedule's frequency for it when it receives the event.

        Raises:
            RuntimeError: A schedule is active and has no instruction left in this iteration,
                or its next instruction is not `name` (Zeus 0.16's messages).
        """
        if self._iter is not None:
            item = next(self._iter, None)
            if item is None:
                raise RuntimeError("Perseus server returned fewer frequencies than expected")
            instruction, frequency = item
            if instruction != name:
                raise RuntimeError(f"The next expected instruction is not forward: {instruction}")
            self._frequency = frequency
        self.publisher.instruction_begin(name)

    def on_instruction_end(self, name: str) -> None:
        """Mark the end of an instruction, like forward and backward."""
        self.publisher.instruction_end(name)

    def close(self) -> None:
        """Close the publisher (the agent releases this rank's GPU settings)."""
        self.publisher.close()


PipelineFrequencyOptimizer = PerseusOptimizer
"""Another name of `PerseusOptimizer`."""
