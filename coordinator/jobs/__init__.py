"""The job registry core: jobs, their ranks and the GPUs they drive (sans-I/O)."""

from coordinator.jobs.registry import (
    DuplicateError,
    ForbiddenError,
    JobRecord,
    JobRegistry,
    QuotaError,
    RankRangeError,
    RankRecord,
    RegistryError,
    UnknownJobError,
)

__all__ = [
    "DuplicateError",
    "ForbiddenError",
    "JobRecord",
    "JobRegistry",
    "QuotaError",
    "RankRangeError",
    "RankRecord",
    "RegistryError",
    "UnknownJobError",
]
