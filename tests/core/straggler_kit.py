"""A two-stage pipeline job on a scheduler that keeps watching while it serves (`Watching`:
one profiling round at 900 MHz, then `FRONTIER[0]`), and a trainer feeding every rank's
iterations, for the straggler and kept-memory tests."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.messages import Measurement

CLOCKS = [1500, 1200, 1000, 900]
STAGES = 2
ORDERS = {0: ["forward", "forward", "backward", "backward"],
          1: ["forward", "backward", "forward", "backward"]}


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[tuple[tuple[str, int], ...], ...]


def plan(clock: int) -> tuple:
    return tuple(tuple((n, clock) for n in ORDERS[s]) for s in range(STAGES))


FRONTIER = [Point(1.0, 100.0, plan(1500)), Point(1.2, 90.0, plan(1200)),
            Point(1.5, 80.0, plan(1000)), Point(2.0, 75.0, plan(900))]


class Watching(FrequencyScheduler):
    """One profiling round at 900 MHz, then serves FRONTIER[0] and keeps taking results."""

    frontier: list[Point] | None = None
    chosen: Point | None = None
    serving = False
    seen: int = 0
    new_plan: Point | None = None

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield [FrequencySchedule(rank=i.rank, frequencies=[(n, 900) for n in i.instructions or []])
               for i in self.rank_infos]
        self.frontier, self.chosen, self.serving = FRONTIER, FRONTIER[0], True
        while True:
            if self.new_plan is not None:
                self.chosen, self.new_plan = self.new_plan, None
            yield [FrequencySchedule(rank=i.rank, frequencies=list(self.chosen.plan[i.pp_rank]))
                   for i in self.rank_infos]
            self.seen += 1


class NoFrontier(FrequencyScheduler):
    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield [FrequencySchedule(rank=i.rank, frequencies=[(n, 1500) for n in i.instructions or []])
               for i in self.rank_infos]


def make_job(dp: int = 2, scheduler: type[FrequencyScheduler] = Watching,
             **kw: Any) -> PipelineJob:
    info = JobInfo(pp_degree=STAGES, dp_degree=dp, tp_degree=1, world_size=STAGES * dp)
    ranks = [RankInfo(rank=s * dp + d, dp_rank=d, pp_rank=s, tp_rank=0,
                      available_frequencies=CLOCKS) for s in range(STAGES) for d in range(dp)]
    kw.setdefault("straggler_window", 3)
    return PipelineJob("job", info, ranks, lambda ji, ri: scheduler(ji, ri, None),
                       scheduler_name=scheduler.__name__, profiling_iterations=1, **kw)


class Trainer:
    """Feeds every rank's iterations; each pipeline's own span per step, all waiting for the
    slowest at the all-reduce (so every step measurement lasts the same)."""

    def __init__(self, job: PipelineJob) -> None:
        self.job = job
        self.step = 0

    def iterate(self, spans: dict[int, float] | None = None, n: int = 1) -> list:
        job = self.job
        actions: list = []
        for _ in range(n):
            spans_ = spans or {}
            wall = max([*spans_.values(), 1.0]) + 0.05
            for rank, info in sorted(job.rank_infos.items()):
                span = spans_.get(info.dp_rank, 1.0)
                start = 10**12 + self.step * 10**10
                order = ORDERS[info.pp_rank]
                for i, name in enumerate(order):
                    t1 = start + int(span * 1e9 * (i + 1) / len(order))
                    actions += job.on_measurement(rank, Measurement(
                        kind="instruction", name=name, epoch=0, step=self.step, index=i,
                        t0_ns=t1 - 1000, t1_ns=t1, time_s=1e-6, energy_j=1.0,
                        schedule=job.version), 0.0)
                actions += job.on_measurement(rank, Measurement(
                    kind="step", name="", epoch=0, step=self.step, index=0, t0_ns=start,
                    t1_ns=start + int(wall * 1e9), time_s=wall, energy_j=10.0,
                    schedule=job.version), 0.0)
            self.step += 1
        return actions
