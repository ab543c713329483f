"""The pipeline part's options (`PipelineDemoConfig`, validated), its errors and its plans.

* `PipelineDemoError`, `PipelineDemoConfigError` (an option out of range).
* `PipelineDemoConfig`: the job and how it is measured.
* `resolve_scheduler(requested, dp)`: the coordinator's scheduler ("Perseus", "Perseus3D" for
  DP > 1; "InstructionProfiler" when Perseus is not installed) and a note saying so.
* `scheduler_args(scheduler, config)`: its arguments.
* `all_max_plan(...)`, `write_plan(path, plan)`: the baseline's plan, every instruction at the
  highest SM clock, and its file for `PointSolution`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILE = "gpt3-175b+a40"
PERSEUS = "Perseus"
FALLBACK = "InstructionProfiler"

class PipelineDemoError(Exception):
    """The pipeline part could not complete; the message says what happened."""


class PipelineDemoConfigError(PipelineDemoError, ValueError):
    """An option of the pipeline part is out of range."""

@dataclass(frozen=True)
class PipelineDemoConfig:
    """The pipeline job and how it is measured.

    Attributes:
        profile: Stage profile (`zeus_agent.gpu.sim.instructions.STAGE_PROFILES`).
        stages: Pipeline stages (PP degree, 2-8).
        dp: Data-parallel pipelines (DP degree).
        microbatches: Microbatches per iteration.
        time_scale: Factor on every instruction's duration (and the energy counter's period).
        baseline_iterations: Iterations of the all-max job.
        serve_iterations: Iterations run under the served Perseus plan (measured).
        warmup_iterations: Iterations left out at the start of each measured schedule.
        clocks: Clocks the profiler tries per instruction (its grid, highest down).
        min_clock_fraction: The profiler's lowest clock as a fraction of the highest.
        profiling_iterations: Iterations per profiling result.
        min_profile_iterations: Iterations measured per profiler setting (after a warm-up one).
        straggler: (pipeline, factor): that pipeline's instructions run `factor` times longer.
        straggler_detection: Let the coordinator detect stragglers (off: threshold set high).
        scheduler: "auto" (Perseus if installed, else InstructionProfiler) or a name.
        nodes: Simulated nodes (agents); the ranks are spread over them.
        timeout_s: Give up on one job after this long (s).
    """

    profile: str = DEFAULT_PROFILE
    stages: int = 4
    dp: int = 1
    microbatches: int = 4
    time_scale: float = 0.1
    baseline_iterations: int = 30
    serve_iterations: int = 30
    warmup_iterations: int = 2
    clocks: int = 6
    min_clock_fraction: float = 0.5
    profiling_iterations: int = 4
    min_profile_iterations: int = 3
    straggler: tuple[int, float] | None = None
    straggler_detection: bool = True
    scheduler: str = "auto"
    nodes: int = 2
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        from zeus_agent.gpu.sim.instructions import NUM_STAGES, STAGE_PROFILES

        if self.profile not in STAGE_PROFILES:
            raise PipelineDemoConfigError(
                f"--pipeline-profile {self.profile!r} is unknown; choose one of "
                f"{', '.join(STAGE_PROFILES)}")
        if not 2 <= self.stages <= NUM_STAGES:
            raise PipelineDemoConfigError(
                f"--pipeline-stages must be within 2-{NUM_STAGES}, got {self.stages}")
        for name, value, low in (("pipeline-dp", self.dp, 1),
                                 ("microbatches", self.microbatches, 1),
                                 ("pipeline-iterations", self.baseline_iterations, 4),
                                 ("pipeline-iterations", self.serve_iterations, 4),
                                 ("clocks", self.clocks, 2),
                                 ("profiling-iterations", self.profiling_iterations, 1),
                                 ("min-profile-iterations", self.min_profile_iterations, 1),
                                 ("nodes", self.nodes, 1)):
            if value < low:
                raise PipelineDemoConfigError(f"--{name} must be >= {low}, got {value}")
        if not 0 <= self.warmup_iterations < min(self.baseline_iterations,
                                                 self.serve_iterations) // 2:
            raise PipelineDemoConfigError(
                "--pipeline-warmup must be >= 0 and under half the measured iterations, got "
                f"{self.warmup_iterations}")
        if not (math.isfinite(self.time_scale) and 0.01 <= self.time_scale <= 10):
            raise PipelineDemoConfigError(
                f"--pipeline-time-scale must be within 0.01-10, got {self.time_scale}")
        if not 0 < self.min_clock_fraction <= 1:
            raise PipelineDemoConfigError(
                f"min_clock_fraction must be in (0, 1], got {self.min_clock_fraction}")
        if self.straggler is not None:
            index, factor = self.straggler
            if not 0 <= index < self.dp or not 1 <= factor <= 10:
                raise PipelineDemoConfigError(
                    f"straggler {index}:{factor}: needs 0 <= pipeline < {self.dp} and a factor "
                    "from 1 to 10")
        if not self.timeout_s > 0:
            raise PipelineDemoConfigError(f"timeout must be > 0, got {self.timeout_s}")

    @property
    def preset(self) -> str:
        """The simulated GPU the profile was measured on."""
        from zeus_agent.gpu.sim.instructions import preset_for

        return str(preset_for(self.profile))

    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of the job."""
        return self.stages * self.dp

    @property
    def gpus_per_node(self) -> int:
        """Simulated GPUs per node: the ranks spread evenly."""
        return math.ceil(self.world_size / self.nodes)

    @property
    def node_names(self) -> list[str]:
        """The simulated nodes."""
        return [f"pp-node-{chr(ord('a') + i)}" if i < 26 else f"pp-node-{i}"
                for i in range(self.nodes)]

    @property
    def energy_update_ms(self) -> float:
        """The GPUs' energy counter period: NVML's 100 ms, on the job's time scale."""
        return 100.0 * self.time_scale

    def profiler_args(self) -> dict[str, Any]:
        """The InstructionProfiler's knobs."""
        return {"clocks": self.clocks, "min_clock_fraction": self.min_clock_fraction,
                "warmup_iterations": 1, "min_profile_iterations": self.min_profile_iterations}

    def profiling_budget(self, available_clocks: Sequence[int]) -> int:
        """Iterations the profiler needs at most (every clock of its grid, no early stop).

        Discovery (two alike iterations) and each profiling round's switch are counted with the
        coordinator's lead of two steps plus one of slack.
        """
        from coordinator.pipeline.schedulers.instruction_profiler import coarse_grid

        levels = len(coarse_grid(available_clocks, self.clocks, self.min_clock_fraction))
        settings = 3 + 2 * (levels - 1)  # Blocking rounds, then the staircase.
        rounds = settings * math.ceil((1 + self.min_profile_iterations)
                                      / self.profiling_iterations)
        return 5 + rounds * (self.profiling_iterations + 3)


