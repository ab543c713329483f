"""`zeus-demo`: both optimizers of the system in one command, with a report people can read.

One process runs everything on one asyncio loop: an embedded `nats-server` (or an external NATS
given by `--nats-url`), one `AgentServer` per simulated node (simulated GPUs, `backend="sim"`)
and a `CoordinatorService`. A simulated data-parallel job (`zeus_agent.sim_trainer`: one
process per rank, real `zeus_agent.emit` calls) then runs under the power-limit optimizer.
The demo follows the job's status events for live progress and records the agents' per-step
measurements; at the end it compares the steps that ran at the maximum power limit (the
baseline) with the steps that ran at the chosen limit after it was pinned, prints a table and
writes a report folder.

Then the pipeline part (`coordinator.demo_pipeline`; `--skip-pipeline` leaves it out,
`--pipeline-only` runs only it): a simulated 1F1B pipeline job (GPT-3 stages fitted on the real
Perseus A40 profiles) runs at all-max SM clocks, then under the coordinator's Perseus scheduler
(online profiling, time-energy frontier, served plan); its table compares the two as the agents
measured them, next to the planner's prediction, and the report gets `pipeline_frontier.png`,
`pipeline_timeline.png` and a `pipeline` section in summary.json.

Pieces:

* `DemoConfig`: every option, validated (`DemoConfigError` says which and how to fix it).
* `build_parser()`: the command line; `--help` documents each option and its default.
* `StepStats`, `Comparison`, `compare(...)`: the pure arithmetic that joins each rank's per-step
  power limits (from the trainer) with the agents' per-step measurements by (rank, step):
  energy per step is the sum over the job's GPUs, time per step the maximum over ranks.
* `run_demo(config, console)`: the asyncio shell (start, run the job, collect, stop); returns a
  `DemoRun`.
* `build_summary`, `write_report`, `render_table`: the report (`summary.json`,
  `power_limits.png`, `profile.json`) and the table.
* `main(argv)`: the console script; the only place errors become exit codes (0 done, 1 the
  demo failed, 2 bad options, 3 NATS or a service did not start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from coordinator.demo_pipeline import (
    PipelineDemoConfig,
    PipelineDemoError,
    render_pipeline_table,
    run_pipeline_demo,
    write_pipeline_report,
)
from zeus_agent.aio import wait_started
from zeus_agent.errors import BrokerError
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus, MeasurementBatch, PowerLimitOptions, SelectorName

LOG = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STARTUP_FAILURE = 3

SELECTORS: tuple[SelectorName, ...] = ("Energy", "Time", "ZeusCost", "MaxSlowdownConstraint")
SearchName = Literal["exhaustive", "adaptive"]
FALLBACK_WORKLOAD = "A40+resnet50+gpu0,1,2,3"
SUMMARY_VERSION = 2
"""2: summary.json has a `pipeline` section (None when skipped)."""


class DemoError(Exception):
    """The demo could not complete; the message says what happened and what to try."""


class DemoConfigError(DemoError, ValueError):
    """An option is out of range or inconsistent with another."""


class DemoStartupError(DemoError):
    """NATS, an agent or the coordinator did not start."""


def default_workload(preset: str) -> str:
    """The preset's fitted data-parallel resnet50 profile, else A40's."""
    for name in (f"{preset}+resnet50+gpu0,1,2,3", f"{preset}+resnet50+gpu0,1"):
        if name in WORKLOADS:
            return name
    return FALLBACK_WORKLOAD


@dataclass(frozen=True)
class DemoConfig:
    """Every option of the demo (the command line's flags, same names and defaults).

    Attributes:
        nodes: Simulated nodes, one agent each.
        gpus_per_node: Simulated GPUs per node.
        job_gpus: GPUs (ranks) of the data-parallel job, spread over the nodes.
        preset: Simulated GPU model (a key of `PRESETS`).
        workload: Simulated workload (a key of `WORKLOADS`); None = `default_workload(preset)`.
        selector: Optimum selector run by the coordinator.
        eta_knob: ZeusCost's eta (0 = time only, 1 = energy only).
        max_slowdown: MaxSlowdownConstraint's factor (>= 1).
        warmup_steps: Warm-up steps at each power limit before its profiling window.
        profile_steps: Steps in each power limit's profiling window.
        steps: Steps per epoch.
        epochs: Epochs.
        scale: Factor on the simulated step time (0.1 = ten times faster than the real job).
        search: Power-limit search: every limit ("exhaustive") or "adaptive".
        nats_url: External NATS; None = start an embedded nats-server.
        prefix: Subject prefix shared by the agents and the coordinator.
        report_dir: Where summary.json, power_limits.png and profile.json are written.
        seed: Seed of the simulated noise.
        timeout_s: Give up on the job after this long (s).
        log_level: Log level of the services (their logs go to stderr).
        progress: Show the live progress bar.
        skip_pipeline: Leave the pipeline part out.
        pipeline_only: Run only the pipeline part.
        pipeline_stages: Pipeline stages (PP degree) of the pipeline job.
        pipeline_dp: Data-parallel pipelines of the pipeline job.
        microbatches: Microbatches per pipeline iteration.
        pipeline_time_scale: Factor on the simulated instruction times (and the energy
            counter's period) of the pipeline job.
        pipeline_iterations: Iterations measured at all-max clocks and under the served plan.
        pipeline_clocks: Clocks the online profiler tries per instruction.
        pipeline_profile: Stage profile of the pipeline job.
        pipeline_scheduler: "auto" (Perseus, else InstructionProfiler) or a scheduler name.
    """

    nodes: int = 2
    gpus_per_node: int = 4
    job_gpus: int = 4
    preset: str = "A40"
    workload: str | None = None
    selector: SelectorName = "ZeusCost"
    eta_knob: float = 0.5
    max_slowdown: float = 1.1
    warmup_steps: int = 3
    profile_steps: int = 30
    steps: int = 400
    epochs: int = 1
    scale: float = 0.25
    search: SearchName = "exhaustive"
    nats_url: str | None = None
    prefix: str = subjects.DEFAULT_PREFIX
    report_dir: str = "demo-report"
    seed: int = 0
    timeout_s: float = 300.0
    log_level: str = "ERROR"
    progress: bool = True
    skip_pipeline: bool = False
    pipeline_only: bool = False
    pipeline_stages: int = 4
    pipeline_dp: int = 1
    microbatches: int = 4
    pipeline_time_scale: float = 1.0
    pipeline_iterations: int = 12
    pipeline_clocks: int = 4
    pipeline_profile: str = "gpt3-175b+a40"
    pipeline_scheduler: str = "auto"

    def __post_init__(self) -> None:
        """Validate every option; the message names the option, its value and the fix."""
        if self.skip_pipeline and self.pipeline_only:
            raise DemoConfigError("--skip-pipeline and --pipeline-only exclude each other")
        if not self.skip_pipeline:
            try:
                self.pipeline_config()
            except ValueError as e:
                raise DemoConfigError(str(e)) from None
        positive = {
            "nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "job_gpus": self.job_gpus,
            "profile_steps": self.profile_steps, "steps": self.steps, "epochs": self.epochs,
        }
        for name, value in positive.items():
            if value < 1:
                raise DemoConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.warmup_steps < 0:
            raise DemoConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.job_gpus > self.nodes * self.gpus_per_node:
            raise DemoConfigError(
                f"--job-gpus {self.job_gpus} exceeds the {self.nodes} x {self.gpus_per_node} "
                "simulated GPUs: lower --job-gpus or raise --nodes/--gpus-per-node"
            )
        if self.preset not in PRESETS:
            raise DemoConfigError(
                f"--preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}"
            )
        if self.workload is not None and self.workload not in WORKLOADS:
            raise DemoConfigError(
                f"--workload {self.workload!r} is unknown; choose one of {', '.join(WORKLOADS)}"
            )
        if self.selector not in SELECTORS:
            raise DemoConfigError(
                f"--selector {self.selector!r} is unknown; choose one of {', '.join(SELECTORS)}"
            )
        if not 0.0 <= self.eta_knob <= 1.0:
            raise DemoConfigError(f"--eta-knob must be between 0 and 1, got {self.eta_knob}")
        if self.max_slowdown < 1.0:
            raise DemoConfigError(f"--max-slowdown must be >= 1, got {self.max_slowdown}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise DemoConfigError(f"--scale must be > 0, got {self.scale}")
        if self.search not in ("exhaustive", "adaptive"):
            raise DemoConfigError(f"--search must be exhaustive or adaptive, got {self.search!r}")
        if not self.timeout_s > 0:
            raise DemoConfigError(f"--timeout must be > 0, got {self.timeout_s}")
        try:
            subjects.agent_hello("x", self.prefix)
        except ValueError as e:
            raise DemoConfigError(f"--prefix: {e}") from None
        if self.search == "exhaustive" and self.total_steps < self.profiling_steps + 2:
            raise DemoConfigError(
                f"{self.epochs} epoch(s) x {self.steps} steps = {self.total_steps} steps cannot "
                f"finish profiling: {self.candidate_count} power limits x "
                f"({self.warmup_steps} warm-up + {self.profile_steps} profile) steps + "
                f"{self.power_limit_options.wait_steps} wait step(s) = {self.profiling_steps}; "
                f"raise --steps to at least {self.profiling_steps + 30} or lower "
                "--profile-steps/--warmup-steps"
            )

    def pipeline_config(self) -> PipelineDemoConfig:
        """The pipeline part's options.

        Raises:
            PipelineDemoConfigError: One is out of range.
        """
        return PipelineDemoConfig(
            profile=self.pipeline_profile, stages=self.pipeline_stages, dp=self.pipeline_dp,
            microbatches=self.microbatches, time_scale=self.pipeline_time_scale,
            baseline_iterations=self.pipeline_iterations,
            serve_iterations=self.pipeline_iterations, clocks=self.pipeline_clocks,
            scheduler=self.pipeline_scheduler, timeout_s=max(self.timeout_s, 120.0))

    @property
    def workload_name(self) -> str:
        """The workload that runs."""
        return self.workload or default_workload(self.preset)

    @property
    def total_steps(self) -> int:
        """Steps of the whole job."""
        return self.steps * self.epochs

    @property
    def power_limit_options(self) -> PowerLimitOptions:
        """What the coordinator's optimizer is asked to do."""
        return PowerLimitOptions(
            selector=self.selector, eta_knob=self.eta_knob, max_slowdown=self.max_slowdown,
            warmup_steps=self.warmup_steps, profile_steps=self.profile_steps, search=self.search,
        )

    @property
    def candidate_count(self) -> int:
        """How many power limits the exhaustive search profiles on the preset's GPU."""
        hw = PRESETS[self.preset]
        opts = self.power_limit_options
        return len(range(hw.max_power_limit_w, hw.min_power_limit_w - 1, -opts.pl_step_w))

    @property
    def profiling_steps(self) -> int:
        """Steps an exhaustive search needs before the optimum is pinned."""
        opts = self.power_limit_options
        return opts.wait_steps + self.candidate_count * (opts.warmup_steps + opts.profile_steps)

    @property
    def node_names(self) -> list[str]:
        """The simulated nodes: node-a, node-b, ..."""
        if self.nodes <= 26:
            return [f"node-{chr(ord('a') + i)}" for i in range(self.nodes)]
        return [f"node-{i}" for i in range(self.nodes)]

    def placements(self) -> list[tuple[str, int]]:
        """(node, GPU index) of each rank: contiguous blocks, spread evenly over the nodes."""
        per_node = math.ceil(self.job_gpus / self.nodes)
        if per_node > self.gpus_per_node:  # Unreachable after validation; kept as a guard.
            raise DemoConfigError("the job does not fit on the nodes")
        return [(self.node_names[r // per_node], r % per_node) for r in range(self.job_gpus)]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


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
            "The whole demo takes about two minutes on a 2-core machine."
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
    g = p.add_argument_group("job")
    g.add_argument("--steps", type=int, default=d.steps, help="steps per epoch")
    g.add_argument("--epochs", type=int, default=d.epochs, help="epochs")
    g.add_argument("--scale", type=float, default=d.scale,
                   help="factor on the simulated step time (0.1: ten times faster than real)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the simulated noise")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="give up on the job after this many seconds")
    g = p.add_argument_group("pipeline frequency optimizer (Perseus)")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--skip-pipeline", action="store_true",
                       help="leave the pipeline part out (power-limit part only)")
    which.add_argument("--pipeline-only", action="store_true",
                       help="run only the pipeline part")
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
    return p


def parse_config(argv: Sequence[str] | None = None) -> DemoConfig:
    """Parse the command line into a validated `DemoConfig`.

    Raises:
        SystemExit: Bad flags (argparse prints usage; exit code 2).
        DemoConfigError: Flags parse but are out of range or inconsistent.
    """
    ns = build_parser().parse_args(argv)
    return DemoConfig(**vars(ns))


# ---------------------------------------------------------------------------- pure arithmetic
@dataclass(frozen=True)
class StepStats:
    """Mean per-step energy and time of a set of job steps.

    Attributes:
        power_limit_w: The limit every GPU ran these steps at (W).
        energy_per_step_j: Mean over steps of the energy summed over the job's GPUs (J).
        time_per_step_s: Mean over steps of the time, maximum over ranks (s).
        steps: Number of steps averaged.
        first_step: First step index included (None without steps).
        last_step: Last step index included (None without steps).
    """

    power_limit_w: int
    energy_per_step_j: float
    time_per_step_s: float
    steps: int
    first_step: int | None
    last_step: int | None


@dataclass(frozen=True)
class Comparison:
    """Baseline (max limit) versus optimised steps, as the agents measured them.

    Attributes:
        baseline: The leading run of steps at the maximum limit (before profiling moved on).
        optimised: The trailing run of steps at the chosen limit (after it was pinned).
        energy_saving_pct: (baseline - optimised) / baseline energy per step, in %.
        time_change_pct: (optimised - baseline) / baseline time per step, in % (+ = slower).
        per_limit: Every limit the job ran at, all its measured steps.
        unmatched_steps: Steps without a measurement from every rank (left out).
    """

    baseline: StepStats
    optimised: StepStats
    energy_saving_pct: float
    time_change_pct: float
    per_limit: list[StepStats]
    unmatched_steps: int


def job_steps(
    step_limits_w: Mapping[int, Sequence[int]],
    measured: Mapping[tuple[int, int], tuple[float, float]],
) -> tuple[dict[int, tuple[int, float, float]], int]:
    """Join per-rank step limits with per-(rank, step) measurements into job steps.

    Args:
        step_limits_w: Rank -> the power limit (W) each of its steps ran at (index = step).
        measured: (rank, step) -> (time_s, energy_j) as the rank's agent measured it.

    Returns:
        Step -> (limit, time max over ranks, energy summed over ranks) for the steps every rank
        has a measurement of and ran at one limit; and how many steps were left out.

    Raises:
        ValueError: No ranks.
    """
    if not step_limits_w:
        raise ValueError("no ranks to join")
    n_steps = min(len(v) for v in step_limits_w.values())
    out: dict[int, tuple[int, float, float]] = {}
    for step in range(n_steps):
        limits = {step_limits_w[r][step] for r in step_limits_w}
        rows = [measured.get((r, step)) for r in step_limits_w]
        if len(limits) != 1 or any(row is None for row in rows):
            continue
        present = [row for row in rows if row is not None]
        out[step] = (
            limits.pop(),
            max(t for t, _ in present),
            sum(e for _, e in present),
        )
    return out, n_steps - len(out)


def _stats(limit: int, steps: Mapping[int, tuple[int, float, float]], idx: list[int]) -> StepStats:
    if not idx:
        return StepStats(limit, math.nan, math.nan, 0, None, None)
    return StepStats(
        power_limit_w=limit,
        energy_per_step_j=statistics.fmean(steps[i][2] for i in idx),
        time_per_step_s=statistics.fmean(steps[i][1] for i in idx),
        steps=len(idx),
        first_step=idx[0],
        last_step=idx[-1],
    )


def compare(
    step_limits_w: Mapping[int, Sequence[int]],
    measured: Mapping[tuple[int, int], tuple[float, float]],
    max_power_limit_w: int,
    chosen_power_limit_w: int,
) -> Comparison:
    """Compare the steps at the maximum limit with the steps at the chosen one.

    The baseline is the leading run of steps at `max_power_limit_w` (the job starts there and
    profiling starts at the top); the optimised steps are the trailing run at
    `chosen_power_limit_w` (after the optimum was pinned). The runs are found in the trainer's
    per-step limits (what each step really ran at); their energy and time come from the agents.

    Args:
        step_limits_w: Rank -> power limit of each step (W), from the trainer.
        measured: (rank, step) -> (time_s, energy_j), from the agents.
        max_power_limit_w: The GPUs' maximum limit (W).
        chosen_power_limit_w: The limit the optimizer pinned (W).

    Returns:
        The comparison; savings are NaN when either side has no measured step.

    Raises:
        DemoError: The job never ran at the maximum limit, or did not end at the chosen one.
    """
    steps, unmatched = job_steps(step_limits_w, measured)
    ranks = sorted(step_limits_w)
    limits = step_limits_w[ranks[0]]
    if not limits or limits[0] != max_power_limit_w:
        raise DemoError(
            f"the job did not start at the maximum power limit {max_power_limit_w} W "
            f"(first step ran at {limits[0] if limits else 'no step'}): was a GPU left "
            "throttled by an earlier run? Restart the agents."
        )
    if limits[-1] != chosen_power_limit_w:
        raise DemoError(
            f"the job ended at {limits[-1]} W, not at the chosen {chosen_power_limit_w} W: the "
            "optimum was pinned too late; raise --steps"
        )
    lead = next((i for i, w in enumerate(limits) if w != max_power_limit_w), len(limits))
    tail = len(limits)
    while tail > 0 and limits[tail - 1] == chosen_power_limit_w:
        tail -= 1
    if tail == 0:  # The limit never moved: the leading and trailing runs are the same steps.
        raise DemoError(
            "every step ran at one power limit: the optimizer never profiled; check the "
            "coordinator's log (--log-level INFO)"
        )
    baseline = _stats(max_power_limit_w, steps, [i for i in range(lead) if i in steps])
    optimised = _stats(
        chosen_power_limit_w, steps, [i for i in range(tail, len(limits)) if i in steps]
    )
    by_limit: dict[int, list[int]] = {}
    for i, (w, _, _) in sorted(steps.items()):
        by_limit.setdefault(w, []).append(i)
    per_limit = [_stats(w, steps, idx) for w, idx in sorted(by_limit.items(), reverse=True)]
    b_e, b_t = baseline.energy_per_step_j, baseline.time_per_step_s
    o_e, o_t = optimised.energy_per_step_j, optimised.time_per_step_s
    return Comparison(
        baseline=baseline,
        optimised=optimised,
        energy_saving_pct=(b_e - o_e) / b_e * 100.0 if b_e > 0 else math.nan,
        time_change_pct=(o_t - b_t) / b_t * 100.0 if b_t > 0 else math.nan,
        per_limit=per_limit,
        unmatched_steps=unmatched,
    )


# ---------------------------------------------------------------------------- the shell
@dataclass
class DemoRun:
    """What a demo run produced (the report's inputs).

    Attributes:
        config: The options.
        job_id: The job's id.
        nats_url: The NATS used ("embedded" servers are noted in `embedded_nats`).
        embedded_nats: Whether the demo started its own nats-server.
        chosen_power_limit_w: The limit the coordinator pinned (from its "done" status).
        max_power_limit_w: The GPUs' maximum limit.
        profile: The profile's measurements (Zeus format: power_limit W, energy J, time s of a
            `profile_steps`-step window over the job's GPUs).
        profile_json: The saved profile file's text (Zeus JSON), when it was found.
        step_limits_w: Rank -> power limit of each step, as the trainer ran them.
        measured: (rank, step) -> (time_s, energy_j) from the agents' measurement batches.
        statuses: (state, message) of every status event of the job, in order.
        elapsed_s: Wall time of the whole run (s).
    """

    config: DemoConfig
    job_id: str
    nats_url: str
    embedded_nats: bool
    chosen_power_limit_w: int
    max_power_limit_w: int
    profile: list[dict[str, Any]]
    profile_json: str | None
    step_limits_w: dict[int, list[int]]
    measured: dict[tuple[int, int], tuple[float, float]]
    statuses: list[tuple[str, str]] = field(default_factory=list)
    elapsed_s: float = 0.0


class _Observer:
    """Follows the job's status events and the agents' step measurements on NATS."""

    def __init__(self, job_tag: str, on_status: Any) -> None:
        self.job_tag = job_tag
        self.on_status = on_status
        self.statuses: list[Any] = []
        self.measured: dict[tuple[int, int], tuple[float, float]] = {}
        self.done = asyncio.Event()
        self.complete = asyncio.Event()
        self.disconnects = 0
        self._expected: set[tuple[int, int]] | None = None

    def expect(self, keys: set[tuple[int, int]]) -> asyncio.Event:
        """The returned event is set once every (rank, step) in `keys` has a measurement."""
        self._expected = keys
        self._check_complete()
        return self.complete

    def _check_complete(self) -> None:
        if self._expected is not None and self._expected <= self.measured.keys():
            self.complete.set()

    def _ours(self, job_id: str) -> bool:
        return job_id.endswith(self.job_tag)

    async def status(self, msg: Any) -> None:
        try:
            ev = codec.decode(msg.data, JobStatus)
        except Exception as e:  # noqa: BLE001 - a foreign message on a shared bus
            LOG.debug("ignoring an undecodable status event: %s", e)
            return
        if not self._ours(ev.job_id):
            return
        self.statuses.append(ev)
        if ev.state == "done" and ev.progress.get("optimal_power_limit_w") is not None:
            self.done.set()
        self.on_status(ev)

    async def measurement(self, msg: Any) -> None:
        try:
            batch = codec.decode(msg.data, MeasurementBatch)
        except Exception as e:  # noqa: BLE001
            LOG.debug("ignoring an undecodable measurement batch: %s", e)
            return
        if not self._ours(batch.job_id):
            return
        for m in batch.measurements:
            if m.kind == "step":
                self.measured[(batch.rank, m.step)] = (m.time_s, m.energy_j)
        self._check_complete()


async def _wait_started(event: asyncio.Event, task: asyncio.Task[Any], what: str) -> None:
    """Wait until a service says it started, or fail with its error if it died first."""
    await wait_started(event, task, what, DemoStartupError,
                       hint="; rerun with --log-level INFO")


def _phase_text(ev: Any) -> str:
    p = ev.progress or {}
    phase = p.get("phase", ev.state)
    limit = p.get("power_limit_w")
    text = f"{ev.state}: {phase}"
    if limit is not None:
        text += f" @ {limit} W"
    if p.get("candidates"):
        text += f" ({p.get('measured', 0)}/{p['candidates']} limits measured)"
    if p.get("optimal_power_limit_w") is not None:
        text = f"done: pinned {p['optimal_power_limit_w']} W"
    return text


async def run_demo(config: DemoConfig, console: Console) -> DemoRun:
    """Start the services, run the job, collect what the agents measured, stop everything.

    Every process started here (nats-server, rank processes) is stopped and the temporary
    state (simulated GPUs, sockets, coordinator state) is removed, whatever happens.

    Raises:
        DemoStartupError: NATS, an agent or the coordinator did not start.
        DemoError: The job failed or the optimizer did not pin a limit.
    """
    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService
    from zeus_agent.agent.server import AgentServer
    from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
    from zeus_agent.config import AgentSettings
    from zeus_agent.sim_trainer import RankPlacement, TrainerOptions, run_data_parallel

    started_at = time.monotonic()
    job_tag = f"zeus-demo-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.TemporaryDirectory(prefix="zeus-demo-")
    root = Path(tmp.name)
    embedded: EmbeddedNats | None = None
    agents: list[tuple[AgentServer, asyncio.Task[None]]] = []
    coord: CoordinatorService | None = None
    coord_task: asyncio.Task[None] | None = None
    nc: Any = None
    job_id: str | None = None
    lost_nats_during_job = False
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not config.progress,
    )
    task_id = progress.add_task("starting", total=config.total_steps, phase="")

    def on_status(ev: Any) -> None:
        progress.update(task_id, phase=_phase_text(ev))

    observer = _Observer(job_tag, on_status)
    try:
        with progress:
            if config.nats_url:
                url = config.nats_url
            else:
                progress.update(task_id, description="starting nats-server")
                try:
                    embedded = await asyncio.to_thread(EmbeddedNats().start)
                except BrokerError as e:
                    raise DemoStartupError(f"the embedded nats-server did not start: {e}") from e
                url = embedded.url
            progress.update(task_id, description="starting services")
            async def on_disconnect() -> None:
                observer.disconnects += 1

            try:
                nc = await connect(url, "zeus-demo", on_disconnect=on_disconnect)
            except BrokerError as e:
                hint = " (with zeus-demo: omit --nats-url)" if config.nats_url else ""
                raise DemoStartupError(f"{e}{hint}") from e
            p = config.prefix
            await nc.subscribe(subjects.all_job_status(p), cb=observer.status)
            await nc.subscribe(subjects.all_gpu_measurements(p), cb=observer.measurement)
            await confirm_subscriptions(nc)
            for node in config.node_names:
                server = AgentServer(AgentSettings.model_validate({
                    "nats_url": url, "backend": "sim", "sim_count": config.gpus_per_node,
                    "sim_preset": config.preset, "sim_state_dir": str(root / node),
                    "socket_path": str(root / f"{node}.sock"), "node": node, "sample_hz": 20,
                    "prefix": p, "log_level": config.log_level,
                    # The job runs `scale` times faster than the real one: so does the GPU's
                    # energy counter (100 ms on real GPUs).
                    "sim_energy_update_ms": 100.0 * config.scale,
                }))
                agents.append((server, asyncio.create_task(server.serve())))
            coord = CoordinatorService(CoordinatorSettings.model_validate({
                "nats_url": url, "prefix": p, "state_dir": str(root / "coordinator"),
                "dump_dir": str(root / "dump"), "log_level": config.log_level,
            }))
            coord_task = asyncio.create_task(coord.serve())
            for server, agent_task in agents:
                await _wait_started(server.started, agent_task, f"agent {server.settings.node}")
            await _wait_started(coord.started, coord_task, "the coordinator")

            placements = [
                RankPlacement(node, str(root / f"{node}.sock"), str(root / node), gpu)
                for node, gpu in config.placements()
            ]
            options = TrainerOptions(
                workload=config.workload_name, epochs=config.epochs,
                steps_per_epoch=config.steps, scale=config.scale,
                power_limit=config.power_limit_options, job_metadata=job_tag, seed=config.seed,
            )
            progress.update(task_id, description="training", phase="registering the job")

            def on_step(step: int) -> None:
                progress.update(task_id, completed=step)

            try:
                result = await asyncio.to_thread(
                    run_data_parallel, placements, options, on_step, config.timeout_s
                )
            except RuntimeError as e:
                raise DemoError(f"the simulated job failed: {e}") from e
            if not result.job_id:
                raise DemoError("the job was not registered: no job id came back")
            job_id = result.job_id
            lost_nats_during_job = observer.disconnects > 0
            expected = {(r.rank, s) for r in result.ranks for s in range(len(r.step_time_s))}
            # The last measurements may still be on their way; steps still missing after
            # this are left out of the comparison and counted (`unmatched_steps`).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(observer.expect(expected).wait(), 5.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(observer.done.wait(), 2.0)
            progress.update(task_id, description="done", completed=config.total_steps)
    finally:
        await _stop(agents, coord, coord_task, nc)
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
        profile_json = _read_profile(root, job_id)
        tmp.cleanup()
    done = [s for s in observer.statuses if s.state == "done"]
    if not done and lost_nats_during_job:
        raise DemoError(
            f"the connection to NATS at {url} was lost during the job, so the optimizer could "
            "not finish (was the nats-server stopped?); run the demo again"
        )
    if not done:
        states = ", ".join(dict.fromkeys(s.state for s in observer.statuses)) or "none"
        raise DemoError(
            f"the optimizer did not pin a power limit (status events seen: {states}); raise "
            "--steps or run with --log-level INFO"
        )
    final = done[-1].progress
    hw = PRESETS[config.preset]
    return DemoRun(
        config=config,
        job_id=result.job_id,
        nats_url=url,
        embedded_nats=embedded is not None,
        chosen_power_limit_w=int(final["optimal_power_limit_w"]),
        max_power_limit_w=hw.max_power_limit_w,
        profile=list(final.get("measurements", [])),
        profile_json=profile_json,
        step_limits_w={r.rank: list(r.step_power_limit_w) for r in result.ranks},
        measured=dict(observer.measured),
        statuses=[(s.state, s.message) for s in observer.statuses],
        elapsed_s=time.monotonic() - started_at,
    )


def _read_profile(root: Path, job_id: str | None) -> str | None:
    if job_id is None:
        return None
    path = root / "coordinator" / "profiles" / f"{subjects.token(job_id)}.json"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


async def _stop(agents: list[tuple[Any, asyncio.Task[None]]], coord: Any,
                coord_task: asyncio.Task[None] | None, nc: Any) -> None:
    """Stop intake (agents, then the coordinator), wait for them, drain our connection."""
    for server, _ in agents:
        server.handle_exit()
    if coord is not None:
        coord.should_exit.set()
    tasks = [t for _, t in agents] + ([coord_task] if coord_task is not None else [])
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=15)
        for t in pending:
            t.cancel(msg="zeus-demo: service did not stop within 15 s")
        if pending:
            await asyncio.wait(pending, timeout=5)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                LOG.warning("a service ended with an error: %s", t.exception())
    if nc is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 5)


