"""The simulated pipeline job: stage workloads, rank placement, the rank processes, the launcher.

One process per (data-parallel replica, pipeline stage) (tensor parallelism 1). Each opens its
simulated GPU (`SimGPU.open` on the state directory its node's agent created), registers with
`PerseusOptimizer` (rank 0 registers the job; the launcher hands its id to the others) and runs
synchronous 1F1B iterations (`zeus_agent.pipeline_order.one_f_one_b`). Stages wait for each
other for real through pipes: a forward waits for the previous stage's activation of its
microbatch, a backward for the next stage's gradient. Each instruction's work is
`gpu.run_work(stage_workload[name], scale)` at whatever SM clock the agent locked, then a sleep
of its duration. At the end of an iteration every rank meets at a barrier (the gradient
all-reduce and optimizer step), then `on_step_end()`.

* `stage_profiles()`: the names `--profile` accepts.
* `NodeSpec`, `RankPlacement`, `place_ranks(nodes, stages, dp)`: where ranks run. Ranks are
  numbered as Megatron-LM numbers them with TP = 1: `rank = stage * dp + dp_index`; they take
  the nodes' GPUs in order (first node's list first).
* `PipelineOptions`, `run_pipeline(placements, options)`: run the job; returns a
  `PipelineResult` (job id, per rank: iteration times, work energy, SM clock and schedule
  version of every instruction) or raises `PipelineError` naming the failed rank (its peers are
  killed).

Rank order convention for progress: rank 0 (stage 0, replica 0) decides when to stop (after
`iterations`, or once `seconds` have passed) and reports each iteration's time.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from zeus_agent.pipeline_order import BACKWARD, FORWARD, one_f_one_b

if TYPE_CHECKING:
    from zeus_agent.integrations.perseus import PerseusOptimizer

__all__ = [
    "NodeSpec",
    "PipelineError",
    "PipelineOptions",
    "PipelineResult",
    "RankPlacement",
    "RankResult",
    "SYNTHETIC_PROFILE",
    "place_ranks",
    "run_pipeline",
    "stage_profiles",
]

SYNTHETIC_PROFILE = "synthetic"
"""A hand-made profile (every stage alike; backward twice the forward), always available."""


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


@dataclass
class _Channels:
    """What every rank process shares with the launcher and its peers (multiprocessing objects).

    Attributes:
        job_ids: Rank 0 puts the job id and join token here, once per other rank.
        results: Each rank's outcome: ("job_id" | "result" | "aborted" | "error", value).
        progress: Rank 0's (iterations done, that iteration's time in s).
        barrier: The end of each iteration (the gradient all-reduce and optimizer step).
        stop: Set by rank 0 once the job has run long enough.
        abort: Set when a rank fails: its peers stop quietly.
        enough: Set by the launcher when its `on_iteration` says so: rank 0 then stops at the
            end of its iteration (every rank at the same one, through `stop`).
    """

    job_ids: Any
    results: Any
    progress: Any
    barrier: Any
    stop: Any
    abort: Any
    enough: Any

    @classmethod
    def of(cls, ctx: Any, world: int) -> _Channels:
        """Fresh channels for `world` ranks from the multiprocessing context `ctx`."""
        return cls(
            ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Barrier(world), ctx.Event(), ctx.Event(),
            ctx.Event(),
        )


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
    place: RankPlacement, options: PipelineOptions, links: _Links, ch: _Channels
) -> None:
    """One rank process: register, run the iterations, report the result (or the failure)."""
    result = RankResult(place.rank, place.dp_rank, place.pp_rank, place.node, place.gpu_index)
    try:
        _Rank(place, options, links, ch, result).run()
        ch.results.put(("result", result))
    except _Aborted:
        ch.results.put(("aborted", place.rank))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops the job
        if ch.abort.is_set() and isinstance(e, threading.BrokenBarrierError):
            ch.results.put(("aborted", place.rank))
        else:
            ch.results.put(("error", (place.rank, f"{type(e).__name__}: {e}")))
        ch.abort.set()
        with contextlib.suppress(Exception):
            ch.barrier.abort()


class _Rank:
    """One rank's run: its stage's work on its simulated GPU, between its neighbouring stages."""

    def __init__(
        self,
        place: RankPlacement,
        options: PipelineOptions,
        links: _Links,
        ch: _Channels,
        result: RankResult,
    ) -> None:
        from zeus_agent.gpu.sim import SimGPU

        self.place, self.options, self.links = place, options, links
        self.ch, self.result = ch, result
        self.workload = _stage_workloads(options.profile, options.stages)[place.pp_rank]
        self.gpu = SimGPU.open(place.sim_dir, place.gpu_index)
        self.scale = options.time_scale
        if options.straggler is not None and options.straggler[0] == place.dp_rank:
            self.scale *= options.straggler[1]

    def run(self) -> None:
        """Register, run 1F1B iterations until rank 0 says stop, then close the optimizer."""
        place, options, ch, result = self.place, self.options, self.ch, self.result
        job_id, token = self._job_id() if place.rank != 0 else (None, None)
        opt = self._register(job_id, token)
        if place.rank == 0:
            self._hand_over(opt)
        order = one_f_one_b(place.pp_rank, options.stages, options.microbatches)
        ch.barrier.wait(timeout=options.ipc_timeout_s)
        started = time.monotonic()
        iteration = 0
        while True:
            opt.on_step_begin()
            t0 = time.monotonic()
            energy, clocks = self._iteration(opt, order, iteration)
            iteration += 1
            if place.rank == 0 and (
                (options.seconds is None and iteration >= options.iterations)
                or (options.seconds is not None and time.monotonic() - started >= options.seconds)
                or ch.enough.is_set()
            ):
                ch.stop.set()
            ch.barrier.wait(timeout=options.ipc_timeout_s)  # the all-reduce and optimizer step
            opt.on_step_end()
            elapsed = time.monotonic() - t0
            result.iteration_time_s.append(elapsed)
            result.work_energy_j.append(energy)
            result.clocks_mhz.append(clocks)
            result.schedule_version.append(opt.schedule_version)
            if place.rank == 0:
                ch.progress.put((iteration, elapsed))
            if ch.stop.is_set():
                break
        result.dropped_events = opt.publisher.stats().dropped
        opt.close()

    def _job_id(self) -> tuple[str | None, str | None]:
        """The job id and join token rank 0 hands over (as torch.distributed would)."""
        deadline = time.monotonic() + self.options.ipc_timeout_s
        while True:
            if self.ch.abort.is_set():
                raise _Aborted
            try:
                job_id, token = self.ch.job_ids.get(timeout=0.1)
                return job_id, token
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 did not hand over the job id") from None

    def _register(self, job_id: str | None, token: str | None) -> PerseusOptimizer:
        """This rank's `PerseusOptimizer` (rank 0's registers the job)."""
        from zeus_agent.integrations.perseus import PerseusOptimizer

        place, options = self.place, self.options
        return PerseusOptimizer(
            rank=place.rank,
            dp_rank=place.dp_rank,
            pp_rank=place.pp_rank,
            tp_rank=0,
            device_id=place.gpu_index,
            dp_degree=options.dp,
            pp_degree=options.stages,
            tp_degree=1,
            world_size=options.stages * options.dp,
            server_url=f"unix://{place.socket_path}",
            job_metadata=options.job_metadata,
            job_id=job_id,
            join_token=token,
            sync_cuda=False,
            timeout_s=options.registration_timeout_s,
        )

    def _hand_over(self, opt: PerseusOptimizer) -> None:
        """Rank 0: report the job id, and hand it with the join token to every other rank."""
        if opt.job_id is None:
            raise RuntimeError(
                f"the job could not be registered through the agent at {self.place.socket_path} "
                "(is the agent running, and connected to a coordinator?)"
            )
        self.ch.results.put(("job_id", opt.job_id))
        for _ in range(self.options.stages * self.options.dp - 1):
            self.ch.job_ids.put((opt.job_id, opt.join_token))  # as torch.distributed would

    def _iteration(
        self, opt: PerseusOptimizer, order: Sequence[tuple[str, int]], iteration: int
    ) -> tuple[float, list[int]]:
        """Run one iteration's instructions; their work energy and SM clocks."""
        links, timeout_s = self.links, self.options.ipc_timeout_s
        energy = 0.0
        clocks: list[int] = []
        for name, mb in order:
            if name == FORWARD and links.act_in is not None:
                _recv(links.act_in, (iteration, mb), self.ch.abort, timeout_s, "activation")
            elif name == BACKWARD and links.grad_in is not None:
                _recv(links.grad_in, (iteration, mb), self.ch.abort, timeout_s, "gradient")
            opt.on_instruction_begin(name)
            if opt.frequency is not None and not _wait_for_clock(
                self.gpu, opt.frequency, self.options.clock_wait_s
            ):
                self.result.late_clocks += 1
            work = self.gpu.run_work(self.workload[name], scale=self.scale)
            time.sleep(work.duration_s)
            opt.on_instruction_end(name)
            energy += work.energy_j
            clocks.append(work.sm_clock_mhz)
            if name == FORWARD and links.act_out is not None:
                links.act_out.send((iteration, mb))
            elif name == BACKWARD and links.grad_out is not None:
                links.grad_out.send((iteration, mb))
        return energy, clocks


