"""The registry of pipeline frequency schedulers by name (Zeus 0.16's scheduler names). Pure.

`BUILTIN` is the explicit table of the schedulers this package ships, name -> class;
`SCHEDULERS` starts as a copy of it. `resolve_scheduler("PointSolution")` returns the class;
Zeus's full import path (`zeus.optimizer.pipeline_frequency.server.scheduler.PointSolution`) is
accepted too, by its last component. Nothing is imported from a user-given path, and no module
registers anything by being imported: only the classes in the table, and those a program adds
with `register_scheduler(name, cls)` before it starts the coordinator, are found.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from coordinator.pipeline.schedulers.base import FrequencyScheduler, SchedulerError
from coordinator.pipeline.schedulers.instruction_profiler import (
    InstructionProfiler,
    InstructionProfiler3D,
)
from coordinator.pipeline.schedulers.perseus import Perseus, Perseus3D
from coordinator.pipeline.schedulers.point_solution import PointSolution, PointSolution3D

__all__ = [
    "BUILTIN",
    "SCHEDULERS",
    "ZEUS_SCHEDULER_MODULE",
    "known_schedulers",
    "register_scheduler",
    "resolve_scheduler",
]

ZEUS_SCHEDULER_MODULE = "zeus.optimizer.pipeline_frequency.server.scheduler"
"""Where Zeus 0.16 keeps its schedulers: its settings name them by this full path."""

BUILTIN: Mapping[str, type[FrequencyScheduler]] = MappingProxyType({
    "PointSolution": PointSolution,
    "PointSolution3D": PointSolution3D,
    "InstructionProfiler": InstructionProfiler,
    "InstructionProfiler3D": InstructionProfiler3D,
    "Perseus": Perseus,
    "Perseus3D": Perseus3D,
})
"""The schedulers shipped here: Zeus 0.16's `PointSolution`(3D), and the online
`InstructionProfiler`(3D) and `Perseus`(3D)."""

SCHEDULERS: dict[str, type[FrequencyScheduler]] = dict(BUILTIN)
"""Scheduler name -> class: `BUILTIN` and those added with `register_scheduler`."""


def register_scheduler(name: str, cls: type[FrequencyScheduler]) -> None:
    """Make `cls` available as `name` (idempotent for the same class).

    Raises:
        SchedulerError: `name` is not an identifier, `cls` is not a `FrequencyScheduler`, or the
            name is taken by another class.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise SchedulerError(f"scheduler name must be a Python identifier, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, FrequencyScheduler)):
        raise SchedulerError(f"{name}: {cls!r} is not a FrequencyScheduler subclass")
    existing = SCHEDULERS.get(name)
    if (
        existing is not None
        and existing is not cls
        and ((existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__))
    ):  # Same module and name: the module was reloaded.
        raise SchedulerError(
            f"scheduler name {name!r} is already taken by "
            f"{existing.__module__}.{existing.__qualname__}"
        )
    SCHEDULERS[name] = cls


def known_schedulers() -> list[str]:
    """The registered names, sorted."""
    return sorted(SCHEDULERS)


def resolve_scheduler(name: str) -> type[FrequencyScheduler]:
    """The scheduler class registered as `name` (or Zeus's full path to it).

    Raises:
        SchedulerError: No such scheduler; the message lists the known names.
    """
    key: str | None = name.strip() if isinstance(name, str) else None
    if key is not None and "." in key:
        module, _, last = key.rpartition(".")
        # Zeus's own module path (or another zeus.* path) names one of Zeus's schedulers.
        key = last if module == ZEUS_SCHEDULER_MODULE or module.startswith("zeus.") else None
    cls = SCHEDULERS.get(key) if key is not None else None
    if cls is None:
        hint = (
            " (import paths other than Zeus's are not loaded: register the class with "
            "coordinator.pipeline.schedulers.registry.register_scheduler)"
            if isinstance(name, str) and "." in name and key is None
            else ""
        )
        raise SchedulerError(
            f"unknown scheduler {name!r}{hint}; known schedulers: {', '.join(sorted(SCHEDULERS))}"
        )
    return cls
