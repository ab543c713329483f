"""The Perseus frontier planner: a pipeline's iteration time-energy frontier. Pure.

* `profile`: `InstructionProfile`, each stage's instructions' time and energy per SM clock
  (`profile_file.load_profile` reads one from a CSV file: the package's one I/O edge);
* `dag`: the iteration's instructions and dependencies (`Synchronous1F1B`, `build_dag`);
* `graph` and `cut`: longest-path passes and the least-cost cut of one sweep step;
* `frontier`: `plan_frontier`, the Phillips-Dessouky sweep that traces the frontier;
* `points`: `FrontierPoint`, a plan's cost (`evaluate`), the all-max plan, `choose`.
"""

from coordinator.pipeline.planner.frontier import PlannerStats, plan_frontier
from coordinator.pipeline.planner.points import (
    FrontierPoint,
    choose,
    evaluate,
    max_frequency_plan,
)
from coordinator.pipeline.planner.profile import DEFAULT_P_BLOCK_W, InstructionProfile, Plan

__all__ = [
    "DEFAULT_P_BLOCK_W",
    "FrontierPoint",
    "InstructionProfile",
    "Plan",
    "PlannerStats",
    "choose",
    "evaluate",
    "max_frequency_plan",
    "plan_frontier",
]
