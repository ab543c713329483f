"""The pipeline part of `zeus-demo`, and the engine of `bench/perseus_savings.py`.

A simulated synchronous-1F1B pipeline job (`zeus_agent.gpu.sim.trainers.pipeline`: one process
per rank, stage workloads fitted on the real Perseus profiles, `zeus_agent.gpu.sim.instructions`)
runs twice on the same simulated GPUs, each time under a coordinator of its own, all in one
asyncio loop with the agents (one `AgentServer` per simulated node) and an embedded NATS:

1. **All-max baseline.** The coordinator runs `PointSolution` (`PointSolution3D` for DP > 1) with
   a plan of every instruction at the GPU's highest SM clock: what the job does without Perseus,
   through the same per-instruction clock locking as the optimised run.
2. **Perseus.** The coordinator runs the "Perseus" scheduler
   (`coordinator.pipeline.schedulers.perseus`; "Perseus3D" for DP > 1): it profiles the
   instructions online, plans the time-energy frontier and serves the chosen plan. Without
   that module the demo falls back to "InstructionProfiler" (profiling only: it then serves
   all-max clocks) and says so.

Every figure is what the agents measured and published on the bus: per rank and step, the
step's time and the GPU's energy counter over it (the coarse, NVML-like counter, its period
scaled with the time scale), summed over many consecutive steps (the counter's steps telescope)
and over the job's GPUs; per instruction, its start and end. The frontier, the chosen point and
the planner's prediction are read from the coordinator's Perseus scheduler (in this process).

Modules (every public name is importable from this package):

* `config`: `PipelineDemoConfig`, the job and the measurement (validated,
  `PipelineDemoConfigError`); the scheduler's name and arguments; the all-max plan.
* `cluster`: `PipelineCluster`: embedded NATS (or an external one) and the agents;
  `run_job(...)` starts a coordinator with a scheduler, runs the trainer (in a thread), follows
  the job's status events and measurements, snapshots the scheduler, stops the coordinator: a
  `JobRun`.
* `measure`: `JobObserver`; `window_stats`, `Side`: the pure arithmetic (energy per iteration
  summed over GPUs and per pipeline, time per iteration the slowest rank's).
* `run`: `run_pipeline_demo(config, console)`: both jobs, live progress; a `PipelineDemoRun`.
* `report`: `pipeline_summary`, `render_pipeline_table`, `plot_frontier`, `plot_timeline`.
"""

from __future__ import annotations

from zeus_demo.pipeline.cluster import (
    Director,
    JobContext,
    JobRun,
    PipelineCluster,
    SchedulerSnapshot,
    snapshot_scheduler,
)
from zeus_demo.pipeline.config import (
    DEFAULT_PROFILE,
    FALLBACK,
    PERSEUS,
    PipelineDemoConfig,
    PipelineDemoConfigError,
    PipelineDemoError,
    all_max_plan,
    resolve_scheduler,
    scheduler_args,
    write_plan,
)
from zeus_demo.pipeline.measure import (
    InstructionRecord,
    JobObserver,
    Side,
    StepRecord,
    pct_less,
    pct_more,
    window_stats,
)
from zeus_demo.pipeline.report import (
    PIPELINE_SUMMARY_VERSION,
    pipeline_summary,
    plot_frontier,
    plot_timeline,
    render_pipeline_table,
    timeline_of,
    write_pipeline_report,
)
from zeus_demo.pipeline.run import PipelineDemoRun, phase_text, run_pipeline_demo

__all__ = [
    "DEFAULT_PROFILE",
    "FALLBACK",
    "PERSEUS",
    "PIPELINE_SUMMARY_VERSION",
    "Director",
    "InstructionRecord",
    "JobContext",
    "JobObserver",
    "JobRun",
    "PipelineCluster",
    "PipelineDemoConfig",
    "PipelineDemoConfigError",
    "PipelineDemoError",
    "PipelineDemoRun",
    "SchedulerSnapshot",
    "Side",
    "StepRecord",
    "all_max_plan",
    "phase_text",
    "pct_less",
    "pct_more",
    "pipeline_summary",
    "plot_frontier",
    "plot_timeline",
    "render_pipeline_table",
    "resolve_scheduler",
    "run_pipeline_demo",
    "scheduler_args",
    "snapshot_scheduler",
    "timeline_of",
    "window_stats",
    "write_pipeline_report",
    "write_plan",
]
