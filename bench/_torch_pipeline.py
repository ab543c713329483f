"""`bench/perseus_savings.py --trainer torch`: Perseus on `examples/pipeline_gpt.py` under torchrun.

For each torch schedule: nats-server and one `AgentServer` with 4 simulated GPUs of the stage
profile's own (`PipelineCluster`, its h200 NVML timing model: a counter read ~3 ms, a clock
change 1 ms), then two jobs of `torchrun --nproc_per_node 4 examples/pipeline_gpt.py --schedule
S` (4 gloo ranks, each action paced by its rank's simulated GPU), each under a fresh
coordinator:

1. Perseus: learns each rank's `kind:stage:microbatch` order, profiles online, plans on the
   learnt schedule's DAG and serves its choice;
2. all-max: `PointSolution` with every action of the ranks' learnt orders at the top clock.

Measured as for the simulated trainer (`zeus_demo.pipeline.measure`): energy per iteration
summed over the GPUs and the slowest rank's step time, from the agents' measurements, over
steps under the served plan and under all-max. Predicted: the planner's chosen point against
the all-max plan evaluated on the same online profile and the same learnt schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeus_agent import children
from zeus_agent.aio import wait_started
from zeus_demo.pipeline import (
    JobObserver,
    PipelineCluster,
    PipelineDemoConfig,
    Side,
    pct_less,
    pct_more,
    scheduler_args,
    window_stats,
    write_plan,
)
from zeus_demo.pipeline.cluster import SchedulerSnapshot, snapshot_scheduler

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipeline_gpt.py"
TORCH_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
"""`--schedules` default: torch's `Schedule1F1B`, `ScheduleInterleaved1F1B` and the looped
zero-bubble schedule (`ScheduleInterleavedZeroBubble`, split backwards)."""
DEFAULT_PROFILE = "gpt3-175b+a100_sxm"
"""The example's stage profile (its GPU: A100-SXM)."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class TorchJob:
    """One torchrun job: what the agents measured and what the coordinator planned."""

    job_id: str
    observer: JobObserver
    summary: dict[str, Any]
    snapshot: SchedulerSnapshot | None
    orders: dict[int, list[str]]
    """Rank -> the instruction order the coordinator learnt (from its dump)."""
    elapsed_s: float


async def _torchrun(cluster: PipelineCluster, schedule: str, steps: int, tag: str,
                    summary: Path, timeout_s: float) -> None:
    """Run the example to its end on the cluster's one node (raises on failure)."""
    cfg = cluster.config
    node = cfg.node_names[0]
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(cfg.world_size), str(EXAMPLE), "--schedule", schedule,
            "--sim-state-dir", str(cluster.root / node), "--profile", cfg.profile,
            "--microbatches", str(cfg.microbatches), "--time-scale", str(cfg.time_scale),
            "--steps", str(steps), "--job-metadata", tag, "--summary", str(summary)]
    env = {**os.environ, "ZEUS_AGENT_SOCKET": str(cluster.root / f"{node}.sock"),
           "OMP_NUM_THREADS": "1"}
    log = cluster.root / f"{tag}.log"
    with open(log, "wb") as out:
        proc = await children.create_subprocess_exec(
            sys.executable, *argv, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL)
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 20)
            raise
    if rc != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"torchrun {schedule} ({tag}) exited {rc}:\n{tail}")


async def run_torch_job(cluster: PipelineCluster, scheduler: str, args: dict[str, Any],
                        schedule: str, steps: int, label: str) -> TorchJob:
    """Run `schedule` for `steps` under a fresh coordinator running `scheduler`."""
    from coordinator.config import CoordinatorSettings
    from coordinator.pipeline.dumps import job_dir_name
    from coordinator.service import CoordinatorService
    from zeus_agent.models import load_ranks

    cfg = cluster.config
    started = time.monotonic()
    tag = f"{label}-{uuid.uuid4().hex[:8]}"
    observer = JobObserver(tag)
    cluster._observers.append(observer)
    home = cluster.root / f"coordinator-{tag}"
    settings = CoordinatorSettings.model_validate({
        "nats_url": cluster.url, "prefix": cluster.prefix, "state_dir": str(home / "state"),
        "dump_dir": str(home / "dump"), "log_level": cluster.log_level,
        "scheduler": scheduler, "scheduler_args": args,
        "profiling_iterations": cfg.profiling_iterations, "switch_lead_steps": 2,
        "straggler_threshold": 10.0})  # One pipeline: nothing to detect.
    coord = CoordinatorService(settings)
    task = asyncio.create_task(coord.serve())
    summary_path = cluster.root / f"{tag}.json"
    try:
        await wait_started(coord.started, task, "the coordinator")
        await _torchrun(cluster, schedule, steps, tag, summary_path, cfg.timeout_s)
        summary = json.loads(summary_path.read_text())
        job_id = str(summary["job_id"])
        expected = {(r, s) for r in range(cfg.world_size) for s in range(steps)}
        deadline = time.monotonic() + 10
        while not expected <= observer.steps.keys() and time.monotonic() < deadline:
            observer.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(observer.changed.wait(), 0.5)
        job = coord.pipeline_jobs.get(job_id)
        snapshot = None
        if job is not None and job.scheduler is not None and scheduler.startswith("Perseus"):
            snapshot = snapshot_scheduler(scheduler, job.scheduler, cfg.microbatches)
        dump = home / "dump" / job_dir_name(job_id)
        orders = {r.rank: list(r.instructions or []) for r in load_ranks(str(dump))}
    finally:
        coord.should_exit.set()
        _, pending = await asyncio.wait({task}, timeout=15)
        for t in pending:
            t.cancel()
        cluster._observers.remove(observer)
    errors = [ev.message for ev in observer.statuses if ev.state == "error"]
    if errors:
        raise RuntimeError(f"the coordinator stopped the {label} job: {errors[-1]}")
    return TorchJob(job_id, observer, summary, snapshot, orders, time.monotonic() - started)


