"""`FrequencyScheduler`: the base class of the pipeline frequency schedulers. Pure.

Zeus 0.16's semantics:

* A scheduler is built from the job's `JobInfo`, its `RankInfo`s (sorted by rank here) and the
  server settings. Its generator `_run` yields one `FrequencySchedule` per rank (a list, by rank)
  and receives, at each `send`, one `ProfilingResult` per rank for the schedules it yielded.
* `next_schedule()` returns the current schedules (starting the generator the first time);
  `observe(results)` sends the results in and moves to the next schedules. A generator that has
  finished keeps serving its last schedules (`finished` becomes True).

What the job (`coordinator.pipeline.job`) may ask of any scheduler is declared here, with the
answer of a scheduler that has no such feature: `serving` and `replan_window` (a scheduler that
keeps watching the plan it serves), `frontier` and `chosen` (a time-energy frontier to slow
pipelines down with when one straggles), `check_args` (arguments checked before any job) and
`job_rank_infos` (set under `make_3d_parallel`, `coordinator.pipeline.schedulers.parallel3d`).

A scheduler reads and writes no file itself: a file it produces (a profile, a frontier) is
handed over as a `FileOut` (`take_files()`), which the coordinator writes (a caller driving a
scheduler by itself writes them with `coordinator.pipeline.dumps.write_files`).
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

__all__ = [
    "FileOut",
    "FrequencyScheduler",
    "PlanPoint",
    "ScheduleGenerator",
    "SchedulerError",
]

ScheduleGenerator = Generator[list[FrequencySchedule], list[ProfilingResult], None]


class SchedulerError(ValueError):
    """A scheduler cannot run for this job (bad plan, wrong shape, bad results)."""


class PlanPoint(Protocol):
    """One point of a time-energy frontier (`coordinator.pipeline.planner.FrontierPoint`)."""

    @property
    def time(self) -> float:
        """Planned iteration time (s)."""
        ...

    @property
    def energy(self) -> float:
        """Planned iteration energy (J)."""
        ...

    @property
    def plan(self) -> Sequence[Sequence[tuple[str, int]]]:
        """Per stage, (instruction, MHz) in execution order."""
        ...


@dataclass(frozen=True, slots=True)
class FileOut:
    """A file a scheduler produced: write `content` as `path` (replacing it), whole."""

    path: str
    content: str
    what: str
    """What it holds, for the log ("the frontier", "the instruction profile")."""


class FrequencyScheduler(abc.ABC):
    """Produces per-rank frequency schedules and learns from their profiling results."""

    serving: bool = False
    """True while the scheduler serves a chosen plan and still wants the results (Perseus
    watching for drift): its schedules are installed only when they change, as "serving"."""
    replan_window: int = 0
    """Result windows a serving scheduler compares before it plans again: a job keeps at least
    this many served rounds for a takeover to replay (0: no more than its default)."""
    frontier: Sequence[PlanPoint] | None = None
    """The time-energy frontier of the plan served (fastest first); None: the scheduler has
    none, and a straggler cannot be met by slowing the other pipelines down."""
    chosen: PlanPoint | None = None
    """The frontier point being served (None: none)."""
    job_rank_infos: list[RankInfo] | None = None
    """Under `make_3d_parallel`: the job's own ranks, sorted (the scheduler sees one rank per
    pipeline stage); None otherwise."""

    def __init__(
        self, job_info: JobInfo, rank_infos: Sequence[RankInfo], pfo_settings: Any
    ) -> None:
        self.job_info = job_info
        self.rank_infos = sorted(rank_infos, key=lambda info: info.rank)
        self.world_size = job_info.world_size
        self.pfo_settings = pfo_settings
        self._generator: ScheduleGenerator = self._run()
        self._next_schedule: list[FrequencySchedule] | None = None
        self._files: list[FileOut] = []
        self.finished = False
        """True once `_run` has returned: the last schedules are served from then on."""

    @classmethod
    def check_args(cls, **scheduler_args: Any) -> None:
        """Check `scheduler_args` before any job runs (a plan file, ranges); nothing by default.

        Called with arguments that bind to the constructor (`PFOServerSettings` checks that
        first).

        Raises:
            ValueError, TypeError, OSError: The arguments cannot work (`SchedulerError` is a
                `ValueError`).
        """
        return  # Nothing to check unless a scheduler says otherwise.

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Take one `ProfilingResult` per rank (sorted by rank) for the current schedules."""
        if self._next_schedule is None:
            self.next_schedule()
        if self.finished:
            return
        try:
            self._next_schedule = self._generator.send(profiling_results)
        except StopIteration:
            self.finished = True  # Keep serving the last schedules.

    def next_schedule(self) -> list[FrequencySchedule]:
        """The schedules to run now, one per rank (sorted by rank).

        Raises:
            SchedulerError: The generator stopped before yielding any schedule.
        """
        if self._next_schedule is None:
            try:
                self._next_schedule = next(self._generator)
            except StopIteration:
                raise SchedulerError(
                    f"{type(self).__name__} stopped before producing any schedule"
                ) from None
        return self._next_schedule

    def progress(self) -> tuple[int, int] | None:
        """(rounds done, rounds planned) while profiling; None when not known or not profiling."""
        return None

    def reprofile(self) -> bool:
        """Profile again from the next results on, if this scheduler can; whether it will.

        The coordinator asks it of a job whose profile a power budget's caps throttled
        (`coordinator.budget.capped_profiles`). None can by default.
        """
        return False

    def take_files(self) -> list[FileOut]:
        """The files produced since the last call, oldest first (and forget them)."""
        files, self._files = self._files, []
        return files

    def _give_file(self, path: str, content: str, what: str) -> None:
        """Hand a produced file over (`take_files`)."""
        self._files.append(FileOut(path, content, what))

    @abc.abstractmethod
    def _run(self) -> ScheduleGenerator:
        """Yield schedules (one per rank) and receive their profiling results."""
