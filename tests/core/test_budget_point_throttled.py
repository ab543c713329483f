"""A Perseus job whose own point is its slowest, told a throttled option of a budget.

A throttled option (a negative key) runs the slowest point under a node cap below its power.
When the job chose its slowest point itself (a frontier of one point, or a short one), the
point served is its own, but the GPUs are throttled by the cap: its iteration times are not
the plan's, so the scheduler must get no results meanwhile (its drift watch would see the
cap's slowdown as drift and profile again under the cap), as for any budget's point.
"""

from __future__ import annotations

from collections.abc import Generator

from coordinator.pipeline import budget_point
from coordinator.pipeline.schedulers.base import FrequencySchedule, ProfilingResult
from tests.core.straggler_kit import FRONTIER, Trainer, Watching, make_job


class SlowestChosen(Watching):
    """Serves the slowest point of FRONTIER as its own choice."""

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield [FrequencySchedule(rank=i.rank, frequencies=[(n, 900) for n in i.instructions or []])
               for i in self.rank_infos]
        self.frontier, self.chosen, self.serving = FRONTIER, FRONTIER[-1], True
        while True:
            yield [FrequencySchedule(rank=i.rank, frequencies=list(self.chosen.plan[i.pp_rank]))
                   for i in self.rank_infos]
            self.seen += 1


def test_a_throttled_option_on_its_own_slowest_point_holds_the_schedulers_results() -> None:
    job = make_job(2, scheduler=SlowestChosen)
    trainer = Trainer(job)
    trainer.iterate(n=3)
    view = budget_point.frontier_of(job)
    assert view is not None and view.chosen == len(FRONTIER) - 1
    budget_point.serve(job, (-10, 10.0))  # Under its slowest point: throttled by a 10 W cap.
    assert job.straggling.holding()
    scheduler = job.scheduler
    assert isinstance(scheduler, SlowestChosen)
    before = scheduler.seen
    trainer.iterate({0: 3.0, 1: 3.0}, n=4)  # Throttled: slower than its plan.
    assert scheduler.seen == before  # No results while the cap throttles its own point.
    budget_point.serve(job, None)  # Lifted: its times are the plan's again.
    assert not job.straggling.holding()
    trainer.iterate(n=2)
    assert scheduler.seen > before
