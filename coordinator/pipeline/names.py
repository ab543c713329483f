"""The registry of pipeline frequency schedulers by name (Zeus 0.16's scheduler names).

`resolve_scheduler("PointSolution")` returns the class; Zeus's full import path
(`zeus.optimizer.pipeline_frequency.server.scheduler.PointSolution`) is accepted too, by its
last component. Nothing is imported from a user-given path: only registered classes are found.

Modules that define more schedulers call `register_scheduler(name, cls)` at import time; the
ones listed in `LAZY_MODULES` are imported by `resolve_scheduler` (if they exist), so their
schedulers are found without the caller importing them first.
"""

from __future__ import annotations

import importlib

from coordinator.pipeline.point_solution import PointSolution, PointSolution3D
from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError

__all__ = [
    "LAZY_MODULES",
    "SCHEDULERS",
    "ZEUS_SCHEDULER_MODULE",
    "known_schedulers",
    "register_scheduler",
    "resolve_scheduler",
]

ZEUS_SCHEDULER_MODULE = "zeus.optimizer.pipeline_frequency.server.scheduler"
"""Where Zeus 0.16 keeps its schedulers: its settings name them by this full path."""

LAZY_MODULES: tuple[str, ...] = (
    "coordinator.pipeline.instruction_profiler",
    "coordinator.pipeline.perseus",
)
"""Modules imported (when they exist) before a name is resolved, for their registrations."""

SCHEDULERS: dict[str, type[FrequencyScheduler]] = {
    "PointSolution": PointSolution,
    "PointSolution3D": PointSolution3D,
}
"""Scheduler name -> class. Add with `register_scheduler`."""


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


def _import_lazy_modules() -> None:
    for module in LAZY_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise  # The module exists but one of its imports is missing: say so.


def known_schedulers() -> list[str]:
    """The registered names, sorted (after importing `LAZY_MODULES`)."""
    _import_lazy_modules()
    return sorted(SCHEDULERS)


def resolve_scheduler(name: str) -> type[FrequencyScheduler]:
    """The scheduler class registered as `name` (or Zeus's full path to it).

    Raises:
        SchedulerError: No such scheduler; the message lists the known names.
    """
    _import_lazy_modules()
    key: str | None = name.strip() if isinstance(name, str) else None
    if key is not None and "." in key:
        module, _, last = key.rpartition(".")
        # Zeus's own module path (or another zeus.* path) names one of Zeus's schedulers.
        key = last if module == ZEUS_SCHEDULER_MODULE or module.startswith("zeus.") else None
    cls = SCHEDULERS.get(key) if key is not None else None
    if cls is None:
        hint = (
            " (import paths other than Zeus's are not loaded: register the class with "
            "coordinator.pipeline.names.register_scheduler)"
            if isinstance(name, str) and "." in name and key is None
            else ""
        )
        raise SchedulerError(
            f"unknown scheduler {name!r}{hint}; known schedulers: {', '.join(sorted(SCHEDULERS))}"
        )
    return cls
