"""The module-level API: the process's default publisher, `init`, and the calls that use it.

A training script calls `emit.init(...)` once and then `emit.step_begin()` and friends; those
delegate to one default `Publisher` kept here (created unregistered on first use if `init` was
not called, closed at exit). `init` also does the registration sequence with the agent and,
under `torch.distributed`, shares the job's id and join token from rank 0. The event calls
read the default from this module's globals (`_default or get_publisher()`): one global load
and one call above the method itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from zeus_agent.emit.environment import ENV_SOCKET
from zeus_agent.emit.publisher import Publisher
from zeus_agent.emit.records import (
    ProfilingResult,
    PublisherStats,
    RegistrationError,
    WindowHandle,
)
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire.messages import GpuBinding, PowerLimitOptions, RegisterRank
from zeus_agent.wire.trainer import TrainerHello

logger = logging.getLogger("zeus_agent.emit")

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
    rank = _default_rank() if rank is None else rank
    publisher = _new_default(socket_path, gpu_index, gpu_indices, sync_cuda, timeout_s, rank)
    job_id, join_token = _job_credentials(
        publisher, rank, job_id, join_token, job_info, power_limit, scheduler, timeout_s
    )
    if job_id is not None:
        _join_job(publisher, job_id, join_token, rank, dp_rank, pp_rank, tp_rank, timeout_s)
    return publisher


def _new_default(
    socket_path: str | None,
    gpu_index: int | None,
    gpu_indices: Sequence[int] | None,
    sync_cuda: bool,
    timeout_s: float,
    rank: int,
) -> Publisher:
    """`init`'s new default publisher (the previous one is closed); detached without agent."""
    global _default
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
    return publisher


def _job_credentials(
    publisher: Publisher,
    rank: int,
    job_id: str | None,
    join_token: str | None,
    job_info: JobInfo | None,
    power_limit: PowerLimitOptions | None,
    scheduler: str | None,
    timeout_s: float,
) -> tuple[str | None, str | None]:
    """The job's id and join token for `init` (None: this rank runs unregistered).

    Rank 0 registers the job when it has `job_info` and no id; under `torch.distributed`
    it broadcasts the id, the token and its registration error to the other ranks.

    Raises:
        RegistrationError: The job's registration was refused (on every rank).
        ValueError: A rank other than 0 lacks the job id, or the id lacks its join token.
    """
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
        return None, None
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
    return job_id, join_token


def _join_job(
    publisher: Publisher,
    job_id: str,
    join_token: str | None,
    rank: int,
    dp_rank: int,
    pp_rank: int,
    tp_rank: int,
    timeout_s: float,
) -> None:
    """`init`'s HELLO and REGISTER_RANK for this rank of job `job_id`.

    A detached publisher keeps the HELLO for when an agent shows up; one whose agent stops
    answering becomes detached.

    Raises:
        RegistrationError: The agent refused the rank or the binding, or named no node.
    """
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
        publisher.remember_hello(hello)  # Sent when an agent shows up.
        return
    reply = publisher.hello(hello)
    if reply is None:
        _warn_no_agent(publisher, f"no reply to HELLO within {timeout_s} s")
        publisher.detached = True
        return
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
def window(name: str | None = None) -> Iterator[WindowHandle]:
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
