"""A simulated synchronous-1F1B pipeline-parallel trainer: real processes, simulated GPUs.

One process per (data-parallel replica, pipeline stage) (tensor parallelism 1). Each opens its
simulated GPU (`SimGPU.open` on the state directory its node's agent created), registers with
`PerseusOptimizer` (rank 0 registers the job; the launcher hands its id to the others) and runs
synchronous 1F1B iterations. Stages wait for each other for real through pipes: a forward waits
for the previous stage's activation of its microbatch, a backward for the next stage's
gradient. Each instruction's work is `gpu.run_work(stage_workload[name], scale)` at whatever SM
clock the agent locked, then a sleep of its duration. At the end of an iteration every rank
meets at a barrier (the gradient all-reduce and optimizer step), then `on_step_end()`.

* `one_f_one_b(stage, num_stages, microbatches)`: one stage's instruction order, pure.
* `waits_for(stage, num_stages, instruction)`: the stage whose message an instruction waits
  for, pure.
* `timeline(num_stages, microbatches, duration)`: start and end of every instruction of one
  iteration when each takes `duration(stage, name)`, pure (what the processes do, without
  noise).
* `NodeSpec`, `RankPlacement`, `place_ranks(nodes, stages, dp)`: where ranks run. Ranks are
  numbered as Megatron-LM numbers them with TP = 1: `rank = stage * dp + dp_index`; they take
  the nodes' GPUs in order (first node's list first).
* `PipelineOptions`, `run_pipeline(placements, options)`: run the job; returns a
  `PipelineResult` (job id, per rank: iteration times, work energy, SM clock and schedule
  version of every instruction) or raises `PipelineError` naming the failed rank (its peers are
  killed).
* `main(argv)`: the command line (`python -m zeus_agent.sim_pipeline_trainer --help`).

Rank order convention for progress: rank 0 (stage 0, replica 0) decides when to stop (after
`iterations`, or once `seconds` have passed) and reports each iteration's time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FORWARD",
    "BACKWARD",
    "NodeSpec",
    "PipelineError",
    "PipelineOptions",
    "PipelineResult",
    "RankPlacement",
    "RankResult",
    "SYNTHETIC_PROFILE",
    "main",
    "one_f_one_b",
    "place_ranks",
    "run_pipeline",
    "stage_profiles",
    "timeline",
    "waits_for",
]

FORWARD = "forward"
BACKWARD = "backward"
SYNTHETIC_PROFILE = "synthetic"
"""A hand-made profile (every stage alike; backward twice the forward), always available."""

_PROG = "python -m zeus_agent.sim_pipeline_trainer"


# ---------------------------------------------------------------------- pure 1F1B logic
def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """One stage's synchronous 1F1B instruction order for one iteration.

    Stage `s` of `S` with `M` microbatches runs `min(S - s - 1, M)` warm-up forwards, then
    alternates one forward and one backward while forwards remain, then the remaining
    backwards. Microbatches are numbered from 0 in each direction.

    Args:
        stage: This stage, 0 <= stage < num_stages.
        num_stages: Pipeline stages S >= 1.
        microbatches: Microbatches M >= 1.

    Returns:
        `(instruction, microbatch)` pairs, `2 * M` of them.

    Raises:
        ValueError: An argument out of range.
    """
    if num_stages < 1 or microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"need 0 <= stage < num_stages and microbatches >= 1, got stage={stage}, "
            f"num_stages={num_stages}, microbatches={microbatches}"
        )
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(FORWARD, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order.append((FORWARD, warmup + i))
        order.append((BACKWARD, i))
    order.extend((BACKWARD, mb) for mb in range(microbatches - warmup, microbatches))
    return order


def waits_for(stage: int, num_stages: int, instruction: str) -> int | None:
    """The stage whose message `instruction` of `stage` waits for (same microbatch), or None.

    A forward waits for the previous stage's activation (none at stage 0), a backward for the
    next stage's gradient (none at the last stage).

    Raises:
        ValueError: An instruction other than "forward" or "backward".
    """
    if instruction == FORWARD:
        return stage - 1 if stage > 0 else None
    if instruction == BACKWARD:
        return stage + 1 if stage < num_stages - 1 else None
    raise ValueError(f"unknown instruction {instruction!r} (forward or backward)")


def timeline(
    num_stages: int, microbatches: int, duration: Callable[[int, str], float]
) -> list[list[tuple[str, int, float, float]]]:
    """Start and end times of one iteration's instructions when each takes `duration(s, name)`.

    Each stage runs its `one_f_one_b` order; an instruction starts when the stage is free and
    the message it `waits_for` has arrived (messages take no time).

    Returns:
        Per stage, `(instruction, microbatch, start, end)` in the stage's order; the
        iteration's time is the largest end.

    Raises:
        ValueError: Arguments out of range (the order itself cannot deadlock).
    """
    orders = [one_f_one_b(s, num_stages, microbatches) for s in range(num_stages)]
    done: dict[tuple[int, str, int], float] = {}
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(num_stages)]
    position = [0] * num_stages
    free = [0.0] * num_stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while position[s] < len(orders[s]):
                name, mb = orders[s][position[s]]
                peer = waits_for(s, num_stages, name)
                if peer is not None and (peer, name, mb) not in done:
                    break
                start = max(free[s], done[(peer, name, mb)] if peer is not None else 0.0)
                end = start + duration(s, name)
                done[(s, name, mb)] = free[s] = end
                out[s].append((name, mb, start, end))
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B never deadlocks
            raise RuntimeError("the 1F1B orders deadlocked")
    return out


# ---------------------------------------------------------------------- workloads
def _instructions_module() -> Any | None:
    try:
        return importlib.import_module("zeus_agent.gpu.sim.instructions")
    except ImportError:
        return None


def stage_profiles() -> list[str]:
    """Names `--profile` accepts: the simulator's stage profiles, then "synthetic"."""
    module = _instructions_module()
    names = list(getattr(module, "STAGE_PROFILES", ())) if module is not None else []
    return [*names, SYNTHETIC_PROFILE]


