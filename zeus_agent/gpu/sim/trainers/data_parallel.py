"""A simulated data-parallel trainer: real processes, real `emit` calls, simulated GPUs.

Each rank is a process that drives one simulated GPU (`SimGPU.open` on the state file its
node's agent created) and talks to that node's agent through `zeus_agent.emit`, exactly as a
real training script would. Ranks meet at a barrier before every step, as data-parallel ranks
meet in their all-reduce, so a step lasts as long as the slowest rank's.

* `RankPlacement`: where a rank runs (its agent's socket, its GPU's state directory and index).
* `TrainerOptions`: job shape, workload, steps, power-limit options.
* `run_data_parallel(placements, options)`: run the job to the end; returns a `TrainerResult`
  with the job id and, per rank, every step's time, energy and power limit (as the simulated
  GPU ran it). Rank 0 registers the job and hands the id to the others (like
  `torch.distributed`'s broadcast in a real job).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zeus_agent.wire.messages import PowerLimitOptions

if TYPE_CHECKING:
    from zeus_agent.gpu.sim.device import WorkResult


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs."""

    node: str
    socket_path: str
    sim_state_dir: str
    gpu_index: int


@dataclass(frozen=True)
class TrainerOptions:
    """What the simulated job does.

    Attributes:
        workload: A name of `zeus_agent.gpu.sim.presets.WORKLOADS`.
        epochs: Number of epochs.
        steps_per_epoch: Steps in each epoch.
        scale: Multiplies the workload's step time (0.1 = ten times faster than the real job).
        power_limit: Ask the coordinator to optimise the power limit with these options.
        job_metadata: Appended to the job id.
        seed: Seed of the simulated noise.
        noise: Whether steps carry the simulator's noise.
        queue_ahead_s: How long before its GPU finishes a step a rank goes on to the next
            one (at most half the step; `_until_next`), as a real trainer's CUDA launch
            queue keeps its GPU fed. 0: a rank sleeps the step's duration after starting it,
            so its GPU idles (at idle power) while the host is late or the barrier waits.
    """

    workload: str = "A40+resnet50+gpu0,1,2,3"
    epochs: int = 1
    steps_per_epoch: int = 100
    scale: float = 0.1
    power_limit: PowerLimitOptions | None = field(default_factory=PowerLimitOptions)
    job_metadata: str | None = "simulated"
    seed: int = 0
    noise: bool = True
    queue_ahead_s: float = 0.2


def _until_next(work: WorkResult, ahead_s: float, now_s: float) -> float:
    """Seconds a rank sleeps after starting `work` before its next step.

    With `ahead_s` > 0: until `ahead_s` (at most half the step) before its GPU is done, so
    the next step is queued behind this one (`SimGPU.run_work` queues) and the GPU runs back
    to back while the host's lag (a loaded machine, the barrier waiting for the slowest
    rank) stays under that lead: a 16 x 8 grid event on a 2-core host measured the jobs'
    GPUs 4 % under the simulator's curves without it (their GPUs idle in the gaps).
    """
    if ahead_s <= 0 or not work.busy_until_ns:
        return float(work.duration_s)
    lead = min(ahead_s, 0.5 * work.duration_s)
    return max(0.0, work.busy_until_ns / 1e9 - lead - now_s)


@dataclass
class RankResult:
    """What one rank did: per step, time (s), energy (J) and power limit (W)."""

    rank: int
    step_time_s: list[float] = field(default_factory=list)
    step_energy_j: list[float] = field(default_factory=list)
    step_power_limit_w: list[int] = field(default_factory=list)
    dropped_events: int = 0
    error: str | None = None


@dataclass
class TrainerResult:
    """The job id and every rank's result."""

    job_id: str | None
    ranks: list[RankResult]


