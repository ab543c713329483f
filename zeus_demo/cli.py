"""`zeus-demo`'s command line: `build_parser`, `parse_config` and `main`, the console script.

`main(argv)` runs the power-limit part (`zeus_demo.power_limit`), then the pipeline part
(`zeus_demo.pipeline`), prints their tables and writes the report; it is the only place errors
become exit codes (0 done, 1 the demo failed, 2 bad options, 3 NATS or a service did not
start).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from zeus_agent.children import sigterm_as_sigint
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
from zeus_demo.budget.demo import render_budget_table, run_budget_demo
from zeus_demo.compare import compare
from zeus_demo.config import (
    SELECTORS,
    DemoConfig,
    DemoConfigError,
    DemoError,
    DemoStartupError,
    default_workload,
)
from zeus_demo.pipeline import (
    PipelineDemoError,
    render_pipeline_table,
    run_pipeline_demo,
    write_pipeline_report,
)
from zeus_demo.power_limit import run_demo
from zeus_demo.report import SUMMARY_VERSION, render_table, write_report

LOG = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STARTUP_FAILURE = 3

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _cluster_options(p: argparse.ArgumentParser, d: DemoConfig) -> None:
    """The simulated cluster and workload."""
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=d.nodes, help="simulated nodes, one agent each")
    g.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node,
                   help="simulated GPUs per node")
    g.add_argument("--job-gpus", type=int, default=d.job_gpus,
                   help="GPUs (ranks) of the data-parallel job, spread evenly over the nodes")
    g.add_argument("--preset", default=d.preset, choices=list(PRESETS),
                   help="simulated GPU model")
    g.add_argument("--workload", default=None, metavar="NAME",
                   help="simulated workload, one of: " + ", ".join(WORKLOADS)
                   + ". Default: the preset's fitted resnet50 data-parallel profile "
                   f"({default_workload('A40')} for A40; A40's for presets without one)")


def _power_limit_options(p: argparse.ArgumentParser, d: DemoConfig) -> None:
    """The power-limit optimizer's selector and profiling."""
    g = p.add_argument_group("power-limit optimizer")
    g.add_argument("--selector", default=d.selector, choices=SELECTORS,
                   help="optimum selector (Zeus's)")
    g.add_argument("--eta-knob", type=float, default=d.eta_knob,
                   help="ZeusCost eta: weight of energy vs. time, 0..1")
    g.add_argument("--max-slowdown", type=float, default=d.max_slowdown,
                   help="MaxSlowdownConstraint factor: slowest acceptable time / fastest")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="warm-up steps at each power limit before it is measured")
    g.add_argument("--profile-steps", type=int, default=d.profile_steps,
                   help="steps measured at each power limit")
    g.add_argument("--search", default=d.search, choices=["exhaustive", "adaptive"],
                   help="profile every power limit, or search adaptively")


def _job_options(p: argparse.ArgumentParser, d: DemoConfig) -> None:
    """The data-parallel job's length, speed and seed."""
    g = p.add_argument_group("job")
    g.add_argument("--steps", type=int, default=d.steps, help="steps per epoch")
    g.add_argument("--epochs", type=int, default=d.epochs, help="epochs")
    g.add_argument("--scale", type=float, default=d.scale,
                   help="factor on the simulated step time (0.1: ten times faster than real)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the simulated noise")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="give up on the job after this many seconds")


def _pipeline_options(p: argparse.ArgumentParser, d: DemoConfig) -> None:
    """The pipeline part (Perseus) and the choice of parts."""
    g = p.add_argument_group("pipeline frequency optimizer (Perseus)")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--skip-pipeline", action="store_true",
                       help="leave the pipeline part out (power-limit part only)")
    which.add_argument("--pipeline-only", action="store_true",
                       help="run only the pipeline part")
    which.add_argument("--budget", action="store_true",
                       help="instead of the two parts, play a grid event: 6 jobs on 3 nodes pin "
                       "their optima, then a power budget cuts their draw by 25%%, holds and "
                       "lifts; REPORT_DIR/budget_event.png draws their power against the cap "
                       "and each job's throughput (about 1.5 minutes)")
    g.add_argument("--pipeline-stages", type=int, default=d.pipeline_stages,
                   help="pipeline stages of the pipeline job (2-8; the last one is GPT-3's "
                   "heavier last stage)")
    g.add_argument("--pipeline-dp", type=int, default=d.pipeline_dp,
                   help="data-parallel pipelines (DP degree) of the pipeline job")
    g.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="microbatches per pipeline iteration")
    g.add_argument("--pipeline-time-scale", type=float, default=d.pipeline_time_scale,
                   help="factor on the simulated instruction times (default 1: the profiled "
                   "job's real times, ~2.8 s per iteration, with the real 100 ms energy counter "
                   "and the h200 NVML costs; 0.1: ten times faster, the counter scaled alike but "
                   "not the NVML call costs (a 3 ms counter read, a 1 ms clock change), so the "
                   "measured slowdown is overstated)")
    g.add_argument("--pipeline-iterations", type=int, default=d.pipeline_iterations,
                   help="iterations measured at all-max clocks and under the served plan")
    g.add_argument("--pipeline-clocks", type=int, default=d.pipeline_clocks,
                   help="SM clocks the online profiler tries per instruction (fewer: faster)")
    g.add_argument("--pipeline-profile", default=d.pipeline_profile, metavar="PROFILE",
                   help="stage profile (model+GPU) of the simulated instructions; the agents "
                   "simulate that GPU")
    g.add_argument("--pipeline-scheduler", default=d.pipeline_scheduler, metavar="NAME",
                   help="coordinator scheduler: auto = Perseus (Perseus3D for DP > 1), or "
                   "InstructionProfiler when Perseus is not installed")


