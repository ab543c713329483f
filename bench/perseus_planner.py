"""Perseus frontier planner vs lowtime 0.3.0 on the Perseus artifact's stage profiles.

For every profile in data/perseus/stage_profiles/ and 8 stages x M microbatches (M = 12, 24, 48,
96): the planner's seconds (`coordinator.pipeline.planner.plan_frontier`, default resolution) and,
in the same run, lowtime 0.3.0's Phillips-Dessouky solver on the same inputs (1 ms quantum,
exponential cost model, as its Perseus script does) while a total time budget lasts
(`--lowtime-budget-s`, default 900; `--no-lowtime` skips it). Every lowtime plan is evaluated on
the profile's rows exactly as ours are (`evaluate`: critical path and energy formula); the gap
is, at each lowtime plan's iteration time, (our least energy at or below that time) / (its
energy) - 1: positive when ours is worse. Also: whether our T_min equals the 1F1B critical path
at every instruction's fastest option and, for the A100 profiles, the floor-quantized T_min of
lowtime's stored frontiers in data/perseus/frontiers/a100_sxm/.

`--schedule` plans another schedule (`coordinator.pipeline.planner.schedules`: the stage
profile's stages are the ranks, each rank's virtual stages share its rows; `zero-bubble` splits
each backward row into a `backward_input` and a `backward_weight` row of half its time and
energy, an assumption of this bench); lowtime, which plans 1F1B only, is then skipped. Each case
reports the planner's wall and CPU seconds, the process's peak RSS so far (MB), a digest of the
frontier (exact times, energies and plans: `frontier_sha256`), the sweep's
steps (`iterations`: one least-cost cut each, a max flow started from the last step's flow
or none when that flow is still maximum) and the distinct rounded plans it recorded
(`candidates`).

The last line printed is one JSON object.

    .venv/bin/python bench/perseus_planner.py [--microbatches 12 24] [--lowtime-budget-s 900]
        [--schedule interleaved-1f1b --virtual-stages 2]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import machine, now  # noqa: E402

from coordinator.pipeline.planner import (  # noqa: E402
    DEFAULT_P_BLOCK_W,
    FrontierPoint,
    InstructionProfile,
    PlannerStats,
    evaluate,
    max_frequency_plan,
    plan_frontier,
)
from coordinator.pipeline.planner.dag import PipelineSchedule, build_dag  # noqa: E402
from coordinator.pipeline.planner.learned import LearnedSchedule, node_kind  # noqa: E402
from coordinator.pipeline.planner.profile_file import load_profile  # noqa: E402
from coordinator.pipeline.planner.schedules import SCHEDULES, rank_orders  # noqa: E402

PROFILES = ROOT / "data" / "perseus" / "stage_profiles"
FRONTIERS = ROOT / "data" / "perseus" / "frontiers" / "a100_sxm"
P_BLOCK_W = DEFAULT_P_BLOCK_W  # The artifact's A100 figure, also used for the A40 profiles.


class LowtimeBudgetExceeded(Exception):
    """lowtime did not finish within its budget."""


def lowtime_frontier(
    profile: InstructionProfile,
    num_microbatches: int,
    p_block_w: float = P_BLOCK_W,
    unit_time: float = 1e-3,
    budget_s: float = math.inf,
) -> tuple[list[tuple[float, float, tuple[tuple[tuple[str, int], ...], ...]]], bool]:
    """lowtime 0.3.0's frontier for synchronous 1F1B, each plan evaluated on the raw rows.

    Builds the DAG as lowtime's Perseus script does (one `OperationSpec` per stage and
    instruction with an `ExponentialModel` fit on (time, energy - P_block * time)), runs
    `PhillipsDessouky` and evaluates the plan of every iteration (and the starting one) with
    `evaluate`. Returns ([(T, E, plan), ...] slowest first, finished), stopping early when
    `budget_s` is used up or lowtime's flow solver fails (it panics in Rust on an infeasible
    flow, an exception that derives from BaseException).
    """
    from lowtime.perseus.instruction import Forward
    from lowtime.solver import PhillipsDessouky

    deadline = time.monotonic() + budget_s
    dag, stage_ops = _lowtime_dag(profile, num_microbatches, p_block_w, unit_time)

    def current() -> tuple[float, float, tuple[tuple[tuple[str, int], ...], ...]]:
        plan = tuple(
            tuple(
                ("forward" if isinstance(op, Forward) else "backward", int(op.assigned_knob))
                for op in ops
            )
            for ops in stage_ops
        )
        t, e = evaluate(profile, plan, num_microbatches, p_block_w)
        return t, e, plan

    points = []
    solver = PhillipsDessouky(dag)
    finished = False
    generator = solver.run()
    try:
        while True:
            if time.monotonic() > deadline:
                break
            try:
                next(generator)
            except StopIteration:
                finished = True
                break
            points.append(current())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - lowtime's Rust panics derive from BaseException.
        finished = True
    return points, finished


def _lowtime_dag(
    profile: InstructionProfile, num_microbatches: int, p_block_w: float, unit_time: float
) -> tuple[Any, list[list[Any]]]:
    """lowtime's DAG of synchronous 1F1B (as its Perseus script builds it) and each stage's ops."""
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward, Instruction
    from lowtime.perseus.schedule import Synchronous1F1B as LowtimeSchedule

    num_stages = profile.num_stages
    stage_ops: list[list[Instruction]] = []
    dag = nx.DiGraph()
    for stage in range(num_stages):
        specs: dict[type, OperationSpec] = {}
        for cls, name in ((Forward, "forward"), (Backward, "backward")):
            options = [
                ExecutionOption(
                    real_time=t, unit_time=unit_time, cost=e - p_block_w * t, knob=f
                )
                for f, t, e in profile.entries[(stage, name)]
            ]
            candidates = CandidateExecutionOptions(options=options)
            specs[cls] = OperationSpec(options=candidates, cost_model=ExponentialModel(candidates))
        ops = list(LowtimeSchedule(num_stages, num_microbatches, stage, specs))
        stage_ops.append(ops)
    node_of: dict[tuple[int, str, int], int] = {}
    for ops in stage_ops:
        for op in ops:
            node_id = len(node_of)
            kind = "forward" if isinstance(op, Forward) else "backward"
            node_of[(op.stage_id, kind, op.micro_batch_id)] = node_id
            dag.add_node(node_id, op=op)
    for ops in stage_ops:
        for a, b in zip(ops, ops[1:], strict=False):
            dag.add_edge(node_of[_key(a)], node_of[_key(b)])
    for m in range(num_microbatches):
        for s in range(num_stages - 1):
            dag.add_edge(node_of[(s, "forward", m)], node_of[(s + 1, "forward", m)])
            dag.add_edge(node_of[(s + 1, "backward", m)], node_of[(s, "backward", m)])
    source, sink = len(node_of), len(node_of) + 1
    add_source_node(dag, source)
    add_sink_node(dag, sink)
    dag.graph["source_node"] = source
    dag.graph["sink_node"] = sink
    return dag, stage_ops


def _key(op: Any) -> tuple[int, str, int]:
    from lowtime.perseus.instruction import Forward

    return (op.stage_id, "forward" if isinstance(op, Forward) else "backward", op.micro_batch_id)


def energy_gap(
    ours: Sequence[FrontierPoint], theirs: Sequence[tuple[float, float, Any]]
) -> tuple[float, int]:
    """(largest relative excess of our energy over theirs at their times, points compared)."""
    worst = -math.inf
    compared = 0
    ours_sorted = sorted(ours, key=lambda p: p.time)
    for t, e, _ in theirs:
        best = min((p.energy for p in ours_sorted if p.time <= t * (1 + 1e-12)), default=None)
        if best is None:
            continue
        compared += 1
        worst = max(worst, best / e - 1.0)
    return worst, compared


def fastest_critical_path(
    profile: InstructionProfile, schedule: PipelineSchedule
) -> tuple[float, int]:
    """(critical path with every instruction at its fastest option, same floor-quantized to ms)."""
    dag = build_dag(schedule)
    fastest = {key: min(t for _, t, _ in rows) for key, rows in profile.entries.items()}
    real = [fastest[(n.stage, node_kind(n))] for n in dag.nodes]
    quant = [float(math.floor(t / 1e-3 + 1e-9)) for t in real]
    return dag.longest_path(real), round(dag.longest_path(quant))


def frontier_digest(frontier: Sequence[FrontierPoint]) -> str:
    """SHA-256 of every point's exact time, energy and plan: equal digests, equal frontiers."""
    text = json.dumps([(p.time.hex(), p.energy.hex(), p.plan) for p in frontier])
    return hashlib.sha256(text.encode()).hexdigest()