def _rank_main(
    rank: int,
    world_size: int,
    placement: RankPlacement,
    options: TrainerOptions,
    job_ids: Any,
    barrier: Any,
    results: Any,
    progress: Any,
) -> None:
    result = RankResult(rank)
    try:
        from zeus_agent import emit
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.gpu.sim.physics import NoiseModel
        from zeus_agent.gpu.sim.presets import WORKLOADS
        from zeus_agent.models import JobInfo

        workload = WORKLOADS[options.workload]
        gpu = SimGPU.open(placement.sim_state_dir, placement.gpu_index)
        rng = random.Random(options.seed * 1000 + rank)
        noise = NoiseModel() if options.noise else NoiseModel.off()
        if rank == 0:
            job = JobInfo(pp_degree=1, dp_degree=world_size, tp_degree=1, world_size=world_size,
                          job_metadata=options.job_metadata)
            pub = emit.init(job_info=job, power_limit=options.power_limit, rank=0, dp_rank=0,
                            gpu_index=placement.gpu_index, socket_path=placement.socket_path,
                            timeout_s=10.0)
            job_id = pub.job_id
            for _ in range(world_size - 1):
                job_ids.put((job_id, pub.join_token))  # as torch.distributed would broadcast
            results.put(("job_id", job_id))
        else:
            job_id, token = job_ids.get(timeout=60)
            pub = emit.init(job_id=job_id, join_token=token, rank=rank, dp_rank=rank,
                            gpu_index=placement.gpu_index, socket_path=placement.socket_path,
                            timeout_s=10.0)
        barrier.wait(timeout=60)
        step = 0
        for _epoch in range(options.epochs):
            pub.epoch_begin()
            for _ in range(options.steps_per_epoch):
                barrier.wait(timeout=60)
                pub.step_begin()
                limit = gpu.get_power_limit_w()
                work = gpu.run_work(workload, scale=options.scale, rng=rng, noise=noise)
                time.sleep(_until_next(work, options.queue_ahead_s, time.monotonic()))
                pub.step_end()
                result.step_time_s.append(work.duration_s)
                result.step_energy_j.append(work.energy_j)
                result.step_power_limit_w.append(limit)
                step += 1
                if rank == 0 and progress is not None:
                    progress.put(step)
            pub.epoch_end()
        barrier.wait(timeout=60)
        result.dropped_events = pub.stats().dropped
        pub.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the job
        result.error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            barrier.abort()
    results.put(("rank", result))


def run_data_parallel(
    placements: Sequence[RankPlacement],
    options: TrainerOptions,
    on_step: Callable[[int], None] | None = None,
    timeout_s: float = 600.0,
) -> TrainerResult:
    """Run a simulated data-parallel job, one process per rank, until it ends.

    Args:
        placements: One per rank, rank order.
        options: The job.
        on_step: Called in this process with rank 0's step count as it advances.
        timeout_s: Give up (and kill the ranks) after this long.

    Raises:
        RuntimeError: A rank failed; the message has its error.
    """
    ctx = mp.get_context("spawn")
    world = len(placements)
    job_ids, results, progress = ctx.Queue(), ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(world)
    procs = [
        ctx.Process(target=_rank_main, name=f"sim-rank{r}",
                    args=(r, world, p, options, job_ids, barrier, results, progress), daemon=True)
        for r, p in enumerate(placements)
    ]
    for p in procs:
        p.start()
    job_id: str | None = None
    ranks: list[RankResult] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(ranks) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated job did not finish within {timeout_s} s")
            try:
                while True:
                    step = progress.get_nowait()
                    if on_step:
                        on_step(step)
            except queue.Empty:
                pass
            try:
                kind, value = results.get(timeout=0.05)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    raise RuntimeError("every rank process exited without a result") from None
                continue
            if kind == "job_id":
                job_id = value
            else:
                ranks.append(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = [r for r in ranks if r.error]
    if failed:
        raise RuntimeError("; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    return TrainerResult(job_id, sorted(ranks, key=lambda r: r.rank))
