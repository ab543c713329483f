"""The contract between the coordinator's shell and its optimisers (sans-I/O).

An optimiser drives one job: the power-limit optimiser (`coordinator.power_limit.job`) or the
pipeline frequency optimiser (`coordinator.pipeline.job`). The shell feeds it what arrives on
the bus and executes what it returns; it never looks inside:

* in: `start()`, then trainer events (`on_event`), GPU marks (`on_mark`), per-step and
  per-instruction measurements (`on_measurement`), the agents' error events about a rank
  (`on_agent_error`) and timer ticks (`tick`), each with the time passed in (the optimiser
  reads no clock);
* out: a list of `Action`s: apply a power limit to the job's GPUs, install per-rank frequency
  schedules, keep a file (a profile, a dump), write a file a scheduler produced (`WriteFile`),
  record its progress (`SaveProgress`: what a replica taking the job over resumes from),
  report a status;
* for reconciliation after an agent restart: `desired_power_limit` and `desired_schedule(rank)`
  (with the step its ranks switch at), what the job's GPUs should be running now;
* for queries: `kind` (the key its `progress()` goes under), `progress()`, `waiting_for()`;
  for dashboards: `snapshot()` (a `JobSnapshot`);
* what the shell must know to carry an input: `plans_on(measurement)` (it may plan for seconds:
  fed off the event loop); `abort(why)` (a schedule too big to send); `set_straggler` (a
  straggler notice: `StragglerError` with a reply code when the job takes none).

The shell never checks which optimiser it drives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from zeus_agent.errors import ReplyError
from zeus_agent.models import FrequencySchedule, PowerLimitMeasurement
from zeus_agent.wire.event_columns import EventLike
from zeus_agent.wire.messages import REPLY_CODES
from zeus_agent.wire.node_columns import MarkLike, MeasurementLike

__all__ = [
    "Action",
    "ApplyPowerLimit",
    "AskSelector",
    "ClearSchedules",
    "InstallSchedules",
    "JobOptimizer",
    "JobSnapshot",
    "DesiredSchedule",
    "KeepFile",
    "SaveProfile",
    "SaveProgress",
    "StatusUpdate",
    "StragglerError",
    "WriteFile",
]


class StragglerError(ReplyError):
    """A straggler notice the job cannot take; `code` is the reply's error code.

    Raised with the code that says why (no such pipeline, a bad factor, a stopped job).

    Raises:
        ValueError: `code` is not one of `REPLY_CODES`.
    """

    code = "bad_request"

    def __init__(self, code: str, message: str) -> None:
        if code not in REPLY_CODES:
            raise ValueError(f"{code!r} is not a reply code (zeus_agent.wire.messages.REPLY_CODES)")
        super().__init__(message)
        self.code = code


class DesiredSchedule(NamedTuple):
    """What one rank should be running: the schedule, its version, the step it switches at."""

    schedule: FrequencySchedule
    version: int
    from_step: int | None = None
    """The step its ranks switch at (None: at once, or not known after a takeover)."""


@dataclass(frozen=True, slots=True)
class ApplyPowerLimit:
    """Set this limit (W) on every GPU of the job."""

    watts: int


@dataclass(frozen=True, slots=True)
class InstallSchedules:
    """Install one frequency schedule per rank on the agent of that rank's GPU.

    Every rank switches at its first iteration whose step counter is >= `from_step` (None: at
    once); measurements made under it carry `version`.
    """

    schedules: tuple[FrequencySchedule, ...]
    version: int
    from_step: int | None = None


@dataclass(frozen=True, slots=True)
class ClearSchedules:
    """Remove the job's schedules from its GPUs (their clocks go back to default)."""


@dataclass(frozen=True, slots=True)
class SaveProfile:
    """Power-limit profiling finished: keep these measurements (Zeus profile format)."""

    measurements: tuple[PowerLimitMeasurement, ...]
    optimal_power_limit: int
    chosen_by_trainer: bool = False
    """The limit came from the user's own selector (or its fallback): recorded with the
    profile, so a replica taking the job over pins it without asking again."""


@dataclass(frozen=True, slots=True)
class AskSelector:
    """Ask the process of `rank` to run the user's optimum selector on `measurements`.

    Carried by the agent of the rank's GPU; the answer comes back as a `selection` event
    numbered `request`. The shell reports a rank it cannot reach through
    `JobOptimizer.selector_unreachable`.
    """

    rank: int
    request: int
    measurements: tuple[PowerLimitMeasurement, ...]


@dataclass(frozen=True, slots=True)
class KeepFile:
    """Write `content` as `name` in the job's dump directory (when dumping is enabled)."""

    name: str
    content: str


