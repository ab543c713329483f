"""`StragglerHandling`: what a `PipelineJob` does about its stragglers (pure).

The measuring and the choice of frontier points are `coordinator.pipeline.stragglers`'
(`Stragglers`); this part of the job takes explicit notices (`set_straggler`), judges each
step once every rank has measured it (`track`), and installs the schedules the stragglers call
for (`apply`), or the plan being served again when none is left. A `PipelineJob` owns one
(`PipelineJob.straggling`), built with the job's `Stragglers`, the readers of the job's state it
needs and the job's `install` and `progress`; it owns the plan being served (`plan`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordinator.optimizer import Action, StatusUpdate, StragglerError
from coordinator.pipeline.phase import Phase
from coordinator.pipeline.schedulers.base import FrequencyScheduler, PlanPoint, SchedulerError
from coordinator.pipeline.steps import Step, mean_power_w
from coordinator.pipeline.stragglers import Stragglers
from zeus_agent.models import FrequencySchedule, RankInfo

__all__ = ["ITERATIONS_KEPT", "OWN_STEPS", "Install", "StragglerHandling"]

ITERATIONS_KEPT = 16
"""Iterations whose steps (one per rank) are kept for a power budget's measure of the job's
speed and draw (`step_times`, `own_times`)."""
OWN_STEPS = 3
"""Steps at its own point needed for its time and draw there (`own_step_s`, `own_draw_w`)."""

Install = Callable[[list[FrequencySchedule], str, str], list[Action]]
"""Installs schedules as the job's next version: (schedules, state, message) -> actions
(`PipelineJob._install`)."""


class StragglerHandling:
    """Straggler notices and detection of a `PipelineJob` (see the module docstring).

    Attributes:
        stragglers: What is known of the job's stragglers (the job's `Stragglers`).
        plan: The scheduler's schedules while the job serves a plan (the chosen one), by rank,
            before straggler changes; empty otherwise (`serve`, `forget_plan`).
    """

    def __init__(
        self,
        stragglers: Stragglers,
        *,
        scheduler_name: str,
        phase: Callable[[], Phase],
        error: Callable[[], str | None],
        scheduler: Callable[[], FrequencyScheduler | None],
        rank_infos: Callable[[], Mapping[int, RankInfo]],
        orders: Callable[[], Mapping[int, list[str]]],
        installed: Callable[[], Mapping[int, FrequencySchedule]],
        install: Install,
        progress: Callable[[], dict[str, Any]],
    ) -> None:
        """Create it with no plan served.

        Args:
            stragglers: The job's `Stragglers` (notices, detection, frontier points).
            scheduler_name: The scheduler's name, in status messages.
            phase: The job's phase now.
            error: Why the job stopped (None while it runs).
            scheduler: The job's scheduler now (None before the ranks' orders are known).
            rank_infos: The job's ranks now (with their instruction orders once discovered).
            orders: Each rank's instruction names, in order, as discovered.
            installed: The schedules installed last, by rank.
            install: Installs schedules as the job's next version.
            progress: The job's progress (`PipelineJob.progress`), for status updates.
        """
        self.stragglers = stragglers
        self.plan: dict[int, FrequencySchedule] = {}
        self.budget: PlanPoint | None = None
        """The frontier point a power budget has the job serve instead of the chosen one
        (`coordinator.pipeline.budget_point`); None: the job's own choice."""
        self.governed = False
        """A power budget caps the job's GPUs, even at its own point: its times are the cap's
        too (the tightener lowers caps under a plan's peak), so the scheduler gets none."""
        self.step_times: deque[tuple[int, float, float | None]] = deque()
        """(sequence number, seconds, joules) of the last steps the ranks measured while serving
        a plan of a frontier, whatever the point: how fast the job runs under a budget's caps
        and what it draws (the budget loop compares them with the plan's model,
        `coordinator.budget.timing`)."""
        self.steps_timed = 0
        """Steps recorded in `step_times` so far (the last one's sequence number)."""
        self.own_times: deque[tuple[float, float | None]] = deque()
        """(seconds, joules) of the last steps at the job's own point, nothing holding it."""
        self._scheduler_name = scheduler_name
        self._phase = phase
        self._error = error
        self._scheduler = scheduler
        self._rank_infos = rank_infos
        self._orders = orders
        self._installed = installed
        self._install = install
        self._progress = progress

    @property
    def pipelines(self) -> list[int]:
        """The data-parallel pipelines (dp ranks)."""
        return self.stragglers.pipelines

    def serve(self, plan: Mapping[int, FrequencySchedule]) -> None:
        """The job serves `plan` (by rank) from now on; straggler changes are made to it."""
        self.plan = dict(plan)
        self.own_times.clear()  # (Its own point's steps: the new plan's from now on.)

    def forget_plan(self) -> None:
        """The job serves no plan any more: nothing of the old one is slowed or detected."""
        self.plan = {}
        self.budget = None
        self.governed = False
        self.stragglers.forget_plan()

    def own_step_s(self) -> float | None:
        """The median step time at the job's own point (None: too few steps there).

        Too few: under `OWN_STEPS` iterations' steps.
        """
        if len(self.own_times) < OWN_STEPS * self._ranks():
            return None
        return statistics.median(t for t, _ in self.own_times)

    def own_draw_w(self) -> float | None:
        """The draw per GPU at the job's own point, from its ranks' step energies.

        None: fewer than `OWN_STEPS` iterations' steps there measured an energy.
        """
        drawn, counted = mean_power_w(self.own_times)
        return drawn if counted >= OWN_STEPS * self._ranks() else None

    def _ranks(self) -> int:
        """Ranks reporting each step (at least 1)."""
        return max(1, len(self._rank_infos()))

    def holding(self) -> bool:
        """Whether the job serves another point than its chosen one, or a budget caps it.

        A straggler's point, a budget's, or its own under a budget's caps: its times then say
        nothing of the chosen plan, so the scheduler gets no results.
        """
        return self.budget is not None or self.governed or bool(self.stragglers.factors())

    def set_budget(self, point: PlanPoint | None, governed: bool = False) -> list[Action]:
        """Serve `point` of the frontier for a power budget (None: the chosen one again).

        `governed`: a budget caps the job's GPUs (always so with a `point`).
        """
        self.governed = governed or point is not None
        if point is self.budget:
            return []
        self.budget = point
        return self.apply()

    def set_straggler(self, dp_index: int, factor: float | None) -> list[Action]:
        """Take an explicit straggler notice: pipeline `dp_index` runs `factor` times slower.

        `factor` None clears the notice (what is measured counts again for that pipeline).

        Raises:
            StragglerError: No such pipeline (code "out_of_range"), a factor not in
                [1, `MAX_STRAGGLER_FACTOR`] ("bad_request"), or the job has stopped
                ("conflict").
        """
        self.stragglers.check_notice(dp_index, factor)
        if self._phase().final:
            raise StragglerError(
                "conflict", f"the job's pipeline optimiser has stopped ({self._error()})")
        self.stragglers.notice(dp_index, factor)
        actions = self.apply()
        if not actions:
            what = (f"pipeline {dp_index} noted as a straggler ({factor:g}x)"
                    if factor is not None else f"straggler notice of pipeline {dp_index} cleared")
            actions = [StatusUpdate("straggler", f"{what}; {self._why_unchanged()}",
                                    self._progress())]
        return actions

    def _frontier(self) -> tuple[Sequence[PlanPoint], PlanPoint] | None:
        """(frontier, chosen point) while serving a plan of a scheduler that has them."""
        scheduler = self._scheduler()
        if scheduler is None or self._phase() is not Phase.SERVING or not self.plan:
            return None
        frontier, chosen = scheduler.frontier, scheduler.chosen
        if not frontier or chosen is None:
            return None
        return frontier, chosen

    def track(self, rank: int, step_number: int, step: Step) -> list[Action]:
        """Record rank's own iteration time for one step; judge the step once all ranks did."""
        found = self._frontier()
        if found is None:
            return []
        if step.time_s is not None and step.time_s > 0:
            self.steps_timed += 1
            kept = ITERATIONS_KEPT * self._ranks()
            self.step_times.append((self.steps_timed, step.time_s, step.energy_j))
            while len(self.step_times) > kept:
                self.step_times.popleft()
            if not self.holding():
                self.own_times.append((step.time_s, step.energy_j))
                while len(self.own_times) > kept:
                    self.own_times.popleft()
        if len(self.pipelines) < 2:
            return []
        span = step.own_time()
        if span is None:
            return []
        if self.stragglers.track(rank, step_number, span, len(self._rank_infos()), found[1]):
            return self.apply()
        return []

    def apply(self, force: bool = False) -> list[Action]:
        """Install the schedules the stragglers call for, if they differ from the current ones.

        `force`: install anyway (a new plan is being served).
        """
        found = self._frontier()
        if found is None:
            if force and self.plan:  # A plan without a frontier: serve it as it is.
                return self._install(list(self.plan.values()), "serving",
                                     f"serving the plan of {self._scheduler_name}")
            return []
        frontier, chosen = found
        served = chosen if self.budget is None else self.budget
        points = self.stragglers.plan_points(frontier, served)
        if self.budget is not None:  # Every pipeline at the budget's point or slower.
            points = {d: points.get(d, self.budget) for d in self.pipelines}
        try:
            schedules = self.stragglers.schedules(points, self._rank_infos(), self._orders(),
                                                  self.plan)
        except (SchedulerError, IndexError) as e:
            problem: list[Action] = [StatusUpdate(
                "straggler", f"cannot slow the other pipelines down: {e}", self._progress())]
            if not force:
                return problem
            self.stragglers.slow({})
            return problem + self._install(list(self.plan.values()), "serving",
                                           f"serving the plan of {self._scheduler_name}")
        current = {r: s.frequencies for r, s in self._installed().items()}
        if not force and {r: s.frequencies for r, s in schedules.items()} == current:
            self.stragglers.slow(points)
            return []
        self.stragglers.slow(points)
        plan = (f"the plan of {float(chosen.time):.4g} s, {float(chosen.energy):.4g} J per "
                "iteration")
        if self.budget is not None and not self.stragglers.factors():
            return self._install(list(schedules.values()), "serving", (
                f"serving the frontier point of {float(served.time):.4g} s, "
                f"{float(served.energy):.4g} J per iteration under a power budget ({plan} "
                "when it lifts)"))
        if not points:
            return self._install(list(schedules.values()), "serving",
                                 f"serving {plan}" if force or not self.stragglers.factors()
                                 else f"serving {plan} (no other pipeline to slow down)")
        return self._install(list(schedules.values()), "straggler",
                             self.stragglers.describe(points, served))

    def _why_unchanged(self) -> str:
        phase, scheduler = self._phase(), self._scheduler()
        if phase is not Phase.SERVING:
            return f"applied once a plan is served (the job is {phase})"
        if scheduler is None or scheduler.frontier is None:
            return (f"the scheduler {self._scheduler_name} has no time-energy frontier to slow "
                    "the other pipelines down with")
        if len(self.pipelines) < 2:
            return "the job has no other pipeline to slow down"
        return "the schedules stay as they are"
