"""The demo's options (`DemoConfig`, validated) and its errors.

* `DemoError`, `DemoConfigError` (an option out of range; the message names it and the fix),
  `DemoStartupError` (NATS, an agent or the coordinator did not start).
* `DemoConfig`: every option of `zeus-demo`, the command line's flags with the same names and
  defaults (`zeus_demo.cli.build_parser`); `pipeline_config()` gives the pipeline part's
  `PipelineDemoConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import PowerLimitOptions, SelectorName
from zeus_demo.pipeline.config import DEFAULT_PROFILE, PipelineDemoConfig

SELECTORS: tuple[SelectorName, ...] = ("Energy", "Time", "ZeusCost", "MaxSlowdownConstraint")
SearchName = Literal["exhaustive", "adaptive"]
FALLBACK_WORKLOAD = "A40+resnet50+gpu0,1,2,3"

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
        budget: Play a grid event (a power budget set, held and lifted) instead of the parts.
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
    budget: bool = False
    pipeline_stages: int = 4
    pipeline_dp: int = 1
    microbatches: int = 4
    pipeline_time_scale: float = 1.0
    pipeline_iterations: int = 12
    pipeline_clocks: int = 4
    pipeline_profile: str = DEFAULT_PROFILE
    pipeline_scheduler: str = "auto"

    def __post_init__(self) -> None:
        """Validate every option; the message names the option, its value and the fix."""
        if self.skip_pipeline + self.pipeline_only + self.budget > 1:
            raise DemoConfigError("--skip-pipeline, --pipeline-only and --budget exclude each "
                                  "other")
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