@dataclass(frozen=True, slots=True)
class WriteFile:
    """Write `content` as `path`, replacing it: a file a scheduler produced.

    A profile, a frontier (`FrequencyScheduler.take_files`); `what` names it for the log.
    Written whether dumping is on or not.
    """

    path: str
    content: str
    what: str


@dataclass(frozen=True, slots=True)
class SaveProgress:
    """Record this progress (JSON-ready) so that a replica taking the job over resumes it.

    `kind` names what it is (`"windows"`: a power-limit search; `"pipeline"`: a pipeline
    job's rounds); only the latest progress of a job matters.
    """

    kind: str
    state: Any


@dataclass(frozen=True, slots=True)
class StatusUpdate:
    """A state change or progress report."""

    state: str
    message: str
    progress: dict[str, Any] = field(default_factory=dict)


Action = (
    ApplyPowerLimit | InstallSchedules | ClearSchedules | SaveProfile | SaveProgress | KeepFile
    | WriteFile | StatusUpdate | AskSelector
)


@dataclass(frozen=True)
class JobSnapshot:
    """What the dashboard shows of one job (None: not known, or not this kind's)."""

    job_id: str
    kind: str
    """"power_limit" or "pipeline"."""
    phase: str
    power_limit_w: float | None = None
    optimal_power_limit_w: float | None = None
    measured: int | None = None
    candidates: int | None = None
    schedule_version: int | None = None
    plan_index: int | None = None
    plan_points: int | None = None
    plan_time_s: float | None = None
    plan_energy_j: float | None = None
    energy_saving: float | None = None
    slowdown: float | None = None


def saving_and_slowdown(
    chosen: tuple[float, float], reference: tuple[float, float]
) -> tuple[float, float]:
    """(energy saving, slowdown) of `chosen` against `reference`, each (energy, time)."""
    (e, t), (e_ref, t_ref) = chosen, reference
    saving = 1.0 - e / e_ref if e_ref > 0 else math.nan
    slowdown = t / t_ref - 1.0 if t_ref > 0 else math.nan
    return saving, slowdown


@runtime_checkable
class JobOptimizer(Protocol):
    """What the shell needs from an optimiser (see the module docstring)."""

    job_id: str
    kind: str
    """The key its `progress()` goes under in a query's reply ("power_limit", "pipeline")."""

    @property
    def done(self) -> bool:
        """Nothing left to decide: the shell stops ticking it."""
        ...

    @property
    def desired_power_limit(self) -> int | None:
        """The limit the job's GPUs should have now (None: none of this optimiser's)."""
        ...

    def desired_schedule(self, rank: int) -> DesiredSchedule | None:
        """What rank `rank` should be running now, or None."""
        ...

    def plans_on(self, measurement: MeasurementLike) -> bool:
        """Whether feeding `measurement` may take long (plan a frontier): fed off the loop."""
        ...

    def abort(self, why: str) -> list[Action]:
        """Stop optimising (a schedule that cannot be sent): the actions that say so."""
        ...

    def set_straggler(self, pipeline: int, factor: float | None) -> list[Action]:
        """A straggler notice (factor None: cleared). Raises `StragglerError`."""
        ...

    def start(self) -> list[Action]:
        """First actions, once every rank is registered."""
        ...

    def on_event(self, rank: int, event: EventLike, now_s: float) -> list[Action]:
        """A trainer event of `rank`."""
        ...

    def on_events(self, rank: int, events: list[EventLike], now_s: float) -> list[Action]:
        """A batch of `rank`'s trainer events, oldest first, as one input.

        A late batch may pass windows whose commands would come too late: the optimiser sends
        only what the batch's last event needs.
        """
        ...

    def selector_unreachable(self, request: int, why: str) -> list[Action]:
        """The process asked by `AskSelector` `request` cannot be reached (its agent said why)."""
        ...

    def on_mark(self, rank: int, mark: MarkLike) -> list[Action]:
        """A GPU mark (energy counter at a step or epoch event) of `rank`."""
        ...

    def on_measurement(self, rank: int, measurement: MeasurementLike, now_s: float) -> list[Action]:
        """A step or instruction measurement of `rank`."""
        ...

    def tick(self, now_s: float) -> list[Action]:
        """Timers (overdue windows...)."""
        ...

    def on_agent_error(self, rank: int, code: str, message: str, now_s: float) -> list[Action]:
        """An error event of the agent driving `rank`'s GPU (e.g. `trainer_gone`)."""
        ...

    def progress(self) -> dict[str, Any]:
        """Where the optimisation stands (for queries)."""
        ...

    def waiting_for(self) -> dict[str, Any]:
        """What the optimisation waits for (for queries)."""
        ...

    def snapshot(self) -> JobSnapshot:
        """What a dashboard shows of the job (`coordinator.metrics`)."""
        ...

