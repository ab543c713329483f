"""`FrequencyScheduler` and `make_3d_parallel`: the pipeline frequency optimizer's framework.

Sans-I/O, with Zeus 0.16's semantics:

* A scheduler is built from the job's `JobInfo`, its `RankInfo`s (sorted by rank here) and the
  server settings. Its generator `_run` yields one `FrequencySchedule` per rank (a list, by rank)
  and receives, at each `send`, one `ProfilingResult` per rank for the schedules it yielded.
* `next_schedule()` returns the current schedules (starting the generator the first time);
  `observe(results)` sends the results in and moves to the next schedules. A generator that has
  finished keeps serving its last schedules (`finished` becomes True).
* `make_3d_parallel(cls)` plans per pipeline stage: the wrapped scheduler sees a pipeline-only
  job (dp = tp = 1, world size = pp) with one `RankInfo` per stage (rank = pp_rank, taken from
  the stage's dp_rank = tp_rank = 0 rank; Zeus 0.16 builds that list and then passes the
  original one: fixed here). A stage's results are aggregated (max of times, sum of energies,
  per iteration and per instruction) and its schedule is given to every DP/TP rank of the stage.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

__all__ = ["FrequencyScheduler", "SchedulerError", "make_3d_parallel"]

ScheduleGenerator = Generator[list[FrequencySchedule], list[ProfilingResult], None]


class SchedulerError(ValueError):
    """A scheduler cannot run for this job (bad plan, wrong shape, bad results)."""


class FrequencyScheduler(abc.ABC):
    """Produces per-rank frequency schedules and learns from their profiling results."""

    def __init__(
        self, job_info: JobInfo, rank_infos: Sequence[RankInfo], pfo_settings: Any
    ) -> None:
        self.job_info = job_info
        self.rank_infos = sorted(rank_infos, key=lambda info: info.rank)
        self.world_size = job_info.world_size
        self.pfo_settings = pfo_settings
        self._generator: ScheduleGenerator = self._run()
        self._next_schedule: list[FrequencySchedule] | None = None
        self.finished = False
        """True once `_run` has returned: the last schedules are served from then on."""

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

    @abc.abstractmethod
    def _run(self) -> ScheduleGenerator:
        """Yield schedules (one per rank) and receive their profiling results."""


S = TypeVar("S", bound=FrequencyScheduler)


def _aggregate(pp_rank: int, results: Sequence[ProfilingResult]) -> ProfilingResult:
    """One stage's result from its ranks': max of times, sum of energies."""

    def combine(values: Sequence[Sequence[float]], how: Any) -> list[float]:
        return [how(column) for column in zip(*values, strict=False)]

    names = results[0].time_breakdown.keys() if results else ()
    return ProfilingResult(
        rank=pp_rank,
        iter_time=combine([r.iter_time for r in results], max),
        iter_energy=combine([r.iter_energy for r in results], sum),
        time_breakdown={
            name: [combine(per_iter, max)
                   for per_iter in zip(*(r.time_breakdown.get(name, []) for r in results),
                                       strict=False)]
            for name in names
        },
        energy_breakdown={
            name: [combine(per_iter, sum)
                   for per_iter in zip(*(r.energy_breakdown.get(name, []) for r in results),
                                       strict=False)]
            for name in (results[0].energy_breakdown.keys() if results else ())
        },
    )


def make_3d_parallel(sched_cls: type[S], name: str | None = None) -> type[S]:
    """Wrap a scheduler so it plans per pipeline stage of a DP x PP x TP job."""

    class Wrapper(sched_cls):  # type: ignore[valid-type,misc]
        def __init__(
            self,
            job_info: JobInfo,
            rank_infos: Sequence[RankInfo],
            pfo_settings: Any,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            self._orig_job_info = job_info
            self._orig_rank_infos = sorted(rank_infos, key=lambda info: info.rank)
            pp = job_info.pp_degree
            pp_job_info = job_info.model_copy(
                update={"dp_degree": 1, "tp_degree": 1, "world_size": pp}
            )
            stage_infos: list[RankInfo] = []
            for stage in range(pp):
                first = next((i for i in self._orig_rank_infos if i.pp_rank == stage
                              and i.dp_rank == 0 and i.tp_rank == 0), None)
                if first is None:
                    raise SchedulerError(
                        f"no rank with pp_rank={stage}, dp_rank=0, tp_rank=0: every stage needs "
                        "one to plan for it"
                    )
                stage_infos.append(first.model_copy(update={"rank": stage}))
            super().__init__(pp_job_info, stage_infos, pfo_settings, *args, **kwargs)

        def next_schedule(self) -> list[FrequencySchedule]:
            stage_schedules = super().next_schedule()
            if len(stage_schedules) != self._orig_job_info.pp_degree:
                raise SchedulerError(
                    f"{type(self).__name__} produced {len(stage_schedules)} stage schedules for "
                    f"{self._orig_job_info.pp_degree} stages"
                )
            return [
                FrequencySchedule(rank=info.rank,
                                  frequencies=list(stage_schedules[info.pp_rank].frequencies))
                for info in self._orig_rank_infos
            ]

        def observe(self, profiling_results: list[ProfilingResult]) -> None:
            by_rank = {r.rank: r for r in profiling_results}
            stage_results = [
                _aggregate(stage, [by_rank[i.rank] for i in self._orig_rank_infos
                                   if i.pp_rank == stage and i.rank in by_rank])
                for stage in range(self._orig_job_info.pp_degree)
            ]
            super().observe(stage_results)

    Wrapper.__name__ = Wrapper.__qualname__ = name or f"{sched_cls.__name__}3D"
    Wrapper.__doc__ = f"{sched_cls.__name__}, planned per pipeline stage (`make_3d_parallel`)."
    # The wrapper forwards its arguments: show the wrapped constructor's, so that checking
    # scheduler args with `inspect.signature(cls).bind(...)` sees the real parameters.
    Wrapper.__signature__ = inspect.signature(sched_cls)
    return Wrapper