# ---------------------------------------------------------------------- launcher
def _describe(place: RankPlacement) -> str:
    return (
        f"rank {place.rank} (dp {place.dp_rank}, stage {place.pp_rank}, node {place.node} "
        f"GPU {place.gpu_index})"
    )


def run_pipeline(
    placements: Sequence[RankPlacement],
    options: PipelineOptions,
    on_iteration: Callable[[int, float], bool | None] | None = None,
    timeout_s: float = 3600.0,
) -> PipelineResult:
    """Run the simulated pipeline job, one process per rank, until it ends.

    Args:
        placements: One per rank, rank order (`place_ranks`).
        options: The job.
        on_iteration: Called here with (iterations done, that iteration's time in s) as rank 0
            finishes each iteration; True: the job has run enough, every rank stops after its
            current iteration (at most `options.iterations` run in any case).
        timeout_s: Give up (and kill the ranks) after this long.

    Raises:
        PipelineError: A rank failed (the message names it and has its error), exited without
            a result, or the job did not finish within `timeout_s`; every rank is stopped.
        ValueError: Bad options or placements.
    """
    _check(placements, options)
    ctx = mp.get_context("spawn")
    ch = _Channels.of(ctx, options.stages * options.dp)
    links = _link_stages(ctx, placements, options)
    procs = {
        p.rank: ctx.Process(
            target=_rank_main,
            name=f"sim-pp-rank{p.rank}",
            args=(p, options, links[(p.dp_rank, p.pp_rank)], ch),
            daemon=True,
        )
        for p in placements
    }
    for proc in procs.values():
        proc.start()
    watch = _Watch(placements, procs, ch, on_iteration, timeout_s)
    try:
        watch.run()
    finally:
        _stop(procs, ch, forced=watch.failure is not None or len(watch.finished) < len(procs))
    return watch.outcome()


