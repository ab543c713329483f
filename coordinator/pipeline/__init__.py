"""The pipeline frequency optimizer (Perseus): schedulers and the per-job core (sans-I/O)."""

from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError, make_3d_parallel

__all__ = ["FrequencyScheduler", "SchedulerError", "make_3d_parallel"]

from coordinator.pipeline.names import register_scheduler, resolve_scheduler  # noqa: E402
from coordinator.pipeline.point_solution import (  # noqa: E402
    PointSolution,
    PointSolution3D,
    load_plan,
)
from coordinator.pipeline.settings import PFOServerSettings  # noqa: E402

__all__ += [
    "PFOServerSettings",
    "PointSolution",
    "PointSolution3D",
    "load_plan",
    "register_scheduler",
    "resolve_scheduler",
]
