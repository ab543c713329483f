"""A simulated synchronous-1F1B pipeline-parallel trainer: real processes, simulated GPUs.

One process per (data-parallel replica, pipeline stage) (tensor parallelism 1), each driving one
simulated GPU of its node's agent through the `PerseusOptimizer` drop-in. Modules:

* `schedule`: the pure 1F1B logic: `one_f_one_b(stage, num_stages, microbatches)` (one stage's
  instruction order), `waits_for(stage, num_stages, instruction)` (the stage whose message an
  instruction waits for), `timeline(num_stages, microbatches, duration)` (one iteration's start
  and end of every instruction, without noise).
* `job`: `NodeSpec`, `RankPlacement`, `place_ranks(nodes, stages, dp)` (where ranks run;
  Megatron-LM order with TP = 1: `rank = stage * dp + dp_index`), `PipelineOptions`,
  `run_pipeline(placements, options)` (run the job: a `PipelineResult`, or `PipelineError`
  naming the failed rank, its peers killed), `stage_profiles()`.
* `cli`: `main(argv)`, the command line
  (`python -m zeus_agent.gpu.sim.trainers.pipeline --help`).

Every public name is importable from this package.
"""

from __future__ import annotations

from zeus_agent.gpu.sim.trainers.pipeline.cli import main
from zeus_agent.gpu.sim.trainers.pipeline.job import (
    SYNTHETIC_PROFILE,
    NodeSpec,
    PipelineError,
    PipelineOptions,
    PipelineResult,
    RankPlacement,
    RankResult,
    place_ranks,
    run_pipeline,
    stage_profiles,
)
from zeus_agent.gpu.sim.trainers.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    one_f_one_b,
    timeline,
    waits_for,
)

__all__ = [
    "FORWARD",
    "BACKWARD",
    "NodeSpec",
    "PipelineError",
    "PipelineOptions",
    "PipelineResult",
    "RankPlacement",
    "RankResult",
    "SYNTHETIC_PROFILE",
    "main",
    "one_f_one_b",
    "place_ranks",
    "run_pipeline",
    "stage_profiles",
    "timeline",
    "waits_for",
]
