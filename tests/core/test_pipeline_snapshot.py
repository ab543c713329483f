"""`snapshot_scheduler`'s all-max point is evaluated on the schedule the scheduler learnt.

The savings bench's predicted saving is the chosen point against that all-max point: on an
interleaved job, evaluating all-max on a fixed 1F1B DAG would compare two different pipelines.
"""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.pipeline import planner
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.planner.schedules import rank_orders
from zeus_demo.pipeline.cluster import snapshot_scheduler

RANKS, MICROBATCHES, CHUNKS = 4, 4, 2
P_BLOCK_W = 60.0


def rows() -> list[tuple[int, str, int, float, float]]:
    """Each rank's forward and backward at two clocks (the last rank heavier): Perseus
    profiles a rank's actions of a kind together, whichever of its virtual stages ran them."""
    out = []
    for stage in range(RANKS):
        heavy = 1.2 if stage == RANKS - 1 else 1.0
        for kind, t in (("forward", 0.05), ("backward", 0.1)):
            out += [(stage, kind, 1410, t * heavy, 20 * t * heavy),
                    (stage, kind, 1005, 1.3 * t * heavy, 15 * t * heavy)]
    return out


def test_the_all_max_point_is_that_of_the_learnt_interleaved_schedule() -> None:
    schedule = LearnedSchedule.from_orders(
        rank_orders("interleaved-1f1b", RANKS, MICROBATCHES, CHUNKS))
    scheduler = SimpleNamespace(
        frontier=[SimpleNamespace(time=1.0, energy=10.0)],
        chosen=SimpleNamespace(time=1.0, energy=10.0, plan=[]),
        p_block_used=P_BLOCK_W, profile_rows=rows(), schedule=schedule)
    snap = snapshot_scheduler("Perseus", scheduler, MICROBATCHES)
    profile = planner.InstructionProfile.from_rows(rows())
    plan = planner.max_frequency_plan(profile, MICROBATCHES, schedule=schedule)
    expected = planner.evaluate(profile, plan, MICROBATCHES, P_BLOCK_W, schedule=schedule)
    assert snap.all_max == expected
    # Each rank runs its two virtual stages' 8 forwards and 8 backwards at the top clock:
    # 1.2 s of work (the 1F1B DAG's 4 + 4 would take half), so the iteration takes longer.
    assert snap.all_max is not None and snap.all_max[0] >= 8 * 0.05 + 8 * 0.1
