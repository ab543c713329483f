"""Perseus end to end: measured energy saving and slowdown against the planner's prediction.

Everything real but the GPUs: an embedded nats-server, one `AgentServer` per simulated node
(simulated A40s, the coarse NVML-like energy counter with its 100 ms period scaled by the time
scale), a `CoordinatorService` per job, and the simulated 1F1B pipeline trainer
(`zeus_agent.gpu.sim.trainers.pipeline`, one process per rank) with the GPT-3 175B A40 stages of
`zeus_agent.gpu.sim.instructions` (4 stages: three of the profile's stage 0, then its heavier
last stage), DP 2 x PP 4 by default, in one asyncio loop (`zeus_demo.pipeline`).

Jobs, each under a fresh coordinator:

1. all-max: `PointSolution3D` with every instruction at the highest SM clock;
2. Perseus: the coordinator's "Perseus3D" profiles online, plans the frontier, serves its choice;
3. all-max again (not with --quick): the baseline is both all-max runs pooled, so that a drift
   of the machine's speed between jobs does not read as a slowdown;
4. with one pipeline slowed down (`--straggler 1:1.2` of the trainer): all-max (not with
   --quick), then Perseus with the coordinator's automatic detection off: N iterations under
   the plan, then a notice through `zeus-coordinator straggler JOB --pipeline 1 --factor 1.2`
   and N iterations with the other pipeline slowed down to the straggler's pace;
5. (not with --quick) the same with automatic detection (the coordinator's
   `straggler_threshold`/`straggler_window`) and no notice.

Every energy and time is what the agents measured and published (per rank and step: the GPU's
energy counter over the step, summed over many consecutive steps, where the counter's coarse
steps telescope; time per iteration: the slowest rank's step). The prediction is the planner's:
the chosen point against the all-max plan evaluated on the same online profile; for a
straggler, the frontier point of least energy no slower than the straggler against the chosen
one. Also shown: the planner on the simulator's exact instruction costs ("truth").

Goal: measured saving within 2 points of the prediction, slowdown <= 1 %, and a further saving
on the non-straggler pipeline(s) under the straggler. Prints a table, then one JSON object as the
last line (with the machine, the date and the load).

`--trainer torch` runs `examples/pipeline_gpt.py` under torchrun instead (4 gloo ranks, one
pipeline, the A100-SXM GPT-3 stages), for `Schedule1F1B`, `ScheduleInterleaved1F1B` and
`ScheduleInterleavedZeroBubble` (`--schedules`): Perseus, then all-max clocks on the orders it
learnt, each schedule's measured saving, predicted saving and slowdown (`_torch_pipeline.py`).

    .venv/bin/python bench/perseus_savings.py [--quick] [--trainer torch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

_path = os.path.dirname(os.path.abspath(__file__))
if _path not in sys.path:
    sys.path.insert(0, _path)
_root = os.path.dirname(_path)
if _root not in sys.path:
    sys.path.insert(0, _root)

from _common import load, machine, now  # noqa: E402

from zeus_agent import children  # noqa: E402
from zeus_demo.pipeline import (  # noqa: E402
    JobContext,
    JobRun,
    PipelineCluster,
    PipelineDemoConfig,
    Side,
    all_max_plan,
    pct_less,
    pct_more,
    resolve_scheduler,
    scheduler_args,
    window_stats,
    write_plan,
)

GOAL = {"saving_vs_prediction_points": 2.0, "slowdown_pct": 1.0,
        "straggler_further_saving_pct": 0.0}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def truth_prediction(cfg: PipelineDemoConfig) -> dict[str, float]:
    """The planner on the simulator's exact instruction costs (P_block: the GPU's idle power)."""
    from coordinator.pipeline import planner
    from zeus_agent.gpu.sim.instructions import instruction_cost, stage_workloads
    from zeus_agent.gpu.sim.presets import PRESETS

    hw = PRESETS[cfg.preset]
    top = max(hw.supported_sm_clocks_mhz)
    rows = []
    for stage, wl in enumerate(stage_workloads(cfg.profile, cfg.stages)):
        for kind in ("forward", "backward"):
            for f in hw.supported_sm_clocks_mhz:
                if f >= cfg.min_clock_fraction * top:
                    t, e = instruction_cost(hw, wl[kind], f)
                    rows.append((stage, kind, f, t * cfg.time_scale, e * cfg.time_scale))
    profile = planner.InstructionProfile.from_rows(rows)
    p_block = float(getattr(hw, "idle_power_w", planner.DEFAULT_P_BLOCK_W))
    m = cfg.microbatches
    frontier = planner.plan_frontier(profile, m, num_stages=cfg.stages, p_block_w=p_block)
    t_max, e_max = planner.evaluate(profile, planner.max_frequency_plan(profile, m), m, p_block)
    chosen = planner.choose(frontier, all_max_time=t_max)
    return {"saving_pct": pct_less(e_max, chosen.energy),
            "time_change_pct": pct_more(t_max, chosen.time), "p_block_w": p_block}


async def _wait_steps(ctx: JobContext, state: str, count: int) -> tuple[int, int]:
    """Wait until `count` steps of every rank ran under the first version of `state`."""
    ranks = sorted({r for r, _ in ctx.observer.steps} or {0})
    while True:
        versions = ctx.observer.versions(state)
        if versions:
            version = versions[0]
            counts = [ctx.observer.steps_at(version, r) for r in ranks]
            if counts and min(counts) >= count:
                return version, max(ctx.observer.last_step(r) for r in ranks)
        ctx.observer.changed.clear()
        await ctx.observer.changed.wait()


def _notice_director(factor: float, pipeline: int, before: int) -> Any:
    async def direct(ctx: JobContext) -> None:
        _, step = await _wait_steps(ctx, "serving", before)
        assert ctx.observer.job_id is not None
        text = await ctx.cluster.straggler_notice(ctx.observer.job_id, pipeline, factor)
        ctx.marks["notice"] = step
        _say(f"  notice sent after step {step}: {text.splitlines()[0] if text else ''}")
    return direct


def _side(run: JobRun, versions: Sequence[int | None], cfg: PipelineDemoConfig,
          limit: int | None = None) -> Side:
    return window_stats(run.observer.steps, run.rank_pipeline, versions,
                        skip=cfg.warmup_iterations, limit=limit)


def _pool(a: Side, b: Side | None) -> Side:
    """Two measurements of the same thing, weighted by their iterations."""
    if b is None or b.iterations == 0:
        return a
    n = a.iterations + b.iterations

    def mean(x: float, y: float) -> float:
        return (x * a.iterations + y * b.iterations) / n

    return Side(n, a.first_step, b.last_step, mean(a.time_s, b.time_s),
                mean(a.energy_j, b.energy_j),
                {d: mean(e, b.pipeline_energy_j.get(d, e)) for d, e in a.pipeline_energy_j.items()},
                a.versions, mean(a.median_time_s, b.median_time_s))


def _slowed_prediction(run: JobRun, factor: float) -> float:
    """The planner's energy change of the least-energy point no slower than the straggler (%)."""
    snap = run.snapshot
    if snap is None or snap.chosen is None:
        return math.nan
    t_c, e_c = snap.chosen
    fits = [e for t, e in snap.frontier if t <= t_c * factor * (1 + 1e-9)]
    return pct_less(e_c, min(fits, default=e_c))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    cfg = PipelineDemoConfig(
        stages=args.stages, dp=args.dp, microbatches=args.microbatches,
        time_scale=args.time_scale, baseline_iterations=args.iterations,
        serve_iterations=args.iterations, warmup_iterations=2, clocks=args.clocks,
        timeout_s=3600)
    scheduler, note = resolve_scheduler("auto", cfg.dp)
    if note:
        raise SystemExit(f"perseus_savings: {note}")
    cluster = PipelineCluster(cfg, log_level=args.log_level)
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        runs = await _run_jobs(args, cfg, cluster, scheduler)
    finally:
        await cluster.stop()
    out["no_straggler"] = ns = _no_straggler(runs, cfg)
    out["straggler"] = strag = _straggler(runs, cfg, args)
    out["met"] = {
        "saving_within_2_points": abs(ns["measured_saving_pct"] - ns["predicted_saving_pct"])
        <= GOAL["saving_vs_prediction_points"],
        "slowdown_at_most_1pct": ns["slowdown_pct"] <= GOAL["slowdown_pct"],
        "further_saving_under_straggler": strag["further_saving_others_pct"]
        > GOAL["straggler_further_saving_pct"],
    }
    out["elapsed_s"] = time.monotonic() - started
    return out