# ---------------------------------------------------------------------------- report
def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def build_summary(run: DemoRun, comparison: Comparison) -> dict[str, Any]:
    """The JSON summary: config, job, chosen limit, baseline/optimised, savings, profile."""
    cfg = dataclasses.asdict(run.config)
    cfg["workload"] = run.config.workload_name

    def side(s: StepStats) -> dict[str, Any]:
        return {
            "power_limit_w": s.power_limit_w,
            "energy_per_step_j": _finite(s.energy_per_step_j),
            "time_per_step_s": _finite(s.time_per_step_s),
            "steps": s.steps,
            "first_step": s.first_step,
            "last_step": s.last_step,
        }

    return {
        "version": SUMMARY_VERSION,
        "config": cfg,
        "job_id": run.job_id,
        "nats": "embedded" if run.embedded_nats else run.nats_url,
        "world_size": run.config.job_gpus,
        "placements": [{"rank": r, "node": n, "gpu": g}
                       for r, (n, g) in enumerate(run.config.placements())],
        "chosen_power_limit_w": run.chosen_power_limit_w,
        "max_power_limit_w": run.max_power_limit_w,
        "baseline": side(comparison.baseline),
        "optimised": side(comparison.optimised),
        "savings": {
            "energy_pct": _finite(comparison.energy_saving_pct),
            "time_change_pct": _finite(comparison.time_change_pct),
        },
        "measured_by": "agents: energy summed over the job's GPUs, time the maximum over ranks",
        "per_power_limit": [side(s) for s in comparison.per_limit],
        "unmatched_steps": comparison.unmatched_steps,
        "profile": {
            "profile_steps": run.config.profile_steps,
            "note": "energy (J, summed over GPUs) and time (s) of one profile_steps-step window",
            "measurements": sorted(run.profile, key=lambda m: -m["power_limit"]),
        },
        "status_events": len(run.statuses),
        "elapsed_s": run.elapsed_s,
    }


