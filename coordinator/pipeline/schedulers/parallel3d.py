"""`make_3d_parallel`: plan per pipeline stage of a DP x PP x TP job. Pure.

`make_3d_parallel(cls)` wraps a scheduler so that it plans per pipeline stage: the wrapped
scheduler sees a pipeline-only job (dp = tp = 1, world size = pp) with one `RankInfo` per stage
(rank = pp_rank, taken from the stage's dp_rank = tp_rank = 0 rank; Zeus 0.16 builds that list
and then passes the original one: fixed here). A stage's results are aggregated (max of times,
sum of energies, per iteration and per instruction) and its schedule is given to every DP/TP
rank of the stage. The job's own ranks are kept as `job_rank_infos`.

Broken input raises a `SchedulerError` naming the rank or stage: a rank list that is not
exactly 0..world_size-1 at distinct grid positions, and results that are not one per rank with
the same breakdown keys across a stage (Zeus 0.16 serves the former and fails on the latter
with a bare KeyError/IndexError, or aggregates silently).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

from coordinator.pipeline.schedulers.base import FrequencyScheduler, SchedulerError
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

__all__ = ["make_3d_parallel"]

S = TypeVar("S", bound=FrequencyScheduler)


def _aggregate(pp_rank: int, results: Sequence[ProfilingResult]) -> ProfilingResult:
    """One stage's result from its ranks' (same breakdown keys): max of times, sum of energies."""

    def combine(values: Sequence[Sequence[float]], how: Any) -> list[float]:
        return [how(column) for column in zip(*values, strict=False)]

    def breakdown(kind: str, how: Any) -> dict[str, list[list[float]]]:
        return {
            key: [combine(per_iter, how)
                  for per_iter in zip(*(getattr(r, kind)[key] for r in results), strict=False)]
            for key in getattr(results[0], kind)
        }

    return ProfilingResult(
        rank=pp_rank,
        iter_time=combine([r.iter_time for r in results], max),
        iter_energy=combine([r.iter_energy for r in results], sum),
        time_breakdown=breakdown("time_breakdown", max),
        energy_breakdown=breakdown("energy_breakdown", sum),
    )


def _listed(values: Sequence[int], limit: int = 8) -> str:
    """'1, 2, 3' (at most `limit` shown, then how many more)."""
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")


def _checked_grid(name: str, job_info: JobInfo, rank_infos: Sequence[RankInfo]) -> list[RankInfo]:
    """The job's ranks sorted, each of 0..world_size-1 once at its own grid position.

    Zeus 0.16 serves whatever list it gets (a missing rank gets no schedule, an extra one a
    stage's); a clear error here names the rank instead.

    Raises:
        SchedulerError: A rank beyond the world size or a stage/DP/TP rank beyond its degree,
            a rank given twice, two ranks at one position, or a rank missing.
    """
    world = job_info.world_size
    degrees = {"pp_rank": job_info.pp_degree, "dp_rank": job_info.dp_degree,
               "tp_rank": job_info.tp_degree}
    infos = sorted(rank_infos, key=lambda info: info.rank)
    seen: dict[int, RankInfo] = {}
    at: dict[tuple[int, int, int], int] = {}
    for info in infos:
        if info.rank >= world:
            raise SchedulerError(f"{name}: rank {info.rank} is beyond the world size {world} "
                                 f"(ranks are 0 to {world - 1})")
        for field, degree in degrees.items():
            if getattr(info, field) >= degree:
                raise SchedulerError(
                    f"{name}: rank {info.rank} has {field}={getattr(info, field)}, beyond the "
                    f"job's {field.removesuffix('_rank')}_degree {degree} (0 to {degree - 1})")
        if info.rank in seen:
            raise SchedulerError(f"{name}: rank {info.rank} is registered twice")
        seen[info.rank] = info
        position = (info.pp_rank, info.dp_rank, info.tp_rank)
        if position in at:
            raise SchedulerError(
                f"{name}: ranks {at[position]} and {info.rank} are both at pp_rank="
                f"{position[0]}, dp_rank={position[1]}, tp_rank={position[2]} (misnumbered)")
        at[position] = info.rank
    missing = [rank for rank in range(world) if rank not in seen]
    if missing:
        empty = [p for p in itertools.product(range(job_info.pp_degree),
                                              range(job_info.dp_degree),
                                              range(job_info.tp_degree)) if p not in at]
        where = "; ".join(f"pp_rank={p}, dp_rank={d}, tp_rank={t}" for p, d, t in empty[:4])
        raise SchedulerError(
            f"{name}: rank(s) {_listed(missing)} missing (the job has {world} ranks, 0 to "
            f"{world - 1}): no rank at {where}{'; ...' if len(empty) > 4 else ''}")
    return infos


def _results_by_stage(
    name: str, stage_of: dict[int, int], pp: int, results: Sequence[ProfilingResult]
) -> list[list[ProfilingResult]]:
    """One result per rank, grouped by stage, with the same breakdown keys across a stage.

    Zeus 0.16 raises (a bare KeyError or IndexError) on an unknown rank, a stage without
    results, an empty list or a missing breakdown key; here the error names the rank or stage.
    A rank missing from a stage, or given twice, is refused too: the stage's energy sum would
    be wrong.

    Raises:
        SchedulerError: Any of the above.
    """
    if not results:
        raise SchedulerError(f"{name}: no profiling results (one per rank is needed, "
                             f"{len(stage_of)} ranks)")
    by_stage: list[list[ProfilingResult]] = [[] for _ in range(pp)]
    given: set[int] = set()
    for result in results:
        stage = stage_of.get(result.rank)
        if stage is None:
            raise SchedulerError(f"{name}: a result from rank {result.rank}, which is not a "
                                 f"rank of the job (ranks 0 to {len(stage_of) - 1})")
        if result.rank in given:
            raise SchedulerError(f"{name}: two results from rank {result.rank} (stage {stage})")
        given.add(result.rank)
        by_stage[stage].append(result)
    for stage, stage_results in enumerate(by_stage):
        ranks = sorted(rank for rank, s in stage_of.items() if s == stage)
        if not stage_results:
            raise SchedulerError(f"{name}: no result for stage {stage} (ranks {_listed(ranks)})")
        missing = [rank for rank in ranks if rank not in given]
        if missing:
            raise SchedulerError(f"{name}: no result from rank(s) {_listed(missing)} of stage "
                                 f"{stage}")
        for kind in ("time_breakdown", "energy_breakdown"):
            keys: dict[str, int] = {}
            for result in stage_results:
                for key in getattr(result, kind):
                    keys.setdefault(key, result.rank)
            for result in stage_results:
                lacking = [key for key in keys if key not in getattr(result, kind)]
                if lacking:
                    raise SchedulerError(
                        f"{name}: the result of rank {result.rank} (stage {stage}) has no "
                        f"{kind} for {lacking[0]!r}, which rank {keys[lacking[0]]}'s has")
    return by_stage


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
            self._job_ranks = _checked_grid(type(self).__name__, job_info, rank_infos)
            self.job_rank_infos = self._job_ranks
            self._stage_of = {info.rank: info.pp_rank for info in self._job_ranks}
            pp = job_info.pp_degree
            pp_job_info = job_info.model_copy(
                update={"dp_degree": 1, "tp_degree": 1, "world_size": pp}
            )
            by_position = {(i.pp_rank, i.dp_rank, i.tp_rank): i for i in self._job_ranks}
            stage_infos = [by_position[(stage, 0, 0)].model_copy(update={"rank": stage})
                           for stage in range(pp)]
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
                for info in self._job_ranks
            ]

        def observe(self, profiling_results: list[ProfilingResult]) -> None:
            """Aggregate one result per rank into one per stage (`SchedulerError` if not)."""
            by_stage = _results_by_stage(
                type(self).__name__, self._stage_of, self._orig_job_info.pp_degree,
                profiling_results)
            super().observe([_aggregate(stage, results)
                             for stage, results in enumerate(by_stage)])

    Wrapper.__name__ = Wrapper.__qualname__ = name or f"{sched_cls.__name__}3D"
    Wrapper.__doc__ = f"{sched_cls.__name__}, planned per pipeline stage (`make_3d_parallel`)."
    # The wrapper forwards its arguments: show the wrapped constructor's, so that checking
    # scheduler args with `inspect.signature(cls).bind(...)` sees the real parameters.
    Wrapper.__signature__ = inspect.signature(sched_cls)
    return Wrapper
