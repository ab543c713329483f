"""The pipeline frequency optimizer (Perseus): schedulers and the per-job core (sans-I/O)."""

from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError, make_3d_parallel

__all__ = ["FrequencyScheduler", "SchedulerError", "make_3d_parallel"]