def _stage_workloads(profile: str, num_stages: int) -> list[dict[str, Any]]:
    """Per stage, `{"forward": WorkloadParams, "backward": WorkloadParams}`."""
    from zeus_agent.gpu.sim.physics import WorkloadParams

    if profile == SYNTHETIC_PROFILE:
        forward = WorkloadParams(
            compute_s=0.08, memory_s=0.02, activity=0.9, description="synthetic forward"
        )
        backward = WorkloadParams(
            compute_s=0.16, memory_s=0.04, activity=1.0, description="synthetic backward"
        )
        return [{FORWARD: forward, BACKWARD: backward} for _ in range(num_stages)]
    module = _instructions_module()
    if module is None:
        raise ValueError(
            f"profile {profile!r} needs zeus_agent.gpu.sim.instructions, which is not "
            f"installed; use --profile {SYNTHETIC_PROFILE}"
        )
    return list(module.stage_workloads(profile, num_stages))


def _preset_for(profile: str) -> str | None:
    module = _instructions_module()
    if profile == SYNTHETIC_PROFILE or module is None:
        return None
    return str(module.preset_for(profile))


# ---------------------------------------------------------------------- placement
@dataclass(frozen=True)
class NodeSpec:
    """A node: its name (for messages), its agent's socket, its sim state dir, its GPUs."""

    name: str
    socket_path: str
    sim_dir: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs and what it is."""

    rank: int
    dp_rank: int
    pp_rank: int
    node: str
    socket_path: str
    sim_dir: str
    gpu_index: int


def place_ranks(nodes: Sequence[NodeSpec], stages: int, dp: int) -> list[RankPlacement]:
    """Place `stages * dp` ranks on the nodes' GPUs, in rank order (`rank = stage * dp + d`).

    Raises:
        ValueError: Too few GPUs, a GPU listed twice, or degrees below 1.
    """
    if stages < 1 or dp < 1:
        raise ValueError(f"--stages and --dp must be >= 1, got {stages} and {dp}")
    slots = [(node, gpu) for node in nodes for gpu in node.gpus]
    seen: set[tuple[str, int]] = set()
    for node, gpu in slots:
        key = (os.path.realpath(node.sim_dir), gpu)
        if key in seen:
            raise ValueError(f"GPU {gpu} of {node.sim_dir} is listed twice")
        seen.add(key)
    world = stages * dp
    if len(slots) < world:
        raise ValueError(
            f"{stages} stages x {dp} replicas need {world} GPUs; the nodes list {len(slots)}"
        )
    placements = []
    for rank in range(world):
        node, gpu = slots[rank]
        placements.append(
            RankPlacement(
                rank=rank,
                dp_rank=rank % dp,
                pp_rank=rank // dp,
                node=node.name,
                socket_path=node.socket_path,
                sim_dir=node.sim_dir,
                gpu_index=gpu,
            )
        )
    return placements


# ---------------------------------------------------------------------- options and results
@dataclass(frozen=True)
class PipelineOptions:
    """What the simulated pipeline job does.

    Attributes:
        profile: A `stage_profiles()` name.
        stages: Pipeline stages (PP degree).
        microbatches: Microbatches per iteration.
        dp: Data-parallel replicas (DP degree).
        iterations: Iterations to run (ignored when `seconds` is set).
        seconds: Run iterations until this much time has passed (then finish the iteration).
        time_scale: Factor on every instruction's duration and energy.
        straggler: `(dp_index, factor)`: that replica's instructions run `factor` times longer.
        job_metadata: Appended to the job id.
        clock_wait_s: With a schedule active, wait at most this long after `instruction_begin`
            for the agent to lock the scheduled clock before the work starts (a late lock is
            counted, the work runs at the clock of the moment).
        ipc_timeout_s: Longest wait for a peer's message or the iteration barrier.
        registration_timeout_s: How long each registration request waits for its reply.
    """

    profile: str = SYNTHETIC_PROFILE
    stages: int = 4
    microbatches: int = 8
    dp: int = 1
    iterations: int = 20
    seconds: float | None = None
    time_scale: float = 0.1
    straggler: tuple[int, float] | None = None
    job_metadata: str | None = "simulated-pipeline"
    clock_wait_s: float = 0.02
    ipc_timeout_s: float = 120.0
    registration_timeout_s: float = 10.0


@dataclass
class RankResult:
    """What one rank did, per iteration and per instruction."""

    rank: int
    dp_rank: int
    pp_rank: int
    node: str
    gpu_index: int
    iteration_time_s: list[float] = field(default_factory=list)
    work_energy_j: list[float] = field(default_factory=list)
    """Energy of the instructions' work (the simulated GPU's), per iteration."""
    clocks_mhz: list[list[int]] = field(default_factory=list)
    """SM clock each instruction ran at, per iteration, in the stage's 1F1B order."""
    schedule_version: list[int | None] = field(default_factory=list)
    """The drop-in's active schedule version, per iteration (None: none yet)."""
    late_clocks: int = 0
    """Instructions whose scheduled clock was not locked within `clock_wait_s`."""
    dropped_events: int = 0


