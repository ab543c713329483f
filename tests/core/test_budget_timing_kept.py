"""A Perseus job's options as measured under a budget, kept for the replica taking over.

`Timing.record` gives what the budgets' owner measured of a job (a `BudgetTiming` naming the
frontier it was measured on, `frontier_digest`), `Timing.restore` starts a successor from it
for that frontier only, and `worth_keeping` says when a measure moved enough to write again
(`coordinator.budget.timing`; the bucket's side: tests/shell/test_budget_timing_kept.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import ValidationError

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.frontier_options import Served
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import (
    KEEP_TOLERANCE,
    MIN_STEPS,
    Timing,
    frontier_digest,
    worth_keeping,
)
from zeus_agent.wire.budget import MAX_MEASURED, BudgetTiming, MeasuredOption

SETTLE = 3
DIGEST = frontier_digest(0, (1.0, 1.6))
VIEW = fo.FrontierView(times=(1.0, 1.6), powers=(250.0, 160.0), peaks=(280.0, 170.0),
                       chosen=0)
"""One job on 2 GPUs: its chosen point 1.0 s, the slowest 1.6 s at 160 W per GPU."""


def measured_timing() -> Timing:
    """A job held at a 125 W cap, measured at 2.4x its own step time, 105 W per GPU."""
    timing = Timing(SETTLE)
    history = [(n, 1.0, 110.0) for n in range(1, 11)]
    for _ in range(SETTLE):
        timing.observe("job", -125, 1.0, history, DIGEST)
    history += [(n, 2.4, 2.4 * 105.0) for n in range(11, 11 + MIN_STEPS)]
    timing.observe("job", -125, 1.0, history, DIGEST)
    return timing


def test_a_frontier_digest_tells_frontiers_apart_to_the_bit() -> None:
    assert frontier_digest(0, [1.0, 1.6]) == DIGEST and len(DIGEST) == 32
    assert int(DIGEST, 16) >= 0  # (hex)
    others = {frontier_digest(1, (1.0, 1.6)), frontier_digest(0, (1.0, 1.6000000000000003)),
              frontier_digest(0, (1.0,)), frontier_digest(0, (1.0, 1.6, 2.0))}
    assert DIGEST not in others and len(others) == 4


def test_a_successor_starts_from_the_measures_on_the_same_frontier_only() -> None:
    kept = measured_timing().record("job")
    assert kept is not None and kept.frontier == DIGEST and kept.job_id == "job"
    assert [(o.key, o.relative_time, o.power_w) for o in kept.options] == [
        (-125, pytest.approx(2.4), pytest.approx(105.0))]
    # Through the bucket's JSON and back: the same measures.
    kept = BudgetTiming.model_validate_json(kept.model_dump_json())

    other = Timing(SETTLE)
    assert not other.restore("job", frontier_digest(0, (1.0, 1.7)), kept)  # planned again
    assert not other.restore("another", DIGEST, kept)  # another job's
    assert other.measured("job") == () and other.measured("another") == ()
    assert other.restore("job", DIGEST, kept)
    assert other.measured("job") == measured_timing().measured("job")
    assert other.record("job") == kept
    # Its next measures smooth with the restored ones, on the same frontier.
    history = [(1, 3.4, 3.4 * 105.0)]
    for _ in range(SETTLE):
        other.observe("job", -125, 1.0, history, DIGEST)
    history += [(n, 3.4, 3.4 * 105.0) for n in range(2, 2 + MIN_STEPS)]
    other.observe("job", -125, 1.0, history, DIGEST)
    assert other.measured("job")[0].relative_time == pytest.approx((2.4 + 3.4) / 2)
    # A job measured here already keeps its own measures; another frontier drops the kept.
    assert not other.restore("job", DIGEST, kept)
    other.observe("job", None, 1.0, history, frontier_digest(0, (1.0, 1.7)))
    assert other.measured("job") == () and other.record("job") is None


def test_a_job_seen_but_not_measured_yet_still_takes_the_kept_measures() -> None:
    """(Its kept measures not read in its first round: the bucket was away.)"""
    kept = measured_timing().record("job")
    assert kept is not None
    timing = Timing(SETTLE)
    timing.observe("job", -125, 1.0, [(1, 1.0, 110.0)], DIGEST)
    assert not timing.restore("job", frontier_digest(0, (2.0,)), kept)  # (not its frontier)
    assert timing.restore("job", DIGEST, kept)
    assert timing.measured("job") == measured_timing().measured("job")
    other = Timing(SETTLE)  # Seen on another frontier: the kept measures are not its.
    other.observe("job", -125, 1.0, [(1, 1.0, 110.0)], frontier_digest(0, (2.0,)))
    assert not other.restore("job", DIGEST, kept) and other.measured("job") == ()


def test_a_job_without_a_digest_or_measures_keeps_nothing() -> None:
    timing = Timing(SETTLE)
    assert timing.record("job") is None
    for _ in range(SETTLE):
        timing.observe("job", 1, 1.0, [(1, 1.0, 110.0)], ("not", "a digest"))  # (in memory)
    history = [(n, 2.0, 220.0) for n in range(1, 2 + MIN_STEPS)]
    timing.observe("job", 1, 1.0, history, ("not", "a digest"))
    assert timing.measured("job") and timing.record("job") is None
    empty = BudgetTiming(job_id="new", frontier=DIGEST)
    assert not timing.restore("new", DIGEST, empty)  # nothing to take
    assert timing.measured("new") == ()


def kept_with(*options: tuple[int, float, float | None], frontier: str = DIGEST) -> BudgetTiming:
    return BudgetTiming(job_id="job", frontier=frontier, options=[
        MeasuredOption(key=k, relative_time=t, power_w=w) for k, t, w in options])


def test_measures_are_written_again_only_when_they_moved() -> None:
    kept = kept_with((-125, 2.0, 100.0), (1, 1.5, None))
    assert worth_keeping(None, kept)
    assert not worth_keeping(kept, kept)
    small = 1 + KEEP_TOLERANCE / 2
    assert not worth_keeping(kept, kept_with((-125, 2.0 * small, 100.0 * small), (1, 1.5, None)))
    big = 1 + 2 * KEEP_TOLERANCE
    assert worth_keeping(kept, kept_with((-125, 2.0 * big, 100.0), (1, 1.5, None)))
    assert worth_keeping(kept, kept_with((-125, 2.0, 100.0 * big), (1, 1.5, None)))
    assert worth_keeping(kept, kept_with((-125, 2.0, 100.0), (1, 1.5, 120.0)))  # a draw now
    assert worth_keeping(kept, kept_with((-125, 2.0, 100.0)))  # an option less
    assert worth_keeping(kept, kept_with((-125, 2.0, 100.0), (1, 1.5, None),
                                         frontier=frontier_digest(0, (1.0,))))


@pytest.mark.parametrize("bad", [
    {"options": [{"key": 1, "relative_time": 2.0}, {"key": 1, "relative_time": 3.0}]},
    {"options": [{"key": 1, "relative_time": 0.5}]},  # faster than its own point
    {"options": [{"key": 1, "relative_time": 11.0}]},
    {"options": [{"key": 1, "relative_time": math.nan}]},
    {"options": [{"key": 1, "relative_time": 2.0, "power_w": -5.0}]},
    {"options": [{"key": 1, "relative_time": 2.0, "power_w": math.inf}]},
    {"options": [{"key": 1, "relative_time": 2.0, "power_w": 20_000.0}]},
    {"options": [{"key": -20_000, "relative_time": 2.0}]},
    {"options": [{"key": i, "relative_time": 2.0} for i in range(MAX_MEASURED + 1)]},
    {"frontier": "not a digest"},
    {"job_id": ""},
    {"v": 2},
    {"extra": 1},
])
def test_a_kept_value_out_of_bounds_is_refused(bad: dict) -> None:
    value = {"job_id": "job", "frontier": DIGEST, "options": [], **bad}
    with pytest.raises(ValidationError):
        BudgetTiming.model_validate(value)


def test_a_loop_that_restored_the_measures_counts_the_options_as_its_predecessor() -> None:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    job = enforce.JobView("perseus", (("n", 0), ("n", 1)), frontier=VIEW, own_step_s=1.0)

    def loop() -> BudgetLoop:
        return BudgetLoop(link=None, book=None, cluster=cluster,  # type: ignore[arg-type]
                          jobs=list, cap_lease_s=10.0, view=BudgetView())

    old = loop()
    old.points = {"perseus": (-125, 125.0)}
    history: list[tuple[int, float, float | None]] = []
    for n in range(enforce.SETTLE_ROUNDS + 2 * MIN_STEPS):
        history.append((n + 1, 2.4, 2.4 * 105.0))
        (before,) = old.calibrate([dataclasses.replace(job, step_times=tuple(history))])
    kept = old.timing.record("perseus")
    assert kept is not None and kept.frontier == frontier_digest(VIEW.chosen, VIEW.times)

    new, fresh = loop(), loop()
    assert new.timing.restore("perseus", kept.frontier, kept)
    (after,) = new.calibrate([job])  # (No step measured here yet.)
    (model,) = fresh.calibrate([job])
    assert after.frontier is not None and before.frontier is not None
    assert after.frontier.measured == before.frontier.measured != ()
    assert fo.options(after.frontier, 100, 300) == fo.options(before.frontier, 100, 300)
    timed = {o.key: o.time_s for o in fo.options(after.frontier, 100, 300)}
    assert model.frontier is not None and model.frontier.measured == ()
    modelled = {o.key: o.time_s for o in fo.options(model.frontier, 100, 300)}
    assert timed[-125] == pytest.approx(2.4) and modelled[-125] == pytest.approx(1.6 * 160 / 125)
    assert new.timing.measured("perseus") == tuple(
        Served(o.key, o.relative_time, o.power_w) for o in kept.options)


def test_a_successor_that_never_ran_the_jobs_own_point_measures_by_the_kept_one() -> None:
    # 16 x 8, 2026-12-07: the job's driver killed under a budget, its successor has no step
    # at the job's own point (`own_step_s` None): the 125 W option planned at 1.33 ran at
    # 1.95 of the job's own time for the rest of the event, never measured.
    kept = measured_timing().record("job")
    assert kept is not None and kept.own_step_s == 1.0
    kept = BudgetTiming.model_validate_json(kept.model_dump_json())
    successor = Timing(SETTLE)
    assert successor.restore("job", DIGEST, kept)
    history = [(n, 1.95, 1.95 * 100.0) for n in range(1, 2)]
    for _ in range(SETTLE):
        successor.observe("job", -100, None, history, DIGEST)
    history += [(n, 1.95, 1.95 * 100.0) for n in range(2, 2 + MIN_STEPS)]
    successor.observe("job", -100, None, history, DIGEST)
    by_key = {m.key: m for m in successor.measured("job")}
    assert by_key[-100].relative_time == pytest.approx(1.95)
    # Without a kept own time (an older record), nothing is measured, as before.
    old = Timing(SETTLE)
    assert old.restore("job", DIGEST, kept.model_copy(update={"own_step_s": None}))
    for _ in range(SETTLE + 1):
        old.observe("job", -100, None, history, DIGEST)
    assert -100 not in {m.key for m in old.measured("job")}


def test_kept_measures_without_an_own_step_time_read_as_an_older_replica_wrote_them() -> None:
    """`own_step_s` came later (`AddedFields`): left out when unknown, so a replica that
    predates it (its models forbid unknown fields) still reads those measures."""
    older = {"v": 1, "job_id": "j", "frontier": "0" * 32, "options": []}
    assert BudgetTiming(job_id="j", frontier="0" * 32).model_dump() == older
    assert BudgetTiming.model_validate(older).own_step_s is None
    assert BudgetTiming(job_id="j", frontier="0" * 32, own_step_s=0.5).model_dump()[
        "own_step_s"] == 0.5
