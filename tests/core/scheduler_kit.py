"""A small frequency scheduler for the scheduler registry's tests (`test_pfo_settings`), also
imported by a module those tests generate (a scheduler defined elsewhere, registered later)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.pipeline.schedulers import FrequencyScheduler, ScheduleGenerator
from zeus_agent.models import FrequencySchedule, JobInfo, RankInfo


class Constant(FrequencyScheduler):
    """Every rank at `frequency` for its forward instructions, once."""

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        pfo_settings: Any,
        frequency: int,
        warmup_iters: int = 2,
    ) -> None:
        self.frequency = frequency
        super().__init__(job_info, rank_infos, pfo_settings)

    def _run(self) -> ScheduleGenerator:
        yield [
            FrequencySchedule(rank=i.rank, frequencies=[("forward", self.frequency)])
            for i in self.rank_infos
        ]