@dataclass
class PipelineResult:
    """The job id, the iterations run and every rank's result."""

    job_id: str | None
    iterations: int
    mean_iteration_s: float
    ranks: list[RankResult]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class PipelineError(RuntimeError):
    """A rank failed (or exited without a result); its peers were stopped."""


class _Aborted(Exception):
    """A peer failed: stop quietly (the launcher reports the peer's error)."""


# ---------------------------------------------------------------------- rank processes
@dataclass
class _Links:
    act_in: Any = None
    act_out: Any = None
    grad_in: Any = None
    grad_out: Any = None


def _recv(conn: Any, expected: tuple[int, int], abort: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if abort.is_set():
            raise _Aborted
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} for (iteration, microbatch) {expected} in {timeout_s} s")
    got = conn.recv()
    if tuple(got) != expected:
        raise RuntimeError(f"{what} out of order: expected {expected}, got {tuple(got)}")


def _wait_for_clock(gpu: Any, mhz: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if gpu.get_locked_sm_clocks_mhz() == (mhz, mhz):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0002)


def _rank_main(
    place: RankPlacement,
    options: PipelineOptions,
    links: _Links,
    job_ids: Any,
    barrier: Any,
    stop: Any,
    abort: Any,
    results: Any,
    progress: Any,
) -> None:
    result = RankResult(place.rank, place.dp_rank, place.pp_rank, place.node, place.gpu_index)
    try:
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.integrations.perseus import PerseusOptimizer

        stages, dp = options.stages, options.dp
        workload = _stage_workloads(options.profile, stages)[place.pp_rank]
        gpu = SimGPU.open(place.sim_dir, place.gpu_index)
        scale = options.time_scale
        if options.straggler is not None and options.straggler[0] == place.dp_rank:
            scale *= options.straggler[1]
        job_id: str | None = None
        token: str | None = None
        if place.rank != 0:
            deadline = time.monotonic() + options.ipc_timeout_s
            while True:
                if abort.is_set():
                    raise _Aborted
                try:
                    job_id, token = job_ids.get(timeout=0.1)
                    break
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError("rank 0 did not hand over the job id") from None
        opt = PerseusOptimizer(
            rank=place.rank,
            dp_rank=place.dp_rank,
            pp_rank=place.pp_rank,
            tp_rank=0,
            device_id=place.gpu_index,
            dp_degree=dp,
            pp_degree=stages,
            tp_degree=1,
            world_size=stages * dp,
            server_url=f"unix://{place.socket_path}",
            job_metadata=options.job_metadata,
            job_id=job_id,
            join_token=token,
            sync_cuda=False,
            timeout_s=options.registration_timeout_s,
        )
        if place.rank == 0:
            if opt.job_id is None:
                raise RuntimeError(
                    f"the job could not be registered through the agent at {place.socket_path} "
                    "(is the agent running, and connected to a coordinator?)"
                )
            results.put(("job_id", opt.job_id))
            for _ in range(stages * dp - 1):
                job_ids.put((opt.job_id, opt.join_token))  # as torch.distributed would
        order = one_f_one_b(place.pp_rank, stages, options.microbatches)
        barrier.wait(timeout=options.ipc_timeout_s)
        started = time.monotonic()
        iteration = 0
        while True:
            opt.on_step_begin()
            t0 = time.monotonic()
            energy = 0.0
            clocks: list[int] = []
            for name, mb in order:
                if name == FORWARD and links.act_in is not None:
                    _recv(links.act_in, (iteration, mb), abort, options.ipc_timeout_s, "activation")
                elif name == BACKWARD and links.grad_in is not None:
                    _recv(links.grad_in, (iteration, mb), abort, options.ipc_timeout_s, "gradient")
                opt.on_instruction_begin(name)
                if opt.frequency is not None and not _wait_for_clock(
                    gpu, opt.frequency, options.clock_wait_s
                ):
                    result.late_clocks += 1
                work = gpu.run_work(workload[name], scale=scale)
                time.sleep(work.duration_s)
                opt.on_instruction_end(name)
                energy += work.energy_j
                clocks.append(work.sm_clock_mhz)
                if name == FORWARD and links.act_out is not None:
                    links.act_out.send((iteration, mb))
                elif name == BACKWARD and links.grad_out is not None:
                    links.grad_out.send((iteration, mb))
            iteration += 1
            if place.rank == 0 and (
                (options.seconds is None and iteration >= options.iterations)
                or (options.seconds is not None and time.monotonic() - started >= options.seconds)
            ):
                stop.set()
            barrier.wait(timeout=options.ipc_timeout_s)  # the all-reduce and optimizer step
            opt.on_step_end()
            elapsed = time.monotonic() - t0
            result.iteration_time_s.append(elapsed)
            result.work_energy_j.append(energy)
            result.clocks_mhz.append(clocks)
            result.schedule_version.append(opt.schedule_version)
            if place.rank == 0:
                progress.put((iteration, elapsed))
            if stop.is_set():
                break
        result.dropped_events = opt.publisher.stats().dropped
        opt.close()
        results.put(("result", result))
    except _Aborted:
        results.put(("aborted", place.rank))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops the job
        if abort.is_set() and isinstance(e, threading.BrokenBarrierError):
            results.put(("aborted", place.rank))
        else:
            results.put(("error", (place.rank, f"{type(e).__name__}: {e}")))
        abort.set()
        with contextlib.suppress(Exception):
            barrier.abort()