async def _run_jobs(args: argparse.Namespace, cfg: PipelineDemoConfig, cluster: PipelineCluster,
                    scheduler: str) -> dict[str, JobRun]:
    """Start the cluster and run the jobs of the module docstring in turn (fewer with --quick)."""
    baseline_name = "PointSolution3D" if cfg.dp > 1 else "PointSolution"
    straggler = (args.straggler_pipeline, args.straggler_factor)
    n, w = cfg.baseline_iterations, cfg.warmup_iterations
    await cluster.start()
    plan = write_plan(cluster.root / "all-max.json",
                      all_max_plan(cfg.stages, cfg.microbatches, cluster.top_clock_mhz))
    budget = cfg.profiling_budget(cluster.available_clocks)

    async def all_max(label: str, slow: tuple[int, float] | None) -> JobRun:
        _say(f"{label}: all-max clocks, {5 + w + n} iterations")
        return await cluster.run_job(baseline_name, {"solution_path": plan}, 5 + w + n,
                                     label=label, straggler=slow)

    async def perseus(label: str, iterations: int, **kw: Any) -> JobRun:
        _say(f"{label}: {scheduler}, {iterations} iterations")
        return await cluster.run_job(scheduler, scheduler_args(scheduler, cfg), iterations,
                                     label=label, perseus_snapshot=True, **kw)

    runs: dict[str, JobRun] = {}
    runs["all_max"] = await all_max("all-max", None)
    runs["perseus"] = await perseus("perseus", budget + w + n, detect_stragglers=False)
    if not args.quick:
        runs["all_max_again"] = await all_max("all-max-again", None)
        runs["all_max_straggler"] = await all_max("all-max-straggler", straggler)
    runs["notice"] = await perseus(
        "perseus-straggler-notice", budget + 2 * (w + n) + 6, straggler=straggler,
        detect_stragglers=False,
        director=_notice_director(args.straggler_factor, args.straggler_pipeline, w + n))
    if not args.quick:
        runs["auto"] = await perseus(
            "perseus-straggler-auto", budget + 2 * (w + n) + 6, straggler=straggler,
            detect_stragglers=True)
    return runs


