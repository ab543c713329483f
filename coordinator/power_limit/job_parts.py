"""Pieces of `PowerLimitJob` that need none of its state (pure).

* `make_selector`: the optimum selector a job's options name;
* `resume_arguments`: the machine's `resume*` arguments from a record of a job's progress (a
  list of windows, or `PowerLimitJob.persisted()` of its previous owner);
* `give_up_reason`: why the optimiser gives up, in words for people;
* `progress_of`, `snapshot_of`: a job's progress (status events, queries) and its dashboard
  snapshot, from its machine;
* `NotAPipeline`: the `JobOptimizer` inputs a power-limit job has no use for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.optimizer import (
    Action,
    JobSnapshot,
    StatusUpdate,
    StragglerError,
    saving_and_slowdown,
)
from coordinator.power_limit.errors import NothingMeasuredError, PowerLimitError
from coordinator.power_limit.machine import PowerLimitStateMachine
from coordinator.power_limit.search import Probe, WindowResult
from coordinator.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)
from coordinator.power_limit.trainer_choice import DeferredSelector
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.messages import PowerLimitOptions
from zeus_agent.wire.node_columns import MeasurementLike

__all__ = [
    "NotAPipeline",
    "gave_up_message",
    "give_up_reason",
    "machine_for",
    "make_selector",
    "progress_of",
    "resume_arguments",
    "snapshot_of",
]


def make_selector(options: PowerLimitOptions, world_size: int) -> OptimumSelector:
    """The optimum selector the options name (a stand-in for a user's own: `TrainerChoice`)."""
    if options.selector == "Custom":
        return DeferredSelector()
    if options.selector == "Energy":
        return Energy()
    if options.selector == "Time":
        return Time()
    if options.selector == "MaxSlowdownConstraint":
        return MaxSlowdownConstraint(factor=options.max_slowdown)
    return ZeusCost(eta_knob=options.eta_knob, world_size=options.world_size or world_size)


def machine_for(options: PowerLimitOptions, world_size: int, min_power_limit_w: int,
                max_power_limit_w: int, measurements: list[PowerLimitMeasurement] | None,
                resume: Sequence[WindowResult] | dict[str, Any]) -> PowerLimitStateMachine:
    """The state machine of a job with `options` over `world_size` GPUs (`PowerLimitJob`)."""
    return PowerLimitStateMachine(
        min_power_limit=min_power_limit_w,
        max_power_limit=max_power_limit_w,
        optimum_selector=make_selector(options, world_size),
        world_size=world_size,
        wait_steps=options.wait_steps,
        warmup_steps=options.warmup_steps,
        profile_steps=options.profile_steps,
        pl_step=options.pl_step_w,
        measurements=measurements,
        search=options.search,
        **resume_arguments(resume),
    )


def resume_arguments(resume: Sequence[WindowResult] | dict[str, Any]) -> dict[str, Any]:
    """The machine's `resume*` arguments from a list of windows or a `persisted()` dict.

    Raises:
        ValueError, TypeError, KeyError: `resume` is not readable.
    """
    if not isinstance(resume, dict):
        return {"resume": [w if isinstance(w, WindowResult) else WindowResult(**w)
                           for w in resume]}
    return {
        "resume": [WindowResult(**w) for w in resume["windows"]],
        "resume_completed": int(resume["completed"]),
        "resume_redo": [Probe(int(w), int(warmup), int(steps))
                        for w, warmup, steps in resume["redo"]],
        "resume_window_steps": int(resume.get("window_steps", 1)),  # (Older records: none.)
        "resume_cap_offset": int(resume.get("cap_offset", 0)),  # (Older records: none.)
    }


def give_up_reason(error: PowerLimitError) -> str:
    """Why the optimiser gives up, in words for people (the machine's text for developers)."""
    if isinstance(error, NothingMeasuredError):
        return ("no window was measured: every power limit's window was lost, unusable or "
                "redone too often, so there is nothing to choose from")
    return f"internal error of the power-limit optimiser: {error}"


def gave_up_message(why: str, limit: int) -> str:
    """The status of a job whose optimiser gave up at the maximum `limit` (W)."""
    return (f"power-limit optimiser gave up ({why}); GPUs restored to the maximum limit "
            f"{limit} W. Check that the agents measure energy (zeus-agent logs), then register "
            "the job again")


def progress_of(machine: PowerLimitStateMachine, phase: str, optimal: int | None,
                gave_up: str | None) -> dict[str, Any]:
    """A job's progress for status events and queries."""
    return {
        "phase": phase,
        "power_limit_w": machine.current_power_limit,
        "measured": len(machine.measurements),
        "candidates": len(machine.power_limits),
        "optimal_power_limit_w": optimal,
        "measurements": [m.model_dump() for m in machine.measurements],
        "redone": {str(k): v for k, v in machine.redos().items()},
        "gave_up": gave_up,
        "cap_w": None if machine.optimal_power_limit is not None else machine.cap_w,
        "parked": machine.parked,
    }


def snapshot_of(machine: PowerLimitStateMachine, job_id: str, kind: str, phase: str,
                optimal: int | None, current: int | None) -> JobSnapshot:
    """A job's phase, limits and the saving its profile measured (for dashboards).

    The saving and slowdown compare the `optimal` limit's measurement with the highest limit's.
    """
    measurements = list(machine.measurements)
    saving = slowdown = None
    if optimal is not None and measurements:
        by_limit = {m.power_limit: m for m in measurements}
        chosen, reference = by_limit.get(optimal), by_limit[max(by_limit)]
        if chosen is not None:
            saving, slowdown = saving_and_slowdown(
                (chosen.energy, chosen.time), (reference.energy, reference.time))
    return JobSnapshot(
        job_id=job_id, kind=kind, phase=phase,
        power_limit_w=float(current) if current is not None else None,
        optimal_power_limit_w=float(optimal) if optimal is not None else None,
        measured=len(measurements), candidates=len(machine.power_limits),
        energy_saving=saving, slowdown=slowdown)


class NotAPipeline:
    """The `JobOptimizer` inputs a power-limit job has no use for (a pipeline job's).

    Stateless: it reads nothing of the job it is part of.
    """

    def desired_schedule(self, rank: int) -> None:
        """Power-limit jobs install no frequency schedules."""
        return None

    def plans_on(self, measurement: MeasurementLike) -> bool:
        """Nothing it is fed takes long."""
        return False

    def abort(self, why: str) -> list[Action]:
        """Nothing of its own to stop (it sends no schedules): say why."""
        return [StatusUpdate("error", why)]

    def set_straggler(self, pipeline: int, factor: float | None) -> list[Action]:
        """Straggler notices are for pipeline jobs."""
        raise StragglerError(
            "not_supported",
            "this job is optimised by the power-limit optimizer: straggler notices are for "
            "pipeline jobs (pipeline frequency optimizer)")

    def on_measurement(self, rank: int, measurement: MeasurementLike, now_s: float) -> list[Action]:
        """Step and instruction measurements are not used: windows come from marks."""
        return []