# ---------------------------------------------------------------------- launcher
def _describe(place: RankPlacement) -> str:
    return (
        f"rank {place.rank} (dp {place.dp_rank}, stage {place.pp_rank}, node {place.node} "
        f"GPU {place.gpu_index})"
    )


def run_pipeline(
    placements: Sequence[RankPlacement],
    options: PipelineOptions,
    on_iteration: Callable[[int, float], None] | None = None,
    timeout_s: float = 3600.0,
) -> PipelineResult:
    """Run the simulated pipeline job, one process per rank, until it ends.

    Args:
        placements: One per rank, rank order (`place_ranks`).
        options: The job.
        on_iteration: Called here with (iterations done, that iteration's time in s) as rank 0
            finishes each iteration.
        timeout_s: Give up (and kill the ranks) after this long.

    Raises:
        PipelineError: A rank failed (the message names it and has its error), exited without
            a result, or the job did not finish within `timeout_s`; every rank is stopped.
        ValueError: Bad options or placements.
    """
    stages, dp = options.stages, options.dp
    if len(placements) != stages * dp:
        raise ValueError(f"{len(placements)} placements for {stages} x {dp} ranks")
    if options.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {options.microbatches}")
    if options.seconds is None and options.iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {options.iterations}")
    if not options.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {options.time_scale}")
    if options.straggler is not None and (
        not 0 <= options.straggler[0] < dp or not options.straggler[1] > 0
    ):
        raise ValueError(f"--straggler needs 0 <= DP_INDEX < {dp} and FACTOR > 0")
    _stage_workloads(options.profile, stages)  # unknown profile: fail here, not in every rank

    ctx = mp.get_context("spawn")
    links = {(p.dp_rank, p.pp_rank): _Links() for p in placements}
    for d in range(dp):
        for s in range(stages - 1):
            act_recv, act_send = ctx.Pipe(duplex=False)
            grad_recv, grad_send = ctx.Pipe(duplex=False)
            links[(d, s)].act_out, links[(d, s + 1)].act_in = act_send, act_recv
            links[(d, s + 1)].grad_out, links[(d, s)].grad_in = grad_send, grad_recv
    job_ids, results, progress = ctx.Queue(), ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(stages * dp)
    stop, abort = ctx.Event(), ctx.Event()
    procs = {
        p.rank: ctx.Process(
            target=_rank_main,
            name=f"sim-pp-rank{p.rank}",
            args=(
                p,
                options,
                links[(p.dp_rank, p.pp_rank)],
                job_ids,
                barrier,
                stop,
                abort,
                results,
                progress,
            ),
            daemon=True,
        )
        for p in placements
    }
    for proc in procs.values():
        proc.start()
    by_rank = {p.rank: p for p in placements}
    job_id: str | None = None
    done: dict[int, RankResult] = {}
    finished: set[int] = set()
    failure: str | None = None
    deadline = time.monotonic() + timeout_s
    times: list[float] = []

    def drain_progress() -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                count, elapsed = progress.get_nowait()
                times.append(elapsed)
                if on_iteration is not None:
                    on_iteration(count, elapsed)

    dead_since: dict[int, float] = {}
    try:
        while len(finished) < len(procs) and failure is None:
            drain_progress()
            now = time.monotonic()
            if now > deadline:
                failure = f"the job did not finish within {timeout_s} s"
                break
            try:
                kind, value = results.get(timeout=0.05)
            except queue.Empty:
                for rank, proc in procs.items():
                    if rank in finished or proc.is_alive():
                        continue
                    # Its last message may still be in flight: give it a second.
                    if now - dead_since.setdefault(rank, now) > 1.0:
                        failure = (
                            f"{_describe(by_rank[rank])} exited with code "
                            f"{proc.exitcode} without a result"
                        )
                        break
                continue
            if kind == "job_id":
                job_id = value
            elif kind == "result":
                done[value.rank] = value
                finished.add(value.rank)
            elif kind == "error":
                rank, message = value
                failure = f"{_describe(by_rank[rank])} failed: {message}"
            elif kind == "aborted":
                finished.add(value)
        drain_progress()
    finally:
        if failure is not None or len(finished) < len(procs):  # a failure, or interrupted
            abort.set()
            with contextlib.suppress(Exception):
                barrier.abort()
            for proc in procs.values():
                if proc.is_alive():
                    proc.kill()
        for proc in procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if failure is not None:
        raise PipelineError(failure)
    missing = sorted(set(procs) - set(done))
    if missing:
        raise PipelineError(f"ranks {missing} stopped without a result (a peer aborted)")
    iterations = len(done[0].iteration_time_s) if 0 in done else 0
    mean = sum(times) / len(times) if times else math.nan
    return PipelineResult(job_id, iterations, mean, [done[r] for r in sorted(done)])


