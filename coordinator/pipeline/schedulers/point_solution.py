"""`PointSolution`: run one precomputed frequency plan (Zeus 0.16's `PointSolution`).

The plan is read from the file named by `solution_path` when the scheduler is built (Zeus
0.16's constructor takes the path): `coordinator.pipeline.schedulers.plan_file` reads and
parses it (never executing it); everything else here is pure.

A clock the rank's GPU does not list (a plan made on another GPU model) runs at the nearest one it
does, a tie going to the higher clock (never slower than planned where a choice exists); one
warning per plan names every substitution.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from typing import Any

from coordinator.pipeline.schedulers.base import (
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
)
from coordinator.pipeline.schedulers.parallel3d import make_3d_parallel
from coordinator.pipeline.schedulers.plan_file import Clock, load_plan
from zeus_agent.models import FrequencySchedule, JobInfo, RankInfo

__all__ = ["PointSolution", "PointSolution3D", "nearest_clock"]

logger = logging.getLogger(__name__)


def nearest_clock(clock: Clock, offered: Sequence[int]) -> int:
    """The clock of `offered` (sorted ascending) nearest `clock`; a tie goes to the higher one.

    With nothing offered (the GPU did not say), a whole clock is kept and another is rounded
    half up (at least 1 MHz).
    """
    if not offered:
        return int(clock) if isinstance(clock, int) else max(1, math.floor(clock + 0.5))
    i = bisect.bisect_left(offered, clock)
    if i == len(offered):
        return offered[-1]
    if i == 0 or offered[i] == clock:
        return offered[i]
    lower, higher = offered[i - 1], offered[i]
    return lower if clock - lower < higher - clock else higher


class PointSolution(FrequencyScheduler):
    """Run one precomputed frequency plan (Zeus 0.16's `PointSolution`).

    The plan (see `load_plan`) is read when the scheduler is built and must hold one row per
    rank of the job it plans for (with `PointSolution3D`, one per pipeline stage). A clock a
    rank's GPU does not list runs at the nearest one it does (`nearest_clock`), logged once per
    plan; when the rank's instruction order is known (`RankInfo.instructions`), a row's names
    must match it. The plan is yielded once and then served for as long as the job runs.

    Attributes:
        rank_rows: Rank -> the (instruction, MHz) pairs it runs, clocks mapped to its GPU's.
        substitutions: (row, rank, planned clock, clock run, entries) for each clock replaced.
    """

    @classmethod
    def check_args(cls, **scheduler_args: Any) -> None:
        """Read and check the plan when the coordinator starts (raises `SchedulerError`)."""
        load_plan(scheduler_args["solution_path"])

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        pfo_settings: Any,
        solution_path: str,
    ) -> None:
        """Load the plan at `solution_path` and fit it to the job's ranks.

        Raises:
            SchedulerError: The plan cannot be loaded or does not fit the job.
        """
        self.solution_path = str(solution_path)
        self.plan = load_plan(self.solution_path)
        self.rank_rows: dict[int, list[tuple[str, int]]] = {}
        self.substitutions: list[tuple[int, int, Clock, int, int]] = []
        super().__init__(job_info, rank_infos, pfo_settings)
        self._check_plan()

    def _check_plan(self) -> None:
        # The 3D wrapper (make_3d_parallel) keeps the job's own rank infos: every rank of a stage
        # runs the stage's row, so all of them are checked.
        orig_infos = self.job_rank_infos
        per_stage = orig_infos is not None
        unit = "pipeline stage" if per_stage else "rank"
        source = self.solution_path
        if len(self.plan) != self.world_size:
            raise SchedulerError(
                f"{type(self).__name__}: plan file {source} has {len(self.plan)} rows but "
                f"{self.world_size} are needed, one per {unit}"
                + (" (pp_degree)" if per_stage else " (world size)")
            )
        ranks = [info.rank for info in self.rank_infos]
        if ranks != list(range(self.world_size)):
            raise SchedulerError(
                f"{type(self).__name__} needs one RankInfo per {unit} numbered 0 to "
                f"{self.world_size - 1}, got {ranks}"
            )
        self._rows: list[list[tuple[str, int]]] = []
        for index, row in enumerate(self.plan):
            if orig_infos is not None:
                checked = [info for info in orig_infos if info.pp_rank == index]
            else:
                checked = [self.rank_infos[index]]
            for info in checked:
                self._check_row(index, row, info, unit)
                self.rank_rows[info.rank] = self._fit_row(index, row, info)
            # The row the (wrapped) scheduler yields: its dp_rank = tp_rank = 0 rank's.
            first = next((i for i in checked if i.dp_rank == 0 and i.tp_rank == 0), checked[0])
            self._rows.append(self.rank_rows[first.rank])
        if self.substitutions:
            logger.warning("%s", self.substitution_warning())

    def _fit_row(
        self, index: int, row: list[tuple[str, Clock]], info: RankInfo
    ) -> list[tuple[str, int]]:
        """`row` with each clock the rank's GPU offers or the nearest one (noted)."""
        offered = sorted(set(info.available_frequencies))
        fitted: list[tuple[str, int]] = []
        count: dict[tuple[Clock, int], int] = {}
        mapped: dict[Clock, int] = {}
        for name, clock in row:
            run = mapped.get(clock)
            if run is None:
                run = mapped[clock] = nearest_clock(clock, offered)
            if run != clock:
                count[(clock, run)] = count.get((clock, run), 0) + 1
            fitted.append((name, run))
        self.substitutions += [(index, info.rank, clock, run, n)
                               for (clock, run), n in count.items()]
        return fitted

    def substitution_warning(self) -> str:
        """One line naming every clock of the plan replaced, per row (ranks, clocks, entries)."""
        unit = "stage" if self.job_rank_infos is not None else "rank"
        grouped: dict[tuple[int, Clock, int], list[tuple[int, int]]] = {}
        for index, rank, clock, run, n in self.substitutions:
            grouped.setdefault((index, clock, run), []).append((rank, n))
        parts = []
        for (index, clock, run), who in sorted(grouped.items(), key=lambda kv: kv[0]):
            ranks = ", ".join(str(rank) for rank, _ in who)
            where = (f"stage {index} (rank{'s' if len(who) > 1 else ''} {ranks})"
                     if unit == "stage" else f"rank {index}")
            entries = who[0][1]
            parts.append(f"{where}: {clock} -> {run} MHz ({entries} "
                         f"entr{'ies' if entries > 1 else 'y'})")
        return (f"{type(self).__name__} (job {self.job_info.job_id or '?'}): plan file "
                f"{self.solution_path} asks for clocks the GPUs do not offer; running the "
                f"nearest offered (a tie goes to the higher clock; rounded where a GPU lists "
                f"none): {'; '.join(parts)}")

    def _check_row(
        self, index: int, row: list[tuple[str, Clock]], info: RankInfo, unit: str
    ) -> None:
        who = f"{unit} {index}" + (f" (rank {info.rank})" if unit != "rank" else "")
        where = f"{type(self).__name__}: plan file {self.solution_path}, row {index} for {who}"
        if info.instructions is not None:
            names = [name for name, _ in row]
            if names != info.instructions:
                mismatch = next(
                    (
                        j
                        for j, (a, b) in enumerate(zip(names, info.instructions, strict=False))
                        if a != b
                    ),
                    min(len(names), len(info.instructions)),
                )
                planned = names[mismatch] if mismatch < len(names) else "nothing"
                run = (
                    info.instructions[mismatch] if mismatch < len(info.instructions) else "nothing"
                )
                raise SchedulerError(
                    f"{where}: the instructions do not match the order the rank runs: entry "
                    f"{mismatch} plans {planned!r} where the rank runs {run!r} (the plan has "
                    f"{len(names)} instructions, the rank runs {len(info.instructions)})"
                )

    def _run(self) -> ScheduleGenerator:
        """Yield the plan once; the framework keeps serving it afterwards."""
        yield [
            FrequencySchedule(rank=info.rank, frequencies=list(row))
            for info, row in zip(self.rank_infos, self._rows, strict=True)
        ]


class PointSolution3D(make_3d_parallel(PointSolution, "PointSolution3D")):  # type: ignore[misc]
    """`PointSolution` planned per pipeline stage: one plan row per stage, run by all its ranks.

    Each rank runs its stage's row with the clocks fitted to its own GPU (`rank_rows`).
    """

    def next_schedule(self) -> list[FrequencySchedule]:
        """Every rank's schedule: its stage's row, clocks fitted to its own GPU."""
        return [FrequencySchedule(rank=s.rank, frequencies=list(self.rank_rows[s.rank]))
                for s in super().next_schedule()]
