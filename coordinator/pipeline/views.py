"""What `PipelineJob` checks of its arguments and shows of its plan. Pure."""

from __future__ import annotations

import math
from typing import Any

from coordinator.optimizer import saving_and_slowdown
from coordinator.pipeline.schedulers.base import FrequencyScheduler

__all__ = ["check_arguments", "plan_view"]


def check_arguments(
    straggler_threshold: float,
    straggler_window: int,
    profiling_iterations: int,
    switch_lead_steps: int,
) -> None:
    """Check `PipelineJob`'s arguments of these names.

    Raises:
        ValueError: One is out of range (the message names it and its value).
    """
    if not (math.isfinite(straggler_threshold) and straggler_threshold > 0):
        raise ValueError(f"straggler_threshold must be > 0, got {straggler_threshold}")
    if straggler_window < 1:
        raise ValueError(f"straggler_window must be >= 1, got {straggler_window}")
    if profiling_iterations < 1:
        raise ValueError(f"profiling_iterations must be >= 1, got {profiling_iterations}")
    if switch_lead_steps < 1:
        raise ValueError(f"switch_lead_steps must be >= 1, got {switch_lead_steps}")


def plan_view(scheduler: FrequencyScheduler | None) -> dict[str, Any]:
    """The `JobSnapshot` fields of the plan `scheduler` serves (None each without a plan)."""
    # (Every scheduler answers `frontier` and `chosen`: None when it has no frontier.)
    frontier = scheduler.frontier if scheduler is not None else None
    chosen = scheduler.chosen if scheduler is not None else None
    index = points = time_s = energy_j = saving = slowdown = None
    if frontier and chosen is not None:
        points = len(frontier)
        index = next((i for i, p in enumerate(frontier) if p is chosen), None)
        if index is None:
            index = next((i for i, p in enumerate(frontier) if p == chosen), None)
        time_s, energy_j = float(chosen.time), float(chosen.energy)
        fastest = frontier[0]
        saving, slowdown = saving_and_slowdown(
            (energy_j, time_s), (float(fastest.energy), float(fastest.time)))
    return {"plan_index": index, "plan_points": points, "plan_time_s": time_s,
            "plan_energy_j": energy_j, "energy_saving": saving, "slowdown": slowdown}
