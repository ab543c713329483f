"""Stragglers: which data-parallel pipeline of a job runs slow, and what the others run. Pure.

Extrinsic bloat (jobs with several data-parallel pipelines, while serving a scheduler that has
a `frontier`, see `coordinator.pipeline.schedulers.perseus`). A pipeline's iteration time, per
step, is the longest over its ranks of start of the step -> end of its last instruction
(`Step.own_time`): the step time itself also holds the wait at the data-parallel all-reduce,
where every pipeline waits for the slowest one, so it cannot tell them apart (the step time is
used when the stamps are unusable). Each pipeline's time is divided by the planned time of the
frontier point it runs (so a pipeline slowed down on purpose is not taken for a straggler), and
compared with the median of the other pipelines'. A pipeline slower by more than `threshold`
for `window` consecutive iterations is a straggler, with the median ratio over that window as
its factor (re-measured every window: a change beyond the threshold is applied); it has
recovered after `window` consecutive iterations within the threshold. An explicit notice
(`notices`, e.g. from an operator who knows a node throttles) overrides what is measured for
that pipeline until cleared.

While a straggler is known, with F its factor, every other pipeline (own factor f, 1 unless
also a straggler) runs the frontier point of least energy whose planned time is <= chosen time
* F / f * (1 - `STRAGGLER_MARGIN`): never slower than the straggler; the straggler's ranks keep
the chosen plan (`plan_points`). `PipelineJob` installs the schedules of those points.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from coordinator.optimizer import StragglerError
from coordinator.pipeline.schedulers.base import PlanPoint
from coordinator.pipeline.schedulers.perseus import plan_schedule
from coordinator.pipeline.steps import MAX_OPEN_STEPS
from zeus_agent.models import FrequencySchedule, RankInfo
from zeus_agent.wire.messages import MAX_STRAGGLER_FACTOR

__all__ = ["MAX_STRAGGLER_FACTOR", "STRAGGLER_MARGIN", "StragglerError", "Stragglers"]

STRAGGLER_MARGIN = 0.02
"""Other pipelines aim this fraction under the straggler's pace (measured: exactly its pace
made the iteration 3.5% slower on the simulated nodes)."""


class Stragglers:
    """What one job knows of its stragglers (see the module docstring).

    Attributes:
        pipelines: The data-parallel pipelines (dp ranks), sorted.
        notices: Pipeline -> straggler factor given by a notice.
        detected: Pipeline -> straggler factor measured.
        points: Pipeline -> the frontier point it runs instead of the chosen one.
    """

    def __init__(self, pipeline_of: Mapping[int, int], threshold: float, window: int) -> None:
        """`pipeline_of`: rank -> its pipeline (dp rank)."""
        self.pipeline_of = dict(pipeline_of)
        self.pipelines = sorted(set(self.pipeline_of.values()))
        self.threshold = threshold
        self.window = window
        self.notices: dict[int, float] = {}
        self.detected: dict[int, float] = {}
        self.points: dict[int, PlanPoint] = {}
        self._spans: dict[int, dict[int, float]] = {}
        """Step -> rank -> the rank's own iteration time (s), under the current version."""
        self._slow: dict[int, list[float]] = {}
        self._normal: dict[int, int] = {}

    def check_notice(self, pipeline: int, factor: float | None) -> None:
        """Whether a notice can be taken: `pipeline` is the job's, `factor` None or in range.

        Raises:
            StragglerError: No such pipeline (code "out_of_range"), or a factor not in
                [1, `MAX_STRAGGLER_FACTOR`] ("bad_request").
        """
        if isinstance(pipeline, bool) or not isinstance(pipeline, int) or (
                pipeline not in self.pipelines):
            raise StragglerError(
                "out_of_range", f"the job has no pipeline {pipeline!r}: its pipelines (data-"
                f"parallel ranks) are {_ranges(self.pipelines)}")
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float)
            or not math.isfinite(factor) or not 1.0 <= factor <= MAX_STRAGGLER_FACTOR
        ):
            raise StragglerError(
                "bad_request", f"a straggler factor is the pipeline's slowdown, from 1 to "
                f"{MAX_STRAGGLER_FACTOR:g} (1.3: 30% slower), got {factor!r}")

    def notice(self, pipeline: int, factor: float | None) -> None:
        """An explicit notice: `pipeline` runs `factor` times slower (None: the notice ends)."""
        if factor is None:
            self.notices.pop(pipeline, None)
        else:
            self.notices[pipeline] = float(factor)

    def restore_notices(self, notices: Mapping[int, float]) -> None:
        """The notices a previous owner recorded (those of pipelines the job has)."""
        self.notices = {d: f for d, f in notices.items() if d in self.pipelines}

    def slow(self, points: Mapping[int, PlanPoint]) -> None:
        """The pipelines that run a slower frontier point than the chosen one, now."""
        self.points = dict(points)

    def forget_plan(self) -> None:
        """No plan is served: nothing is slowed, nothing detected stands."""
        self.points = {}
        self.detected.clear()

    def factors(self) -> dict[int, float]:
        """Pipeline -> straggler factor (> 1): notices, else what was measured."""
        factors = {**self.detected, **self.notices}
        return {d: f for d, f in factors.items() if f > 1.0}

    def new_version(self) -> None:
        """Schedules changed: what was measured under the previous ones no longer counts."""
        self._spans.clear()
        self._slow.clear()
        self._normal.clear()

    def forget_spans(self) -> None:
        """Drop the iterations still being judged (every rank left)."""
        self._spans.clear()

    def forget_slow(self) -> None:
        """Drop the iterations being judged and the slow runs (the job stopped)."""
        self._spans.clear()
        self._slow.clear()

    def track(self, rank: int, step_number: int, span: float, ranks: int,
              chosen: PlanPoint) -> bool:
        """Record rank's own time of one step; once all `ranks` did, judge it.

        Returns whether what is measured of the stragglers changed.
        """
        spans = self._spans.setdefault(step_number, {})
        spans[rank] = span
        if len(self._spans) > MAX_OPEN_STEPS:
            del self._spans[min(self._spans)]
        if len(spans) < ranks:
            return False
        del self._spans[step_number]
        return self._judge(spans, chosen)

    def planned_time(self, pipeline: int, chosen: PlanPoint | None) -> float:
        """The planned iteration time of the point `pipeline` runs (1 when not known)."""
        point = self.points.get(pipeline) or chosen
        time = float(point.time) if point is not None else 1.0
        return time if time > 0 else 1.0

    def _judge(self, spans: dict[int, float], chosen: PlanPoint) -> bool:
        """One iteration of every pipeline: update what is measured of stragglers."""
        times: dict[int, float] = {}
        for rank, span in spans.items():
            d = self.pipeline_of[rank]
            times[d] = max(times.get(d, 0.0), span)
        norm = {d: t / self.planned_time(d, chosen) for d, t in times.items()}
        changed = False
        for d in self.pipelines:
            ref = statistics.median([norm[o] for o in self.pipelines if o != d])
            ratio = norm[d] / ref if ref > 0 else 1.0
            if ratio > 1 + self.threshold:
                self._slow.setdefault(d, []).append(ratio)
                self._normal[d] = 0
            else:
                self._slow[d] = []
                self._normal[d] = self._normal.get(d, 0) + 1
            slow = self._slow.get(d, [])
            if len(slow) >= self.window:
                factor = statistics.median(slow)
                self._slow[d] = []
                previous = self.detected.get(d)
                if previous is None or abs(factor / previous - 1) > self.threshold:
                    self.detected[d] = factor
                    changed = True
            elif d in self.detected and self._normal[d] >= self.window:
                del self.detected[d]
                changed = True
        return changed

    def plan_points(self, frontier: Sequence[PlanPoint], chosen: PlanPoint
                    ) -> dict[int, PlanPoint]:
        """Pipeline -> the frontier point it runs instead of the chosen one (stragglers)."""
        stragglers = self.factors()
        if not stragglers:
            return {}
        worst = max(stragglers.values())
        points: dict[int, PlanPoint] = {}
        for d in self.pipelines:
            own = stragglers.get(d, 1.0)
            if own >= worst:
                continue  # The straggler keeps the chosen plan.
            # A margin under the straggler's pace: clock changes cost time the plan does not
            # show, and a pipeline slowed to exactly that pace would become the critical one.
            target = float(chosen.time) * worst / own * (1 - STRAGGLER_MARGIN)
            fits = [p for p in frontier if float(p.time) <= target * (1 + 1e-9)]
            best = min(fits, key=lambda p: (float(p.energy), -float(p.time)), default=chosen)
            if float(best.energy) < float(chosen.energy):
                points[d] = best
        return points

    def schedules(self, points: Mapping[int, PlanPoint], rank_infos: Mapping[int, RankInfo],
                  orders: Mapping[int, list[str]], base: Mapping[int, FrequencySchedule]
                  ) -> dict[int, FrequencySchedule]:
        """Rank -> its schedule: its pipeline's point's plan, or `base` (the chosen plan's).

        Raises:
            SchedulerError, IndexError: A point's plan does not fit a rank (its stage, order).
        """
        schedules: dict[int, FrequencySchedule] = {}
        for rank, info in rank_infos.items():
            point = points.get(info.dp_rank)
            if point is None:
                schedules[rank] = base[rank]
            else:
                schedules[rank] = plan_schedule(rank, orders.get(rank, []),
                                                point.plan[info.pp_rank],
                                                max(info.available_frequencies))
        return schedules

    def describe(self, points: Mapping[int, PlanPoint], chosen: PlanPoint) -> str:
        """The status of slowed-down pipelines: the worst straggler, the points they run."""
        stragglers = self.factors()
        worst = max(stragglers, key=lambda d: stragglers[d])
        source = "notice" if worst in self.notices else "measured"
        slowed = ", ".join(
            f"{d} -> {float(p.time):.4g} s ({float(p.time) / float(chosen.time):.3f}x, energy "
            f"{100 * (float(p.energy) / float(chosen.energy) - 1):+.1f}%)"
            for d, p in sorted(points.items()))
        return (f"pipeline {worst} is a straggler ({stragglers[worst]:.3f}x, {source}); chosen "
                f"plan {float(chosen.time):.4g} s; pipeline(s) {slowed}")


def _ranges(values: Sequence[int]) -> str:
    """0..3, or a list when not contiguous."""
    if values and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])
    return str(list(values)[:16])