def _versions(run: JobRun) -> Sequence[int | None]:
    return sorted(run.schedules) or [0]


def _no_straggler(runs: dict[str, JobRun], cfg: PipelineDemoConfig) -> dict[str, Any]:
    """All-max (pooled over its runs) against Perseus's served plan, and the predictions."""
    n = cfg.baseline_iterations
    base = _pool(_side(runs["all_max"], _versions(runs["all_max"]), cfg, n),
                 _side(runs["all_max_again"], _versions(runs["all_max_again"]), cfg, n)
                 if "all_max_again" in runs else None)
    p_run = runs["perseus"]
    served = p_run.observer.versions("serving")
    opt = _side(p_run, served[-1:], cfg) if served else _side(p_run, [-1], cfg)
    snap = p_run.snapshot
    return {
        "all_max": base.to_json(), "perseus": opt.to_json(), "job": p_run.job_id,
        "measured_saving_pct": pct_less(base.energy_j, opt.energy_j),
        "slowdown_pct": pct_more(base.time_s, opt.time_s),
        "median_slowdown_pct": pct_more(base.median_time_s, opt.median_time_s),
        "predicted_saving_pct": snap.predicted_saving_pct if snap is not None else math.nan,
        "predicted_time_change_pct": snap.predicted_slowdown_pct if snap else None,
        "truth": truth_prediction(cfg),
        "p_block_fitted_w": snap.p_block_w if snap else None,
        "frontier_points": len(snap.frontier) if snap else 0,
        "late_clocks": sum(r.late_clocks for r in p_run.result.ranks),
        "all_max_runs": [runs[k].job_id for k in ("all_max", "all_max_again") if k in runs],
    }


def _others_energy(side: Side, others: Sequence[int]) -> float:
    """The energy of the non-straggler pipelines `others`."""
    return sum(side.pipeline_energy_j.get(d, math.nan) for d in others)