def plot_power_limits(summary: Mapping[str, Any], path: Path) -> None:
    """Time and energy per step versus power limit (profile and agents), the chosen point marked.

    Raises:
        DemoError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise DemoError("the plot needs matplotlib: pip install 'zeus-bus[plot]'") from e
    n = summary["profile"]["profile_steps"]
    prof = sorted(summary["profile"]["measurements"], key=lambda m: m["power_limit"])
    agents = sorted(summary["per_power_limit"], key=lambda s: s["power_limit_w"])
    chosen = summary["chosen_power_limit_w"]
    fig, (ax_t, ax_e) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    for ax, key_prof, key_agent, label in (
        (ax_t, "time", "time_per_step_s", "time per step (s)"),
        (ax_e, "energy", "energy_per_step_j", "energy per step (J, all GPUs)"),
    ):
        if prof:
            ax.plot([m["power_limit"] for m in prof], [m[key_prof] / n for m in prof],
                    "o-", color="tab:blue", label="profile window / profile steps")
        pts = [(s["power_limit_w"], s[key_agent]) for s in agents if s[key_agent] is not None]
        if pts:
            ax.plot([w for w, _ in pts], [v for _, v in pts], "s", mfc="none",
                    color="tab:gray", label="agents, mean over steps")
        opt = summary["optimised"][key_agent]
        base = summary["baseline"][key_agent]
        if base is not None:
            ax.plot([summary["max_power_limit_w"]], [base], "D", color="tab:orange",
                    markersize=9, label="baseline (max limit)")
        if opt is not None:
            ax.plot([chosen], [opt], "*", color="tab:red", markersize=16,
                    label=f"chosen {chosen} W")
        ax.axvline(chosen, color="tab:red", alpha=0.25)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    ax_e.set_xlabel("power limit (W)")
    cfg = summary["config"]
    savings = summary["savings"]
    e_pct = savings["energy_pct"]
    t_pct = savings["time_change_pct"]
    fig.suptitle(
        f"{cfg['job_gpus']} x {cfg['preset']} ({cfg['workload']}), {cfg['selector']}: "
        + (f"energy -{e_pct:.1f} %, time {t_pct:+.1f} %" if e_pct is not None
           and t_pct is not None else "no comparison"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run: DemoRun, comparison: Comparison, report_dir: Path) -> dict[str, Any]:
    """Write summary.json, power_limits.png and profile.json; return the summary."""
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(run, comparison)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if run.profile_json is not None:
        (report_dir / "profile.json").write_text(run.profile_json)
    plot_power_limits(summary, report_dir / "power_limits.png")
    return summary


def render_table(summary: Mapping[str, Any]) -> Table:
    """Baseline versus optimised energy and time per step, the chosen limit and the savings."""
    cfg = summary["config"]
    sel = cfg["selector"]
    if sel == "ZeusCost":
        sel += f"(eta={cfg['eta_knob']})"
    elif sel == "MaxSlowdownConstraint":
        sel += f"({cfg['max_slowdown']})"
    table = Table(
        title=(f"Power-limit optimisation: {cfg['job_gpus']} x {cfg['preset']} over "
               f"{cfg['nodes']} nodes, {cfg['workload']}, {sel}"),
        caption=("per step: energy summed over the job's GPUs, time the maximum over ranks; "
                 "measured by the agents"),
    )
    table.add_column("")
    table.add_column("power limit", justify="right")
    table.add_column("energy / step", justify="right")
    table.add_column("time / step", justify="right")
    table.add_column("steps", justify="right")

    def fmt(v: float | None, unit: str, digits: int) -> str:
        return "n/a" if v is None else f"{v:.{digits}f} {unit}"

    for name, key in (("baseline (max limit)", "baseline"), ("optimised", "optimised")):
        s = summary[key]
        table.add_row(name, f"{s['power_limit_w']} W", fmt(s["energy_per_step_j"], "J", 2),
                      fmt(s["time_per_step_s"], "s", 4), str(s["steps"]))
    e_pct = summary["savings"]["energy_pct"]
    t_pct = summary["savings"]["time_change_pct"]
    table.add_section()
    table.add_row(
        "[bold]saving[/]",
        f"[bold]{summary['chosen_power_limit_w']} W chosen[/]",
        "n/a" if e_pct is None else f"[bold green]{e_pct:.1f} % less[/]",
        "n/a" if t_pct is None else f"[bold]{t_pct:+.1f} %[/]",
        "",
    )
    return table


# ---------------------------------------------------------------------------- CLI
def _configure_logging(level: str, console: Console) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logging.basicConfig(level=level.upper(), handlers=[handler], format="%(name)s: %(message)s",
                        force=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit code (0 done, 1 failed, 2 bad options, 3 no startup)."""
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


if __name__ == "__main__":
    raise SystemExit(main())
