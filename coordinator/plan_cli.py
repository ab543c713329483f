"""`zeus-coordinator plan`: the Perseus iteration time-energy frontier of an instruction profile.

    zeus-coordinator plan PROFILE.csv --microbatches M [--stages S] [--p2p-power W]
        [--unit-time S] [--schedule NAME [--virtual-stages V]] --out DIR

Reads the profile (Zeus 0.16's `InstructionProfilingResult` CSV or lowtime 0.3.0's
`stage,instruction,frequency,time,energy`), plans the frontier of one iteration of the named
schedule (default synchronous 1F1B; `coordinator.pipeline.planner.schedules` writes each rank's
order, `plan_frontier` plans it; a stage of the profile is a rank, whose virtual stages share
its rows; `zero-bubble` needs `backward_input` and `backward_weight` rows) and writes:

* `DIR/frontier.csv`: `index,time,energy`, fastest first (seconds, joules);
* `DIR/freqs_pipeline_%05d.py`, one per frontier point (same index): a Python list with one list
  of `("forward", 1410)`-style (instruction, MHz) tuples per stage in execution order, as
  lowtime's Perseus script writes, which `PointSolution` / `PointSolution3D` load (schedules
  other than 1F1B and GPipe name each action `kind:stage:microbatch`, as trainers report them).

Progress goes to stderr. Exit codes: 0 ok, 2 usage or a bad profile, 3 the output cannot be
written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from coordinator.pipeline.planner import DEFAULT_P_BLOCK_W, FrontierPoint, plan_frontier
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.planner.profile_file import load_profile
from coordinator.pipeline.planner.schedules import SCHEDULES, rank_orders

__all__ = ["build_parser", "main", "write_frontier"]


def build_parser(prog: str = "zeus-coordinator plan") -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plan the iteration time-energy frontier (Perseus) of a pipeline from an "
        "instruction profile and write one frequency plan per frontier point.",
    )
    parser.add_argument("profile", help="instruction profile CSV (Zeus or lowtime columns)")
    parser.add_argument(
        "--microbatches", type=int, required=True, help="microbatches per iteration"
    )
    parser.add_argument(
        "--stages", type=int, default=None, help="pipeline stages (default: the profile's)"
    )
    parser.add_argument(
        "--p2p-power",
        type=float,
        default=DEFAULT_P_BLOCK_W,
        metavar="W",
        help=f"power of a GPU blocked waiting for another stage, W (default {DEFAULT_P_BLOCK_W})",
    )
    parser.add_argument(
        "--unit-time",
        type=float,
        default=None,
        metavar="S",
        help="time resolution of the frontier in seconds (default: 1/2000 of the fastest "
        "iteration time; 0 keeps every point)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="the pipeline schedule to plan (default 1f1b)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="stages per rank for looped-bfs, interleaved-1f1b and zero-bubble (default 2 for "
        "the first two, 1 for zero-bubble)",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    return parser


def format_plan(point: FrontierPoint) -> str:
    """The plan as lowtime writes it: a Python list of per-stage lists of (name, MHz) tuples."""
    stages = ", ".join(
        "[" + ", ".join(f"({name!r}, {freq})" for name, freq in row) + "]" for row in point.plan
    )
    return f"[{stages}]\n"


def write_frontier(frontier: Sequence[FrontierPoint], out: Path) -> None:
    """Write `frontier.csv` and one `freqs_pipeline_%05d.py` per point into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["index,time,energy\n"]
    for index, point in enumerate(frontier):
        lines.append(f"{index},{point.time!r},{point.energy!r}\n")
        (out / f"freqs_pipeline_{index:05d}.py").write_text(format_plan(point), encoding="utf-8")
    (out / "frontier.csv").write_text("".join(lines), encoding="utf-8")


def _progress(stream: TextIO) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A progress callback for `plan_frontier` and a function that closes it."""
    if stream.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("planning"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=Console(file=stream),
            transient=True,
        )
        bar.start()
        task = bar.add_task("plan", total=1000)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return update, bar.stop
    last = [-1]

    def plain(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"planning: {10 * tenth}%", file=stream, flush=True)

    return plain, lambda: None


def main(argv: Sequence[str] | None = None, prog: str = "zeus-coordinator plan") -> int:
    """Run the command; returns the exit code."""
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.microbatches < 1:
        print(f"{prog}: --microbatches must be >= 1", file=sys.stderr)
        return 2
    if args.stages is not None and args.stages < 1:
        print(f"{prog}: --stages must be >= 1", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot use the profile: {e}", file=sys.stderr)
        return 2
    try:
        stages = args.stages or profile.num_stages
        orders = rank_orders(args.schedule, stages, args.microbatches, args.virtual_stages)
        schedule = LearnedSchedule.from_orders(orders)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    update, close = _progress(sys.stderr)
    try:
        frontier = plan_frontier(
            profile,
            args.microbatches,
            num_stages=stages,
            p_block_w=args.p2p_power,
            unit_time=args.unit_time,
            progress=update,
            schedule=schedule,
        )
    except ValueError as e:
        close()
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    close()
    out = Path(args.out)
    try:
        write_frontier(frontier, out)
    except OSError as e:
        print(f"{prog}: cannot write to {out}: {e}", file=sys.stderr)
        return 3
    fastest, cheapest = frontier[0], frontier[-1]
    print(
        f"{len(frontier)} frontier points written to {out}: fastest {fastest.time:.4f} s "
        f"{fastest.energy:.1f} J, least energy {cheapest.time:.4f} s {cheapest.energy:.1f} J",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