def _straggler(runs: dict[str, JobRun], cfg: PipelineDemoConfig,
               args: argparse.Namespace) -> dict[str, Any]:
    """Perseus under the straggler before and after the notice (and all-max, auto-detection)."""
    n = cfg.baseline_iterations
    s_run = runs["notice"]
    s_served = s_run.observer.versions("serving")
    s_strag = s_run.observer.versions("straggler")
    notice_step = s_run.marks.get("notice")
    without = (_side(s_run, s_served[:1], cfg, n) if s_served else _side(s_run, [-1], cfg))
    with_notice = (_side(s_run, s_strag[-1:], cfg) if s_strag and notice_step is not None
                   else _side(s_run, [-1], cfg))
    others = [d for d in range(cfg.dp) if d != args.straggler_pipeline]
    strag: dict[str, Any] = {
        "straggler": f"{args.straggler_pipeline}:{args.straggler_factor:g}",
        "job": s_run.job_id,
        "perseus_without_handling": without.to_json(),
        "perseus_with_notice": with_notice.to_json(),
        "notice_after_step": notice_step,
        "further_saving_others_pct": pct_less(_others_energy(without, others),
                                              _others_energy(with_notice, others)),
        "further_saving_job_pct": pct_less(without.energy_j, with_notice.energy_j),
        "time_change_with_notice_pct": pct_more(without.time_s, with_notice.time_s),
        "predicted_further_saving_others_pct": _slowed_prediction(s_run, args.straggler_factor),
        "statuses": [ev.message for ev in s_run.observer.statuses if ev.state == "straggler"][:3],
    }
    if "all_max_straggler" in runs:
        am = _side(runs["all_max_straggler"], _versions(runs["all_max_straggler"]), cfg, n)
        strag["all_max"] = am.to_json()
        strag["saving_vs_all_max_without_pct"] = pct_less(am.energy_j, without.energy_j)
        strag["saving_vs_all_max_with_notice_pct"] = pct_less(am.energy_j, with_notice.energy_j)
        strag["slowdown_vs_all_max_with_notice_pct"] = pct_more(am.time_s, with_notice.time_s)
    if "auto" in runs:
        strag["auto"] = _auto_detection(runs["auto"], without, others, cfg)
    return strag


def _auto_detection(a_run: JobRun, without: Side, others: Sequence[int],
                    cfg: PipelineDemoConfig) -> dict[str, Any]:
    """The run with automatic detection against Perseus without handling the straggler."""
    a_strag = a_run.observer.versions("straggler")
    a_served = a_run.observer.versions("serving")
    detected = _side(a_run, a_strag[-1:], cfg) if a_strag else _side(a_run, [-1], cfg)
    return {
        "job": a_run.job_id, "detected": bool(a_strag), "detected_side": detected.to_json(),
        "first_served_iterations": (_side(a_run, a_served[:1], cfg).iterations
                                    if a_served else 0),
        "further_saving_others_pct": pct_less(_others_energy(without, others),
                                              _others_energy(detected, others)),
        "time_change_pct": pct_more(without.time_s, detected.time_s),
        "factor": next((ev.progress.get("stragglers") for ev in a_run.observer.statuses
                        if ev.state == "straggler"), None),
    }