# ---------------------------------------------------------------------- command line
def _gpu_list(text: str) -> tuple[int, ...]:
    gpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            gpus.extend(range(int(lo), int(hi) + 1))
        else:
            gpus.append(int(part))
    if not gpus or min(gpus) < 0:
        raise ValueError(f"bad GPU list {text!r} (e.g. 0,1,2,3 or 0-3)")
    return tuple(gpus)


def _node_arg(text: str) -> NodeSpec:
    parts = text.split(":")
    if len(parts) != 4 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"--node {text!r}: expected NAME:SOCKET:SIMDIR:GPUS, e.g. "
            "node-a:/tmp/a.sock:/tmp/sim-a:0,1,2,3"
        )
    try:
        gpus = _gpu_list(parts[3])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--node {text!r}: {e}") from None
    return NodeSpec(parts[0], parts[1], parts[2], gpus)


def _straggler_arg(text: str) -> tuple[int, float]:
    try:
        index, factor = text.split(":")
        value = (int(index), float(factor))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--straggler {text!r}: expected DP_INDEX:FACTOR, e.g. 1:1.3"
        ) from None
    if value[0] < 0 or not value[1] > 0:
        raise argparse.ArgumentTypeError(f"--straggler {text!r}: DP_INDEX >= 0, FACTOR > 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    profiles = stage_profiles()
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description=(
            "Run a simulated synchronous-1F1B pipeline-parallel training job: one process per "
            "(data-parallel replica, pipeline stage), each driving one simulated GPU of its "
            "node's Zeus agent and using the PerseusOptimizer drop-in (rank 0 registers the "
            "job; the coordinator's pipeline frequency scheduler plans it and the agents lock "
            "each instruction's SM clock). Stages wait for each other's activations and "
            "gradients for real; every iteration ends with a barrier across all ranks (the "
            "all-reduce). Progress (iterations done, mean iteration time) goes to stderr."
        ),
        epilog=(
            "Ranks are numbered as in Megatron-LM (TP = 1): rank = stage * DP + dp_index, and "
            "take the nodes' GPUs in order. Start the agents with `zeus-agent run --backend sim "
            "--sim-preset PRESET` (the preset the profile was measured on) and a coordinator "
            "first. Exit status: 0 done, 1 a rank failed (its error is printed, its peers are "
            "killed), 2 bad arguments."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    job = parser.add_argument_group("job")
    job.add_argument(
        "--profile",
        default=profiles[0],
        choices=profiles,
        help="Stage workloads: a simulator stage profile (model+GPU), or "
        f"'{SYNTHETIC_PROFILE}' (identical hand-made stages)",
    )
    job.add_argument("--stages", type=int, default=4, help="Pipeline stages (PP degree)")
    job.add_argument("--microbatches", type=int, default=8, help="Microbatches per iteration")
    job.add_argument("--dp", type=int, default=1, help="Data-parallel replicas (DP degree)")
    length = job.add_mutually_exclusive_group()
    length.add_argument("--iterations", type=int, default=20, help="Iterations to run")
    length.add_argument(
        "--seconds",
        type=_positive_float,
        default=None,
        help="Run iterations for this long instead (the last one finishes)",
    )
    job.add_argument(
        "--time-scale",
        type=_positive_float,
        default=0.1,
        help="Factor on every instruction's duration and energy (0.1 = 10x faster "
        "than the profiled job)",
    )
    job.add_argument(
        "--straggler",
        type=_straggler_arg,
        default=None,
        metavar="DP_INDEX:FACTOR",
        help="Slow every instruction of one data-parallel replica by FACTOR",
    )
    job.add_argument(
        "--job-metadata", default="simulated-pipeline", help="Free text appended to the job id"
    )
    where = parser.add_argument_group(
        "placement",
        "Either one node (--socket, --sim-dir, --gpus) or --node repeated (e.g. two agents).",
    )
    where.add_argument(
        "--node",
        type=_node_arg,
        action="append",
        default=None,
        metavar="NAME:SOCKET:SIMDIR:GPUS",
        help="A node: a name for messages, its agent's socket, its simulated "
        "GPUs' state directory, and GPU indices to use (0,1,2 or 0-3); "
        "repeat for more nodes; ranks fill the nodes in the order given",
    )
    where.add_argument(
        "--socket",
        default=os.environ.get("ZEUS_AGENT_SOCKET"),
        help="Single node: the agent's socket (default env ZEUS_AGENT_SOCKET)",
    )
    where.add_argument(
        "--sim-dir",
        default=None,
        help="Single node: the simulated GPUs' state directory (the agent's --sim-state-dir)",
    )
    where.add_argument(
        "--gpus", default=None, help="Single node: GPU indices to use (default 0..world size-1)"
    )
    tuning = parser.add_argument_group("timing")
    tuning.add_argument(
        "--clock-wait-ms",
        type=float,
        default=20.0,
        help="With a schedule active, wait at most this long after "
        "instruction_begin for the agent to lock the scheduled clock",
    )
    tuning.add_argument(
        "--ipc-timeout",
        type=_positive_float,
        default=120.0,
        help="Longest wait (s) for a peer stage's message or the barrier",
    )
    tuning.add_argument(
        "--timeout",
        type=_positive_float,
        default=3600.0,
        help="Stop the job (exit 1) if it runs longer than this (s)",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="Write the result (job id, per rank per iteration: time, work "
        "energy, SM clocks, schedule version) as JSON to this file",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.node:
        if args.sim_dir or args.gpus:
            parser.error("--node cannot be combined with --sim-dir/--gpus")
        nodes: list[NodeSpec] = list(args.node)
    else:
        if not args.socket or not args.sim_dir:
            parser.error("give --socket and --sim-dir (or --node NAME:SOCKET:SIMDIR:GPUS)")
        try:
            gpus = _gpu_list(args.gpus) if args.gpus else tuple(range(args.stages * args.dp))
        except ValueError as e:
            parser.error(str(e))
        nodes = [NodeSpec("local", args.socket, args.sim_dir, gpus)]
    options = PipelineOptions(
        profile=args.profile,
        stages=args.stages,
        microbatches=args.microbatches,
        dp=args.dp,
        iterations=args.iterations,
        seconds=args.seconds,
        time_scale=args.time_scale,
        straggler=args.straggler,
        job_metadata=args.job_metadata or None,
        clock_wait_s=max(0.0, args.clock_wait_ms) / 1000,
        ipc_timeout_s=args.ipc_timeout,
    )
    try:
        placements = place_ranks(nodes, args.stages, args.dp)
    except ValueError as e:
        parser.error(str(e))
    problem = _check_gpus(placements, args.profile)
    if problem:
        print(f"{_PROG}: {problem}", file=sys.stderr)
        return 1

    total = None if args.seconds is not None else args.iterations
    last_print = [0.0]
    seen: list[float] = []

    def report(count: int, elapsed: float) -> None:
        seen.append(elapsed)
        now = time.monotonic()
        if now - last_print[0] >= 1.0 or count == total:
            last_print[0] = now
            of = f"/{total}" if total else ""
            print(
                f"iteration {count}{of}: {elapsed:.3f} s, mean {sum(seen) / len(seen):.3f} s",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"{_PROG}: {len(placements)} ranks ({args.stages} stages x {args.dp} replicas), "
        f"profile {args.profile}, {args.microbatches} microbatches",
        file=sys.stderr,
    )
    try:
        result = run_pipeline(placements, options, report, timeout_s=args.timeout)
    except PipelineError as e:
        print(f"{_PROG}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{_PROG}: {e}", file=sys.stderr)
        return 2
    late = sum(r.late_clocks for r in result.ranks)
    print(
        f"{_PROG}: job {result.job_id}: {result.iterations} iterations, mean "
        f"{result.mean_iteration_s:.3f} s; {late} instruction(s) started before their "
        "scheduled clock was locked",
        file=sys.stderr,
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result.to_json(), f)
    return 0


def _check_gpus(placements: Sequence[RankPlacement], profile: str) -> str | None:
    """Open each rank's simulated GPU here first: a clear message for a wrong --sim-dir."""
    from zeus_agent.errors import GPUError
    from zeus_agent.gpu.sim import PRESETS, SimGPU

    preset = _preset_for(profile)
    for place in placements:
        try:
            gpu = SimGPU.open(place.sim_dir, place.gpu_index)
            name = gpu.get_name()
        except (GPUError, OSError) as e:
            return (
                f"{_describe(place)}: cannot open simulated GPU {place.gpu_index} in "
                f"{place.sim_dir} ({e}); is its agent running with --backend sim?"
            )
        if preset is not None and preset in PRESETS and PRESETS[preset].name != name:
            print(
                f"{_PROG}: warning: profile {profile} was measured on {preset} but "
                f"{_describe(place)} simulates {name}",
                file=sys.stderr,
            )
    return None


if __name__ == "__main__":
    sys.exit(main())
