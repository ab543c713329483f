"""`PFOServerSettings`: Zeus 0.16's pipeline frequency optimizer settings (`ZEUS_PFO_*`).

I/O edge: built without a value, a field is read from the environment (`ZEUS_PFO_*`, as
Zeus's `BaseSettings` does), and checking `scheduler_args` runs the scheduler's `check_args`,
which may read a file (`PointSolution` reads its plan). The coordinator builds it from its own
settings (`coordinator.config`), every field given.

Same fields, names, defaults and environment variables as Zeus 0.16:

* `scheduler`: a registered scheduler name (`coordinator.pipeline.schedulers.registry`), e.g.
  "PointSolution" or Zeus's full path to it; stored as the short name. Never imported from a
  user path.
* `scheduler_args`: extra constructor arguments of the scheduler, checked against its
  constructor when the settings are built (`ZEUS_PFO_SCHEDULER_ARGS` is JSON).
* `log_level` (upper-cased), `dump_data`, `dump_dir`, `max_job_idle_time` (seconds).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from coordinator.pipeline.schedulers.base import FrequencyScheduler
from coordinator.pipeline.schedulers.registry import resolve_scheduler
from zeus_agent.models import JobInfo, RankInfo

__all__ = ["PFOServerSettings", "describe_parameters"]

RESERVED_ARGS = ("job_info", "rank_infos", "pfo_settings")
"""Constructor arguments the coordinator gives every scheduler (not in `scheduler_args`)."""


def describe_parameters(cls: type) -> str:
    """The constructor parameters of `cls` a user may give, e.g. "solution_path (required)"."""
    parts = []
    for param in inspect.signature(cls).parameters.values():
        if param.name in RESERVED_ARGS:
            continue
        if param.kind is param.VAR_KEYWORD:
            parts.append(f"**{param.name}")
        elif param.kind is param.VAR_POSITIONAL:
            continue
        elif param.default is param.empty:
            parts.append(f"{param.name} (required)")
        else:
            parts.append(f"{param.name}={param.default!r}")
    return ", ".join(parts) if parts else "no arguments"


class PFOServerSettings(BaseSettings):
    """Settings of the pipeline frequency optimizer (Zeus 0.16's `PFOServerSettings`).

    Attributes:
        scheduler: Name of the frequency scheduler (registered in
            `coordinator.pipeline.schedulers.registry`).
        scheduler_args: Extra arguments of the scheduler's constructor.
        log_level: Log level, upper-cased.
        dump_data: Dump profiling results and schedules for inspection.
        dump_dir: Directory of the dumps.
        max_job_idle_time: Seconds a job may be idle before it is deleted.
    """

    model_config = SettingsConfigDict(env_prefix="ZEUS_PFO_", extra="ignore")

    scheduler: str = "PointSolution"
    scheduler_args: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    log_level: str = "DEBUG"
    dump_data: bool = True
    dump_dir: str = "./dump"
    max_job_idle_time: int = Field(default=60 * 60 * 24 * 7, gt=0)
    profiling_iterations: int = Field(default=5, ge=1, le=1000)
    """Extension over Zeus 0.16: iterations per rank in one `ProfilingResult` (the coordinator
    observes the scheduler every this many iterations; profilers plan their rounds with it)."""

    @field_validator("scheduler")
    @classmethod
    def _check_scheduler(cls, name: str) -> str:
        """A registered name (Zeus's full path accepted); kept as the short name."""
        resolve_scheduler(name)
        return name.strip().rpartition(".")[2]

    @field_validator("scheduler_args")
    @classmethod
    def _check_scheduler_args(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The args must bind to the scheduler's constructor (Zeus 0.16's check)."""
        name = info.data.get("scheduler")
        if name is None:  # The scheduler was refused: its error says why.
            return args
        sched_cls = resolve_scheduler(name)
        reserved = sorted(set(args) & set(RESERVED_ARGS))
        if reserved:
            raise ValueError(
                f"Invalid scheduler args for {name}: {', '.join(reserved)} given by the "
                f"coordinator, not in scheduler_args; {name} takes "
                f"{describe_parameters(sched_cls)}"
            )
        try:
            inspect.signature(sched_cls).bind(
                job_info=None, rank_infos=None, pfo_settings=None, **args
            )
        except TypeError as e:
            raise ValueError(
                f"Invalid scheduler args for {name}: {e}; {name} takes "
                f"{describe_parameters(sched_cls)}"
            ) from None
        try:  # What can be checked before any job: files, ranges.
            sched_cls.check_args(**args)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"Invalid scheduler args for {name}: {e}") from None
        return args

    @field_validator("log_level")
    @classmethod
    def _upper(cls, level: str) -> str:
        """Upper-cased, as Zeus does; any name Python's logging takes (WARN, FATAL, NOTSET too)."""
        upper = level.strip().upper()
        names = logging.getLevelNamesMapping()
        if upper not in names:
            raise ValueError(
                f"unknown log level {level[:40]!r}; use one of {', '.join(names)} (any case)"
            )
        return upper

    @property
    def scheduler_class(self) -> type[FrequencyScheduler]:
        """The scheduler's class."""
        return resolve_scheduler(self.scheduler)

    def create_scheduler(
        self, job_info: JobInfo, rank_infos: Sequence[RankInfo]
    ) -> FrequencyScheduler:
        """Build the scheduler for a job with these settings and `scheduler_args`.

        Raises:
            SchedulerError: The scheduler cannot run for this job (e.g. a plan of the wrong
                shape).
        """
        return self.scheduler_class(job_info, rank_infos, self, **self.scheduler_args)
