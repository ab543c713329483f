"""The contract between the coordinator's shell and its optimisers (sans-I/O).

An optimiser drives one job: the power-limit optimiser (`coordinator.power_limit.job`) or the
pipeline frequency optimiser (`coordinator.pipeline.job`). The shell feeds it what arrives on
the bus and executes what it returns; it never looks inside:

* in: `start()`, then trainer events (`on_event`), GPU marks (`on_mark`), per-step and
  per-instruction measurements (`on_measurement`), the agents' error events about a rank
  (`on_agent_error`) and timer ticks (`tick`), each with the time passed in (the optimiser
  reads no clock);
* out: a list of `Action`s: apply a power limit to the job's GPUs, install per-rank frequency
  schedules, keep a file (a profile, a dump), report a status;
* for reconciliation after an agent restart: `desired_power_limit` and `desired_schedule(rank)`,
  what the job's GPUs should be running now;
* for queries and persistence: `progress()`, `waiting_for()`, `persisted()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from zeus_agent.models import FrequencySchedule, PowerLimitMeasurement
from zeus_agent.wire.messages import Mark, Measurement, TrainerEvent

__all__ = [
    "Action",
    "ApplyPowerLimit",
    "ClearSchedules",
    "InstallSchedules",
    "JobOptimizer",
    "KeepFile",
    "SaveProfile",
    "StatusUpdate",
]


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


@dataclass(frozen=True, slots=True)
class KeepFile:
    """Write `content` as `name` in the job's dump directory (when dumping is enabled)."""

    name: str
    content: str


@dataclass(frozen=True, slots=True)
class StatusUpdate:
    """A state change or progress report."""

    state: str
    message: str
    progress: dict[str, Any] = field(default_factory=dict)


Action = (
    ApplyPowerLimit | InstallSchedules | ClearSchedules | SaveProfile | KeepFile | StatusUpdate
)


@runtime_checkable
class JobOptimizer(Protocol):
    """What the shell needs from an optimiser (see the module docstring)."""

    job_id: str

    @property
    def done(self) -> bool:
        """Nothing left to decide: the shell stops ticking it."""
        ...

    @property
    def desired_power_limit(self) -> int | None:
        """The limit the job's GPUs should have now (None: none of this optimiser's)."""
        ...

    def desired_schedule(self, rank: int) -> tuple[FrequencySchedule, int] | None:
        """(schedule, version) rank `rank` should be running now, or None."""
        ...

    def start(self) -> list[Action]:
        """First actions, once every rank is registered."""
        ...

    def on_event(self, rank: int, event: TrainerEvent, now_s: float) -> list[Action]:
        """A trainer event of `rank`."""
        ...

    def on_mark(self, rank: int, mark: Mark) -> list[Action]:
        """A GPU mark (energy counter at a step or epoch event) of `rank`."""
        ...

    def on_measurement(self, rank: int, measurement: Measurement, now_s: float) -> list[Action]:
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

    def persisted(self) -> Any:
        """JSON-ready state that lets a restarted coordinator resume (None: nothing)."""
        ...
