"""A pipeline job under a power budget: its frontier for the allocator, the point it serves.

The budget loop (`coordinator.budget.loop`) reads a serving job's frontier (`frontier_of`:
the points' times and powers per GPU, `coordinator.budget.frontier_options`) and, once the
allocator has chosen a point, tells the job to serve it (`serve`). The job serves it through
the machinery that slows pipelines down for a straggler (`StragglerHandling.set_budget`): every
pipeline runs the budget's point (or a slower one, should a straggler call for it), installed
as a new schedule version; `serve(job, None)` puts the job's own chosen plan back. While a
budget governs the job (at its own point too: the caps may throttle it) the scheduler gets no
results (its drift watch compares times with the chosen plan's). Pure: the loop executes the
actions returned.
"""

from __future__ import annotations

import weakref
from typing import Any

from coordinator.budget import frontier_options
from coordinator.budget.frontier_options import FrontierView
from coordinator.optimizer import Action
from coordinator.pipeline import planner
from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.phase import Phase

__all__ = ["frontier_of", "reprofile", "serve"]


_VIEWS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, int, FrontierView | None]] = (
    weakref.WeakKeyDictionary())
"""Scheduler -> (its frontier, its chosen point, GPUs, the view): a frontier is read every
budget round and changes only when the scheduler plans again. The objects themselves, compared
by identity: an `id` of a freed frontier may be a new one's."""


def frontier_of(job: PipelineJob) -> FrontierView | None:
    """The frontier of a job serving a plan of it (None: it serves none, or has no frontier)."""
    scheduler = job.scheduler
    if (job.phase is not Phase.SERVING or scheduler is None or not job.straggling.plan
            or not scheduler.frontier or scheduler.chosen is None):
        return None
    known = _VIEWS.get(scheduler)
    if (known is not None and known[0] is scheduler.frontier and known[1] is scheduler.chosen
            and known[2] == len(job.rank_infos)):
        return known[3]
    rows = getattr(scheduler, "profile_rows", None) or ()
    found = frontier_options.view(scheduler.frontier, scheduler.chosen, len(job.rank_infos),
                                  rows, _evaluate(scheduler, rows))
    _VIEWS[scheduler] = (scheduler.frontier, scheduler.chosen, len(job.rank_infos), found)
    return found


def _evaluate(scheduler: Any, rows: Any) -> frontier_options.Evaluate | None:
    """A plan's (time, energy) on the scheduler's profile and schedule (Perseus's), or None."""
    m = getattr(scheduler, "num_microbatches", 0)
    p_block = getattr(scheduler, "p_block_used", None)
    if not rows or not m or p_block is None:
        return None
    try:
        profile = planner.InstructionProfile.from_rows(rows)
    except ValueError:
        return None
    schedule = getattr(scheduler, "schedule", None)

    def evaluate(plan: Any) -> tuple[float, float]:
        return planner.evaluate(profile, plan, m, p_block, schedule=schedule)

    return evaluate


def serve(job: PipelineJob, point: tuple[int, float] | None) -> list[Action]:
    """Serve a budget's point, (its index, its power per GPU), or the job's own (None).

    A point that is the job's own chosen one keeps its plan, capped: the job counts as governed
    (`StragglerHandling.governed`), its times not the plan's, until told None.

    The point served is `frontier_options.pick`'s: that index if the frontier still has it at
    or under that power, else the nearest point at or under it.
    """
    found = frontier_of(job)
    scheduler = job.scheduler
    if point is None or found is None or scheduler is None or not scheduler.frontier:
        return job.saving(job.straggling.set_budget(None))
    index = frontier_options.pick(scheduler.frontier, len(job.rank_infos), *point)
    # (A throttled option on its own slowest point still holds: the cap slows its plan.) What
    # is installed is recorded (`saving`): a replica taking the job over numbers above it.
    return job.saving(job.straggling.set_budget(None if index == found.chosen and point[0] >= 0
                                                else scheduler.frontier[index], governed=True))


def reprofile(job: PipelineJob) -> list[Action] | None:
    """Ask a job serving its plan to profile again; None: it cannot now (profiling, stopped).

    Its frontier was planned from a profile a power budget's caps throttled, and no budget
    governs its GPUs any more (`coordinator.budget.capped_profiles`). The scheduler profiles
    again from the next window it is given (Perseus: not counted in `max_reprofiles`); where
    it was asked is recorded with the rounds (`KeptRounds.asked`), so that a replica taking the
    job over replays the same re-profile.
    """
    scheduler = job.scheduler
    if (job.phase is not Phase.SERVING or scheduler is None or scheduler.finished
            or not scheduler.reprofile()):
        return None
    asked = job.kept_rounds.asked
    if not asked or asked[-1] != len(job.kept_rounds):
        asked.append(len(job.kept_rounds))
    return job.saving([], always=True)
