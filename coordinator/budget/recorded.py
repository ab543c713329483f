"""A Perseus job another replica drives, as the budgets' owner sees it: records (pure).

Jobs are spread over the replicas (`coordinator.state.assignment`), and the replica applying
the budgets drives only some of them. For the others, the replica driving a Perseus job records
its frontier in the state bucket (`BudgetFrontier`, from the job's `FrontierView`); the
owner plans on it as on a frontier of its own, and records the point it gives the job
(`BudgetPoint`), which the driving replica serves (`coordinator.budget.remote`).
"""

from __future__ import annotations

from pydantic import ValidationError

from coordinator.budget.frontier_options import FrontierView, Throttled
from zeus_agent.models import MAX_POWER_W
from zeus_agent.wire.budget import BudgetFrontier, BudgetPoint, ThrottledPoint

__all__ = ["DRAW_TOLERANCE", "POINT_TOLERANCE", "draw_moved", "frontier_record",
           "frontier_view", "point_moved", "point_record"]

POINT_TOLERANCE = 0.01
"""Relative move of a point's power worth recording again (it moves a little every round
with the job's calibration)."""


DRAW_TOLERANCE = 0.02
"""Relative move of a job's own draw worth recording its frontier again."""


def frontier_record(job_id: str, view: FrontierView, own_draw_w: float | None = None,
                    planned_capped: bool = False) -> BudgetFrontier | None:
    """The record of a job's frontier (uncalibrated, unmeasured); None: out of bounds.

    With its draw per GPU at its own point (`JobView.own_draw_w`; left out if out of bounds),
    and whether it was planned from a profile a budget's caps throttled.
    """
    if own_draw_w is not None and not 0 < own_draw_w <= MAX_POWER_W:
        own_draw_w = None
    try:
        return BudgetFrontier(
            job_id=job_id, times=list(view.times), powers=list(view.powers),
            peaks=list(view.peaks), chosen=view.chosen,
            throttled=[ThrottledPoint(cap_w=t.cap_w, time_s=t.time_s, power_w=t.power_w,
                                      peak_w=t.peak_w) for t in view.throttled],
            own_draw_w=own_draw_w, planned_capped=planned_capped)
    except ValidationError:
        return None


def draw_moved(sent: float | None, now: float | None) -> bool:
    """Whether a job's own draw moved enough from the one recorded to record it again."""
    if now is None or sent is None:
        return now is not sent
    return abs(now - sent) > DRAW_TOLERANCE * sent


def frontier_view(record: BudgetFrontier) -> FrontierView:
    """The frontier a record describes."""
    return FrontierView(tuple(record.times), tuple(record.powers), tuple(record.peaks),
                        record.chosen, tuple(Throttled(t.cap_w, t.time_s, t.power_w, t.peak_w)
                                             for t in record.throttled))


def point_record(job_id: str, point: tuple[int, float]) -> BudgetPoint | None:
    """The record of the point (index, power per GPU) given a job; None: out of bounds."""
    try:
        return BudgetPoint(job_id=job_id, index=point[0], power_w=point[1])
    except ValidationError:
        return None


def point_moved(sent: tuple[int, float] | None, now: tuple[int, float]) -> bool:
    """Whether `now` is another point than `sent` (what was recorded), worth recording."""
    return sent is None or sent[0] != now[0] or abs(now[1] - sent[1]) > POINT_TOLERANCE * sent[1]