def _output_options(p: argparse.ArgumentParser, d: DemoConfig) -> None:
    """NATS, the report folder and logging."""
    g = p.add_argument_group("bus and output")
    g.add_argument("--nats-url", default=None, metavar="URL",
                   help="use this NATS server instead of starting an embedded one")
    g.add_argument("--prefix", default=d.prefix,
                   help="subject prefix (use your own on a shared NATS)")
    g.add_argument("--report-dir", default=d.report_dir,
                   help="folder for summary.json, power_limits.png, profile.json, "
                   "pipeline_frontier.png and pipeline_timeline.png")
    g.add_argument("--log-level", default=d.log_level,
                   help="log level of the agents and the coordinator (stderr)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="do not show the live progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The `zeus-demo` command line (each flag is a `DemoConfig` field, same default)."""
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="zeus-demo",
        formatter_class=_HelpFormatter,
        description=(
            "Run the whole system in one process: a NATS server, the coordinator, one agent per\n"
            "simulated node, then\n"
            " 1. a simulated data-parallel job under the power-limit optimizer (Zeus): baseline\n"
            "    (max limit) versus optimised energy and time per step, measured by the agents;\n"
            "    REPORT_DIR/summary.json, power_limits.png and profile.json;\n"
            " 2. a simulated 1F1B pipeline job (GPT-3 stages fitted on real A40 profiles) at\n"
            "    all-max SM clocks, then under the Perseus pipeline frequency scheduler, which\n"
            "    profiles it online, plans the time-energy frontier and serves a plan: energy and\n"
            "    time per iteration measured by the agents, the planner's predicted saving;\n"
            "    REPORT_DIR/pipeline_frontier.png, pipeline_timeline.png and summary.json's\n"
            "    'pipeline' section.\n"
            "The whole demo takes about 5 minutes on a 2-core machine."
        ),
        epilog=(
            "examples:\n"
            "  zeus-demo                                   # 4 of 8 A40s on 2 nodes, ZeusCost\n"
            "  zeus-demo --preset V100 --selector MaxSlowdownConstraint --max-slowdown 1.05\n"
            "  zeus-demo --steps 120 --warmup-steps 1 --profile-steps 8 --report-dir /tmp/r\n"
            "  zeus-demo --nats-url nats://127.0.0.1:4222 --prefix demo   # an existing NATS\n"
            "  zeus-demo --skip-pipeline                   # the power-limit part only\n"
            "  zeus-demo --pipeline-only --pipeline-dp 2 --microbatches 8   # 2 x 4 A40s\n"
            "\nexit codes: 0 done, 1 the demo failed, 2 bad options, 3 a service did not start"
        ),
    )
    _cluster_options(p, d)
    _power_limit_options(p, d)
    _job_options(p, d)
    _pipeline_options(p, d)
    _output_options(p, d)
    return p


def parse_config(argv: Sequence[str] | None = None) -> DemoConfig:
    """Parse the command line into a validated `DemoConfig`.

    Raises:
        SystemExit: Bad flags (argparse prints usage; exit code 2).
        DemoConfigError: Flags parse but are out of range or inconsistent.
    """
    ns = build_parser().parse_args(argv)
    return DemoConfig(**vars(ns))

def _configure_logging(level: str, console: Console) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logging.basicConfig(level=level.upper(), handlers=[handler], format="%(name)s: %(message)s",
                        force=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit code (0 done, 1 failed, 2 bad options, 3 no startup).

    SIGTERM (systemd, `docker stop`) stops it as Ctrl-C does: the services and the embedded
    NATS are stopped, exit code 130. Whatever it started dies with it even when it cannot stop
    them (SIGKILL: `zeus_agent.children`).
    """
    with sigterm_as_sigint():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    console = Console()
    err = Console(stderr=True)
    try:
        config = parse_config(argv)
    except DemoConfigError as e:
        err.print(f"[red]zeus-demo: {e}[/]")
        return EXIT_USAGE
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed.
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    try:
        _configure_logging(config.log_level, err)
    except ValueError:
        err.print(f"[red]zeus-demo: --log-level {config.log_level!r} is not a log level[/]")
        return EXIT_USAGE
    report_dir = Path(config.report_dir)
    summary: dict[str, Any] | None = None
    try:
        if config.budget:
            _budget_part(console, report_dir)
            return EXIT_OK
        if not config.pipeline_only:
            summary = _power_limit_part(config, console, report_dir)
        if not config.skip_pipeline:
            section = _pipeline_part(config, console, report_dir)
            if summary is None:
                cfg = dataclasses.asdict(config)
                summary = {"version": SUMMARY_VERSION, "config": cfg, "elapsed_s": None}
            summary["pipeline"] = section
        elif summary is not None:
            summary["pipeline"] = None
        if summary is not None:
            (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except DemoStartupError as e:
        err.print(f"[red]zeus-demo: {e}[/]")
        return EXIT_STARTUP_FAILURE
    except (DemoError, PipelineDemoError) as e:
        err.print(f"[red]zeus-demo failed: {e}[/]")
        return EXIT_FAILED
    except OSError as e:
        err.print(f"[red]zeus-demo failed writing the report: {e}[/]")
        return EXIT_FAILED
    except KeyboardInterrupt:
        err.print("[yellow]zeus-demo: interrupted; services stopped[/]")
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI turns every error into a message and a code
        LOG.debug("zeus-demo failed", exc_info=True)
        err.print(f"[red]zeus-demo failed unexpectedly: {type(e).__name__}: {e}[/]\n"
                  "rerun with --log-level DEBUG for the traceback and the services' logs")
        return EXIT_FAILED
    console.print(f"report: {os.fspath(report_dir / 'summary.json')}")
    return EXIT_OK


def _budget_part(console: Console, report_dir: Path) -> None:
    """Play the grid event, print its table; its report goes to report_dir."""
    console.print("[bold]zeus-demo[/] power budget: embedded NATS, 2 coordinator replicas, "
                  "3 nodes x 2 simulated GPUs (A40, V100), 6 jobs; a 25% cut, held, lifted")
    out = run_budget_demo(report_dir)
    console.print(render_budget_table(out))
    console.print(f"report: {os.fspath(report_dir / 'budget.json')}, "
                  f"{os.fspath(report_dir / 'budget_event.png')}")


def _power_limit_part(config: DemoConfig, console: Console, report_dir: Path) -> dict[str, Any]:
    """Run the power-limit part, print its table; return its summary (written to report_dir)."""
    console.print(
        f"[bold]zeus-demo[/] power limits: "
        f"{'embedded NATS' if not config.nats_url else config.nats_url}, "
        f"{config.nodes} nodes x {config.gpus_per_node} simulated {config.preset}, job on "
        f"{config.job_gpus} GPUs, {config.workload_name}, {config.selector}, "
        f"{config.epochs} x {config.steps} steps"
    )
    run = asyncio.run(run_demo(config, console))
    comparison = compare(run.step_limits_w, run.measured, run.max_power_limit_w,
                         run.chosen_power_limit_w)
    if comparison.baseline.steps == 0 or comparison.optimised.steps == 0:
        raise DemoError(
            "the agents measured no step at the "
            + ("maximum" if comparison.baseline.steps == 0 else "chosen")
            + " power limit; raise --steps or run with --log-level INFO"
        )
    summary = write_report(run, comparison, report_dir)
    console.print(render_table(summary))
    console.print(
        f"job [cyan]{run.job_id}[/]; {comparison.unmatched_steps} step(s) without a measurement "
        f"from every rank; {run.elapsed_s:.1f} s"
    )
    console.print(f"report: {os.fspath(report_dir / 'power_limits.png')}"
                  + (f", {os.fspath(report_dir / 'profile.json')}" if run.profile_json else ""))
    return summary


def _pipeline_part(config: DemoConfig, console: Console, report_dir: Path) -> dict[str, Any]:
    """Run the pipeline part, print its table; return summary.json's `pipeline` section."""
    pcfg = config.pipeline_config()
    console.print(
        f"[bold]zeus-demo[/] pipeline: {pcfg.stages} stages x {pcfg.dp} pipeline(s) on "
        f"simulated {pcfg.preset}s ({pcfg.profile}), {pcfg.microbatches} microbatches, time "
        f"scale {pcfg.time_scale:g} (energy counter every {pcfg.energy_update_ms:g} ms): "
        "all-max clocks, then Perseus"
    )
    if pcfg.time_scale != 1:
        console.print(
            f"  scaled: instruction times and the energy counter x{pcfg.time_scale:g}, but not "
            "what NVML calls cost (the h200 model: a counter read ~3 ms, a clock change 1 ms), "
            "so clock changes weigh more than on a real GPU and the slowdown reads high; "
            "--pipeline-time-scale 1 runs at real times"
        )
    run = asyncio.run(run_pipeline_demo(
        pcfg, console, progress=config.progress, nats_url=config.nats_url,
        prefix=config.prefix, log_level=config.log_level))
    section = write_pipeline_report(run, report_dir)
    console.print(render_pipeline_table(section))
    console.print(
        f"jobs [cyan]{run.all_max.job_id}[/] (all-max) and [cyan]{run.perseus.job_id}[/]; "
        f"{section['late_clocks']} instruction(s) started before their clock was locked; "
        f"{run.elapsed_s:.1f} s"
    )
    console.print("report: " + ", ".join(os.fspath(report_dir / name)
                                         for name in section["images"]))
    return section