def resolve_scheduler(requested: str, dp: int) -> tuple[str, str | None]:
    """(scheduler name for a job of `dp` pipelines, a note when Perseus was not available)."""
    from coordinator.pipeline.schedulers.registry import known_schedulers

    known = set(known_schedulers())
    base = PERSEUS if requested == "auto" else requested
    note = None
    if base not in known:
        if requested != "auto":
            raise PipelineDemoConfigError(
                f"scheduler {requested!r} is unknown; known: {', '.join(sorted(known))}")
        note = (f"the {PERSEUS} scheduler (coordinator/pipeline/schedulers/perseus.py) is not "
                f"installed: running {FALLBACK}, which profiles the instructions and then serves "
                "all-max clocks (no saving expected)")
        base = FALLBACK
    name = f"{base}3D" if dp > 1 and f"{base}3D" in known else base
    return name, note


def all_max_plan(stages: int, microbatches: int, top_mhz: int) -> list[list[tuple[str, int]]]:
    """Per stage, every 1F1B instruction at `top_mhz` (a `PointSolution3D` plan)."""
    from zeus_agent.pipeline_order import one_f_one_b

    return [[(name, top_mhz) for name, _ in one_f_one_b(s, stages, microbatches)]
            for s in range(stages)]

def scheduler_args(scheduler: str, config: PipelineDemoConfig) -> dict[str, Any]:
    """The coordinator's scheduler args: the profiler's knobs (inside Perseus's)."""
    if scheduler.startswith(PERSEUS):
        # One plan served for the whole measurement (no re-profiling on drift).
        return {"profiler_args": config.profiler_args(), "max_reprofiles": 0}
    return config.profiler_args()

def write_plan(path: Path, plan: Sequence[Sequence[tuple[str, int]]]) -> str:
    """Write `plan` as `PointSolution`'s `solution_path` file; return the path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[list(p) for p in stage] for stage in plan]))
    return str(path)
