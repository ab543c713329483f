"""`StragglerHandling`: what a `PipelineJob` does about its stragglers (a mixin, pure).

The measuring and the choice of frontier points are `coordinator.pipeline.stragglers`'
(`Stragglers`); this part of the job takes explicit notices (`set_straggler`), judges each
step once every rank has measured it (`_track`), and installs the schedules the stragglers call
for (`_apply_stragglers`), or the chosen plan again when none is left. It is a mixin so that
`job.py` stays one screenful per responsibility; it reads the job's state declared below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.optimizer import Action, StatusUpdate, StragglerError
from coordinator.pipeline.phase import Phase
from coordinator.pipeline.schedulers.base import FrequencyScheduler, PlanPoint, SchedulerError
from coordinator.pipeline.steps import Step
from coordinator.pipeline.stragglers import Stragglers
from zeus_agent.models import FrequencySchedule, RankInfo

__all__ = ["StragglerHandling"]


class StragglerHandling:
    """Straggler notices and detection of a `PipelineJob` (see the module docstring)."""

    # The job's state this part reads (set by `PipelineJob.__init__`).
    phase: Phase
    error: str | None
    scheduler: FrequencyScheduler | None
    scheduler_name: str
    stragglers: Stragglers
    rank_infos: dict[int, RankInfo]
    orders: dict[int, list[str]]
    schedules: dict[int, FrequencySchedule]
    _base: dict[int, FrequencySchedule]
    _steps: dict[int, dict[int, Step]]

    @property
    def pipelines(self) -> list[int]:
        """The data-parallel pipelines (dp ranks)."""
        return self.stragglers.pipelines

    @property
    def notices(self) -> dict[int, float]:
        """Pipeline -> straggler factor given by a notice (`set_straggler`)."""
        return self.stragglers.notices

    @property
    def detected(self) -> dict[int, float]:
        """Pipeline -> straggler factor measured."""
        return self.stragglers.detected

    def progress(self) -> dict[str, Any]:
        """The job's progress (`PipelineJob.progress`)."""
        raise NotImplementedError

    def _install(self, schedules: list[FrequencySchedule], state: str = "profiling",
                 message: str = "") -> list[Action]:  # (The job's.)
        raise NotImplementedError

    def _saving(self, actions: list[Action], always: bool = False) -> list[Action]:
        raise NotImplementedError  # (The job's.)

    def set_straggler(self, dp_index: int, factor: float | None) -> list[Action]:
        """Take an explicit straggler notice: pipeline `dp_index` runs `factor` times slower.

        `factor` None clears the notice (what is measured counts again for that pipeline).

        Raises:
            StragglerError: No such pipeline (code "out_of_range"), a factor not in
                [1, `MAX_STRAGGLER_FACTOR`] ("bad_request"), or the job has stopped
                ("conflict").
        """
        self.stragglers.check_notice(dp_index, factor)
        if self.phase.final:
            raise StragglerError(
                "conflict", f"the job's pipeline optimiser has stopped ({self.error})")
        if factor is None:
            self.notices.pop(dp_index, None)
        else:
            self.notices[dp_index] = float(factor)
        actions = self._apply_stragglers()
        if not actions:
            what = (f"pipeline {dp_index} noted as a straggler ({factor:g}x)"
                    if factor is not None else f"straggler notice of pipeline {dp_index} cleared")
            actions = [StatusUpdate("straggler", f"{what}; {self._why_unchanged()}",
                                    self.progress())]
        return self._saving(actions, always=True)

    def _frontier(self) -> tuple[Sequence[PlanPoint], PlanPoint] | None:
        """(frontier, chosen point) while serving a plan of a scheduler that has them."""
        scheduler = self.scheduler
        if scheduler is None or self.phase is not Phase.SERVING or not self._base:
            return None
        frontier, chosen = scheduler.frontier, scheduler.chosen
        if not frontier or chosen is None:
            return None
        return frontier, chosen

    def _track(self, rank: int, step_number: int) -> list[Action]:
        """Record rank's own iteration time for one step; judge the step once all ranks did."""
        found = self._frontier()
        if len(self.pipelines) < 2 or found is None:
            return []
        step = self._steps[rank].get(step_number)
        span = step.own_time() if step is not None else None
        if span is None:
            return []
        if self.stragglers.track(rank, step_number, span, len(self.rank_infos), found[1]):
            return self._apply_stragglers()
        return []

    def _apply_stragglers(self, force: bool = False) -> list[Action]:
        """Install the schedules the stragglers call for, if they differ from the current ones.

        `force`: install anyway (a new plan is being served).
        """
        found = self._frontier()
        if found is None:
            if force and self._base:  # A plan without a frontier: serve it as it is.
                return self._install(list(self._base.values()), "serving",
                                     f"serving the plan of {self.scheduler_name}")
            return []
        frontier, chosen = found
        points = self.stragglers.plan_points(frontier, chosen)
        try:
            schedules = self.stragglers.schedules(points, self.rank_infos, self.orders,
                                                  self._base)
        except (SchedulerError, IndexError) as e:
            problem: list[Action] = [StatusUpdate(
                "straggler", f"cannot slow the other pipelines down: {e}", self.progress())]
            if not force:
                return problem
            self.stragglers.points = {}
            return problem + self._install(list(self._base.values()), "serving",
                                           f"serving the plan of {self.scheduler_name}")
        current = {r: s.frequencies for r, s in self.schedules.items()}
        if not force and {r: s.frequencies for r, s in schedules.items()} == current:
            self.stragglers.points = points
            return []
        self.stragglers.points = points
        plan = (f"the plan of {float(chosen.time):.4g} s, {float(chosen.energy):.4g} J per "
                "iteration")
        if not points:
            return self._install(list(schedules.values()), "serving",
                                 f"serving {plan}" if force or not self.stragglers.factors()
                                 else f"serving {plan} (no other pipeline to slow down)")
        return self._install(list(schedules.values()), "straggler",
                             self.stragglers.describe(points, chosen))

    def _why_unchanged(self) -> str:
        if self.phase is not Phase.SERVING:
            return f"applied once a plan is served (the job is {self.phase})"
        if self.scheduler is None or self.scheduler.frontier is None:
            return (f"the scheduler {self.scheduler_name} has no time-energy frontier to slow "
                    "the other pipelines down with")
        if len(self.pipelines) < 2:
            return "the job has no other pipeline to slow down"
        return "the schedules stay as they are"
