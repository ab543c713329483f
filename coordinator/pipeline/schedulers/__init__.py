"""The pipeline frequency schedulers and their framework (Zeus 0.16's scheduler interface).

The framework:

* `base`: `FrequencyScheduler` (the base class: what every scheduler answers),
  `SchedulerError`, `FileOut` (a file a scheduler produced, written by the coordinator);
* `parallel3d`: `make_3d_parallel`, which plans per pipeline stage of a DP x PP x TP job;
* `registry`: the explicit table of schedulers by name (`BUILTIN`, `resolve_scheduler`,
  `register_scheduler`);
* `settings`: `PFOServerSettings` (`ZEUS_PFO_*`), the scheduler and its arguments (an I/O
  edge: it reads the environment).

The schedulers: `point_solution` (`PointSolution`: a precomputed plan, read by `plan_file`, an
I/O edge), `instruction_profiler` (`InstructionProfiler`: online per-instruction profiling) and
`perseus` (`Perseus`: profile, plan the frontier with `coordinator.pipeline.planner`, serve,
re-plan on drift), each with its `...3D` form. All but the two I/O edges are pure.
"""

from coordinator.pipeline.schedulers.base import (
    FileOut,
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
)
from coordinator.pipeline.schedulers.parallel3d import make_3d_parallel
from coordinator.pipeline.schedulers.registry import (
    BUILTIN,
    known_schedulers,
    register_scheduler,
    resolve_scheduler,
)

__all__ = [
    "BUILTIN",
    "FileOut",
    "FrequencyScheduler",
    "ScheduleGenerator",
    "SchedulerError",
    "known_schedulers",
    "make_3d_parallel",
    "register_scheduler",
    "resolve_scheduler",
]
