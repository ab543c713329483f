"""The simulated pipeline trainer's command line: `python -m zeus_agent.gpu.sim.trainers.pipeline`.

`main(argv)` parses the job and its placement (one node, or `--node` repeated), opens each
rank's simulated GPU first (a clear message for a wrong `--sim-dir`), runs the job
(`job.run_pipeline`) with progress on stderr, and optionally writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from zeus_agent.gpu.sim.trainers.pipeline.job import (
    SYNTHETIC_PROFILE,
    NodeSpec,
    PipelineError,
    PipelineOptions,
    RankPlacement,
    _describe,
    _preset_for,
    place_ranks,
    run_pipeline,
    stage_profiles,
)

__all__ = ["main"]

_PROG = "python -m zeus_agent.gpu.sim.trainers.pipeline"


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
    """The command line: the job, where its ranks run, and how long they wait."""
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
    _add_job_arguments(parser)
    _add_placement_arguments(parser)
    _add_timing_arguments(parser)
    parser.add_argument(
        "--output",
        default=None,
        help="Write the result (job id, per rank per iteration: time, work "
        "energy, SM clocks, schedule version) as JSON to this file",
    )
    return parser


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """What the job is: its stage profile, degrees, length, speed and straggler."""
    profiles = stage_profiles()
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


def _add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the ranks run: one node, or `--node` repeated."""
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


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """How long the ranks wait for a clock lock, a peer, and the whole job."""
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