def _check(placements: Sequence[RankPlacement], options: PipelineOptions) -> None:
    """Refuse bad options or placements here, before any rank starts."""
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


def _link_stages(
    ctx: Any, placements: Sequence[RankPlacement], options: PipelineOptions
) -> dict[tuple[int, int], _Links]:
    """Per (dp index, stage): pipes to the next stage (activations) and the previous (gradients)."""
    links = {(p.dp_rank, p.pp_rank): _Links() for p in placements}
    for d in range(options.dp):
        for s in range(options.stages - 1):
            act_recv, act_send = ctx.Pipe(duplex=False)
            grad_recv, grad_send = ctx.Pipe(duplex=False)
            links[(d, s)].act_out, links[(d, s + 1)].act_in = act_send, act_recv
            links[(d, s + 1)].grad_out, links[(d, s)].grad_in = grad_send, grad_recv
    return links


class _Watch:
    """The launcher's watch over the ranks: their messages, their exits and the deadline."""

    def __init__(
        self,
        placements: Sequence[RankPlacement],
        procs: dict[int, Any],
        ch: _Channels,
        on_iteration: Callable[[int, float], bool | None] | None,
        timeout_s: float,
    ) -> None:
        self.by_rank = {p.rank: p for p in placements}
        self.procs, self.ch, self.on_iteration, self.timeout_s = procs, ch, on_iteration, timeout_s
        self.job_id: str | None = None
        self.done: dict[int, RankResult] = {}
        self.finished: set[int] = set()
        self.failure: str | None = None
        self.deadline = time.monotonic() + timeout_s
        self.times: list[float] = []
        self.dead_since: dict[int, float] = {}

    def run(self) -> None:
        """Until every rank finished or one failed (or the deadline passed)."""
        while len(self.finished) < len(self.procs) and self.failure is None:
            self._drain_progress()
            now = time.monotonic()
            if now > self.deadline:
                self.failure = f"the job did not finish within {self.timeout_s} s"
                break
            try:
                kind, value = self.ch.results.get(timeout=0.05)
            except queue.Empty:
                self._check_exits(now)
                continue
            self._take(kind, value)
        # Rank 0 put its last progress before its result, but on another queue, whose feeder
        # thread may not have flushed it yet (seen on a loaded host: "iteration 6/6" missing).
        self._drain_progress(wait_s=0.2 if self.failure is None else 0.0)

    def _drain_progress(self, wait_s: float = 0.0) -> None:
        """Report the progress rank 0 sent (waiting up to `wait_s` for each next item)."""
        with contextlib.suppress(queue.Empty):
            while True:
                count, elapsed = (self.ch.progress.get(timeout=wait_s) if wait_s
                                  else self.ch.progress.get_nowait())
                self.times.append(elapsed)
                if self.on_iteration is not None and self.on_iteration(count, elapsed):
                    self.ch.enough.set()

    def _check_exits(self, now: float) -> None:
        """A rank that exited without a result is a failure."""
        for rank, proc in self.procs.items():
            if rank in self.finished or proc.is_alive():
                continue
            # Its last message may still be in flight: give it a second.
            if now - self.dead_since.setdefault(rank, now) > 1.0:
                self.failure = (
                    f"{_describe(self.by_rank[rank])} exited with code "
                    f"{proc.exitcode} without a result"
                )
                break

    def _take(self, kind: str, value: Any) -> None:
        """One message of a rank's (`_Channels.results`)."""
        if kind == "job_id":
            self.job_id = value
        elif kind == "result":
            self.done[value.rank] = value
            self.finished.add(value.rank)
        elif kind == "error":
            rank, message = value
            self.failure = f"{_describe(self.by_rank[rank])} failed: {message}"
        elif kind == "aborted":
            self.finished.add(value)

    def outcome(self) -> PipelineResult:
        """The job's result; raises `PipelineError` if it failed or a rank has no result."""
        if self.failure is not None:
            raise PipelineError(self.failure)
        done = self.done
        missing = sorted(set(self.procs) - set(done))
        if missing:
            raise PipelineError(f"ranks {missing} stopped without a result (a peer aborted)")
        iterations = len(done[0].iteration_time_s) if 0 in done else 0
        mean = sum(self.times) / len(self.times) if self.times else math.nan
        return PipelineResult(self.job_id, iterations, mean, [done[r] for r in sorted(done)])


def _stop(procs: dict[int, Any], ch: _Channels, forced: bool) -> None:
    """Join every rank; `forced` (a failure, or interrupted): abort the job and kill them first."""
    if forced:
        ch.abort.set()
        with contextlib.suppress(Exception):
            ch.barrier.abort()
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
    for proc in procs.values():
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