def stored_tmin(model: str, num_microbatches: int) -> float | None:
    """T_min of lowtime's stored frontier (fastest row), if there is one."""
    path = FRONTIERS / f"{model}_bf16_mb{num_microbatches}.csv.gz"
    if not path.exists():
        return None
    with gzip.open(path, "rt") as f:
        next(f)
        return min(float(line.split(",")[0]) for line in f if line.strip())


def plan_case(
    profile: InstructionProfile, name: str, m: int, schedule_name: str, virtual_stages: int | None
) -> tuple[dict[str, Any], list[FrontierPoint]]:
    """Our planner on one profile and microbatch count: the case's figures and its frontier."""
    schedule = LearnedSchedule.from_orders(
        rank_orders(schedule_name, profile.num_stages, m, virtual_stages))
    stats = PlannerStats()
    start, cpu = time.perf_counter(), time.process_time()
    frontier = plan_frontier(profile, m, p_block_w=P_BLOCK_W, stats=stats, schedule=schedule)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    t_fast, t_fast_quant = fastest_critical_path(profile, schedule)
    top = max_frequency_plan(profile, m, schedule)
    all_max = evaluate(profile, top, m, P_BLOCK_W, schedule=schedule)
    case: dict[str, Any] = {
        "profile": name,
        "schedule": schedule_name,
        "stages": profile.num_stages,
        "virtual_stages": schedule.num_virtual_stages // profile.num_stages,
        "microbatches": m,
        "planner_s": round(seconds, 2),
        "planner_cpu_s": round(cpu, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "iterations": stats.iterations,
        "candidates": stats.candidates,
        "points": len(frontier),
        "t_min": frontier[0].time,
        "t_min_is_fastest_critical_path": abs(frontier[0].time - t_fast) <= 1e-9 * t_fast,
        "saving_at_t_min": 1 - frontier[0].energy / all_max[1],
        "t_max": frontier[-1].time,
        "frontier_sha256": frontier_digest(frontier),
    }
    if "a100" in name and schedule_name == "1f1b":
        stored = stored_tmin(name.split("+")[0], m)
        if stored is not None:
            case["stored_lowtime_t_min_ms"] = round(stored * 1000)
            case["t_min_quantized_matches_stored"] = round(stored * 1000) == t_fast_quant
    return case, frontier


def lowtime_case(case: dict[str, Any], profile: InstructionProfile, m: int,
                 frontier: list[FrontierPoint], budget_s: float) -> float:
    """lowtime on the same case within `budget_s` (figures added to `case`); its seconds."""
    start = time.perf_counter()
    theirs, finished = lowtime_frontier(profile, m, budget_s=budget_s)
    lt_seconds = time.perf_counter() - start
    gap, compared = energy_gap(frontier, theirs)
    case.update(
        lowtime_s=round(lt_seconds, 1),
        lowtime_finished=finished,
        lowtime_points=len(theirs),
        lowtime_t_min=min((t for t, _, _ in theirs), default=None),
        max_energy_gap_vs_lowtime=gap if compared else None,
        points_compared=compared,
    )
    return lt_seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--profiles", nargs="+", default=None, help="names in stage_profiles/")
    parser.add_argument("--lowtime-budget-s", type=float, default=900.0)
    parser.add_argument("--no-lowtime", action="store_true")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=None, metavar="V")
    args = parser.parse_args(argv)
    names = args.profiles or sorted(p.stem for p in PROFILES.glob("*.csv"))
    lowtime_left = 0.0 if args.no_lowtime or args.schedule != "1f1b" else args.lowtime_budget_s
    cases: list[dict[str, Any]] = []
    profiles = {name: load_profile(PROFILES / f"{name}.csv") for name in names}
    if args.schedule == "zero-bubble":
        profiles = {name: p.with_split_backward() for name, p in profiles.items()}
    # Smallest pipelines first, so lowtime's budget covers as many cases as it can.
    for m in args.microbatches:
        for name in names:
            case, frontier = plan_case(profiles[name], name, m, args.schedule,
                                       args.virtual_stages)
            if lowtime_left > 0:
                lowtime_left -= lowtime_case(case, profiles[name], m, frontier, lowtime_left)
            print(json.dumps(case), flush=True)
            cases.append(case)
    gaps = [c["max_energy_gap_vs_lowtime"] for c in cases if c.get("max_energy_gap_vs_lowtime")]
    summary = {
        "bench": "perseus_planner",
        "machine": machine(),
        "date": now(),
        "p_block_w": P_BLOCK_W,
        "schedule": args.schedule,
        "max_planner_s": max(c["planner_s"] for c in cases),
        "max_planner_cpu_s": max(c["planner_cpu_s"] for c in cases),
        "load_average": [round(x, 2) for x in __import__("os").getloadavg()],
        "all_t_min_match": all(c["t_min_is_fastest_critical_path"] for c in cases),
        "all_stored_t_min_match": all(
            c.get("t_min_quantized_matches_stored", True) for c in cases
        ),
        "max_energy_gap_vs_lowtime": max(gaps) if gaps else None,
        "cases": cases,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