def _f(x: Any, digits: int = 1, unit: str = "") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else (
        f"{x:.{digits}f}{unit}")


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    ns = result["no_straggler"]
    rows = [("all-max" + (" (2 runs pooled)" if len(ns["all_max_runs"]) > 1 else ""),
             ns["all_max"]), ("Perseus (served plan)", ns["perseus"])]
    st = result["straggler"]
    rows += [(f"straggler {st['straggler']}: all-max", st["all_max"])] if "all_max" in st else []
    rows += [(f"straggler {st['straggler']}: Perseus, no handling",
              st["perseus_without_handling"]),
             (f"straggler {st['straggler']}: Perseus + notice", st["perseus_with_notice"])]
    if "auto" in st:
        rows.append((f"straggler {st['straggler']}: Perseus + detection",
                     st["auto"]["detected_side"]))
    print(f"{'':45s} {'iter s':>8s} {'median':>8s} {'J/iter':>8s} " + " ".join(
        f"{'J pipe' + str(d):>8s}" for d in range(args.dp)) + f" {'iters':>6s}")
    for name, side in rows:
        pipes = side["energy_per_iteration_by_pipeline_j"]
        print(f"{name:45s} {_f(side['time_per_iteration_s'], 4):>8s} "
              f"{_f(side['median_time_per_iteration_s'], 4):>8s} "
              f"{_f(side['energy_per_iteration_j']):>8s} "
              + " ".join(f"{_f(pipes.get(str(d))):>8s}" for d in range(args.dp))
              + f" {side['iterations']:>6d}")
    print(f"no straggler: measured saving {_f(ns['measured_saving_pct'])} % vs predicted "
          f"{_f(ns['predicted_saving_pct'])} % (planner on the simulator's true costs: "
          f"{_f(ns['truth']['saving_pct'])} %); slowdown {_f(ns['slowdown_pct'], 2)} % of the "
          f"mean iteration time, {_f(ns['median_slowdown_pct'], 2)} % of the median "
          f"(predicted {_f(ns['predicted_time_change_pct'], 2)} %)")
    print(f"straggler {st['straggler']}: with the notice, non-straggler pipeline(s) "
          f"{_f(st['further_saving_others_pct'])} % less energy (predicted "
          f"{_f(st['predicted_further_saving_others_pct'])} %), job "
          f"{_f(st['further_saving_job_pct'])} % less, iteration time "
          f"{_f(st['time_change_with_notice_pct'], 2, ' %')}")
    if "auto" in st:
        a = st["auto"]
        print(f"straggler {st['straggler']}: automatic detection "
              f"{'found it' if a['detected'] else 'did NOT find it'} (factor {a['factor']}): "
              f"non-straggler pipeline(s) {_f(a['further_saving_others_pct'])} % less energy, "
              f"iteration time {_f(a['time_change_pct'], 2, ' %')}")
    print(f"goals met: {result['met']}; {result['elapsed_s']:.0f} s; machine: {machine()}; "
          f"date: {now()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer iterations; no second all-max run, no all-max and no automatic "
                   "detection run under the straggler")
    p.add_argument("--dp", type=int, default=2, help="data-parallel pipelines")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="factor on instruction times and the energy counter's period (default 1: "
                   "the profiled job's real times; below 1 NVML's call costs are not scaled, so "
                   "clock changes weigh more than on a real GPU and the slowdown reads high)")
    p.add_argument("--iterations", type=int, default=None,
                   help="iterations measured per side (default 24, --quick 16)")
    p.add_argument("--clocks", type=int, default=None,
                   help="profiler grid clocks (default 6, --quick 4)")
    p.add_argument("--straggler-pipeline", type=int, default=1)
    p.add_argument("--straggler-factor", type=float, default=1.2)
    p.add_argument("--log-level", default="ERROR")
    p.add_argument("--trainer", choices=("sim", "torch"), default="sim",
                   help="sim: the simulated pipeline trainer; torch: examples/pipeline_gpt.py "
                   "under torchrun (torch.distributed.pipelining, one pipeline of 4 ranks)")
    p.add_argument("--schedules", default=None,
                   help="--trainer torch: comma-separated torch schedules (default "
                   "1F1B,Interleaved1F1B,InterleavedZeroBubble)")
    p.add_argument("--profile", default=None,
                   help="--trainer torch: stage profile (default gpt3-175b+a100_sxm)")
    args = p.parse_args(argv)
    if args.time_scale != 1:
        _say(f"scaled: instruction times and the energy counter x{args.time_scale:g}, but not "
             "what NVML calls cost (the h200 model: a counter read ~3 ms, a clock change 1 ms), "
             "so clock changes weigh more than on a real GPU and the slowdown reads high")
    if args.iterations is None:
        args.iterations = 16 if args.quick else 24
    if args.clocks is None:
        args.clocks = 4 if args.quick else 6
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    if args.trainer == "torch":
        return _torch_main(args)
    result = asyncio.run(bench(args))
    print_table(result, args)
    print(json.dumps({"bench": "perseus_savings", "machine": machine(), "date": now(),
                      "args": vars(args), "goal": GOAL, **result}, default=str))
    return 0


def _torch_main(args: argparse.Namespace) -> int:
    import _torch_pipeline as torch_pipeline

    args.schedules = (args.schedules.split(",") if args.schedules
                      else list(torch_pipeline.TORCH_SCHEDULES))
    load_before = load()
    result = asyncio.run(torch_pipeline.bench_torch(args))
    result["met"] = torch_pipeline.met(result, GOAL)
    torch_pipeline.print_table(result)
    print(f"goals met: {result['met']}; {result['elapsed_s']:.0f} s; load {load_before} -> "
          f"{load()}; machine: {machine()}; date: {now()}")
    print(json.dumps({"bench": "perseus_savings", "machine": machine(), "date": now(),
                      "load_before": load_before, "load_after": load(), "args": vars(args),
                      "goal": GOAL, **result}, default=str))
    return 0


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        code = main()
    raise SystemExit(code)