def _side(job: TorchJob, world: int, versions: list[int], skip: int,
          limit: int | None = None) -> Side:
    return window_stats(job.observer.steps, dict.fromkeys(range(world), 0), versions,
                        skip=skip, limit=limit)


async def bench_schedule(cluster: PipelineCluster, schedule: str) -> dict[str, Any]:
    """Perseus, then all-max on the orders it learnt; measured and predicted figures."""
    cfg = cluster.config
    n, w = cfg.serve_iterations, cfg.warmup_iterations
    budget = cfg.profiling_budget(cluster.available_clocks)
    _say(f"{schedule}: Perseus, {budget + w + n} iterations")
    perseus = await run_torch_job(cluster, "Perseus", scheduler_args("Perseus", cfg),
                                  schedule, budget + w + n, f"perseus-{schedule}")
    top = cluster.top_clock_mhz
    plan = [[(name, top) for name in perseus.orders[r]] for r in range(cfg.world_size)]
    path = write_plan(cluster.root / f"all-max-{schedule}.json", plan)
    _say(f"{schedule}: all-max clocks, {5 + w + n} iterations")
    base = await run_torch_job(cluster, "PointSolution", {"solution_path": path}, schedule,
                               5 + w + n, f"all-max-{schedule}")
    served = perseus.observer.versions("serving")
    opt = _side(perseus, cfg.world_size, served[-1:] or [-1], w)
    all_max = _side(base, cfg.world_size, [0], w, n)
    snap = perseus.snapshot
    measured = pct_less(all_max.energy_j, opt.energy_j)
    predicted = snap.predicted_saving_pct if snap is not None else math.nan
    slowdown = pct_more(all_max.time_s, opt.time_s)
    return {
        "schedule": f"Schedule{schedule}", "jobs": [perseus.job_id, base.job_id],
        "all_max": all_max.to_json(), "perseus": opt.to_json(),
        "measured_saving_pct": measured, "predicted_saving_pct": predicted,
        "saving_gap_points": abs(measured - predicted),
        "slowdown_pct": slowdown,
        "median_slowdown_pct": pct_more(all_max.median_time_s, opt.median_time_s),
        "predicted_time_change_pct": snap.predicted_slowdown_pct if snap else None,
        "p_block_fitted_w": snap.p_block_w if snap else None,
        "frontier_points": len(snap.frontier) if snap else 0,
        "actions_per_rank": [len(perseus.orders[r]) for r in range(cfg.world_size)],
        "late_clocks": sum(r["late_clocks"] for r in perseus.summary["ranks"]),
        "elapsed_s": perseus.elapsed_s + base.elapsed_s,
    }


async def bench_torch(args: Any) -> dict[str, Any]:
    """Every schedule of `args.schedules` on one cluster; figures per schedule and goals."""
    cfg = PipelineDemoConfig(
        profile=args.profile or DEFAULT_PROFILE, stages=4, dp=1, nodes=1,
        microbatches=args.microbatches, time_scale=args.time_scale,
        baseline_iterations=args.iterations, serve_iterations=args.iterations,
        warmup_iterations=2, clocks=args.clocks, timeout_s=3600)
    cluster = PipelineCluster(cfg, log_level=args.log_level)
    results: dict[str, Any] = {}
    started = time.monotonic()
    try:
        await cluster.start()
        for schedule in args.schedules:
            try:
                results[schedule] = await bench_schedule(cluster, schedule)
            except RuntimeError as e:  # Reported; the other schedules still run.
                _say(f"{schedule}: {e}")
                results[schedule] = {"schedule": f"Schedule{schedule}", "error": str(e)}
    finally:
        await cluster.stop()
    return {"trainer": "torch", "profile": cfg.profile, "preset": cfg.preset,
            "schedules": results, "elapsed_s": time.monotonic() - started}


def met(result: dict[str, Any], goal: dict[str, float]) -> dict[str, dict[str, bool]]:
    """Per schedule: saving within the goal's points of the prediction, slowdown within goal."""
    out = {}
    for name, r in result["schedules"].items():
        if "error" in r:
            continue
        out[name] = {
            "saving_within_2_points": r["saving_gap_points"] <= goal["saving_vs_prediction_points"],
            "slowdown_at_most_1pct": r["slowdown_pct"] <= goal["slowdown_pct"]}
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"{'schedule':32s} {'all-max s':>9s} {'Perseus s':>9s} {'all-max J':>9s} "
          f"{'Perseus J':>9s} {'saving %':>8s} {'predict %':>9s} {'slowdown %':>10s}")
    for r in result["schedules"].values():
        if "error" in r:
            print(f"{r['schedule']:32s} did not run: {r['error'].splitlines()[0]}")
            continue
        a, p = r["all_max"], r["perseus"]
        print(f"{r['schedule']:32s} {a['time_per_iteration_s'] or math.nan:9.4f} "
              f"{p['time_per_iteration_s'] or math.nan:9.4f} "
              f"{a['energy_per_iteration_j'] or math.nan:9.1f} "
              f"{p['energy_per_iteration_j'] or math.nan:9.1f} "
              f"{r['measured_saving_pct']:8.2f} {r['predicted_saving_pct']:9.2f} "
              f"{r['slowdown_pct']:10.2f}")
