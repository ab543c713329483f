"""`WindowJoin` by itself: windows joined with every rank's GPU marks by (epoch, step), without
the state machine. Marks in any order across ranks (each GPU's own in step order), lost marks
proved by later ones, overdue windows, restarted mark counts, the limit check and the window's
time (max over ranks) and energy (sum over GPUs). No event loop, no mocks."""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator.power_limit.window_join import (
    MAX_LATE_STEPS,
    RESTART_RUN,
    WindowJoin,
    WindowMeasure,
)
from zeus_agent.wire.messages import Mark

W = "__GlobalPowerLimitOptimizer_300"

# Per-rank (seconds, joules) per step; each host its own clock and counter origin.
RATES = {0: (1.0, 300.0), 1: (1.5, 310.0), 2: (1.2, 290.0)}


def mark(rank: int, step: int, epoch: int = 0, limit: int | None = 300,
         energy_j: float | None = None) -> Mark:
    dt, de = RATES[rank]
    e = 1e6 * rank + de * step if energy_j is None else energy_j
    return Mark(kind="step_begin", epoch=epoch, step=step,
                t_ns=round((100.0 * rank + dt * step) * 1e9), energy_j=e, power_limit_w=limit)


def closed_join(ranks=(0, 1, 2), begin: int = 0, end: int = 2, steps: int = 2,
                limit: int | None = 300, check_begin: bool = True, now_s: float = 0.0,
                timeout_s: float = 10.0) -> WindowJoin:
    join = WindowJoin(ranks, mark_timeout_s=timeout_s)
    join.open(W, begin_step=(0, begin), steps=steps, power_limit=limit, check_begin=check_begin)
    join.close(W, (0, end), now_s)
    return join


def test_a_window_completes_with_the_last_needed_mark_in_any_order_across_ranks():
    per_rank = {r: [(r, mark(r, s)) for s in range(4)] for r in (0, 1, 2)}
    rng = random.Random(7)
    for _ in range(30):
        join = closed_join()
        queues = {r: list(ms) for r, ms in per_rank.items()}
        order = []
        while any(queues.values()):  # each rank's marks in step order, ranks interleaved
            r = rng.choice([r for r, q in queues.items() if q])
            order.append(queues[r].pop(0))
        last = max(i for i, (_, m) in enumerate(order) if m.step in (0, 2))
        for i, (r, m) in enumerate(order):
            assert join.add_mark(r, m) is (i == last)  # completed by the last needed mark
        assert join.waiting_for() == {}
        (w,) = join.windows()
        assert w.complete and join.lost() == []
        m = join.measure(w)
        assert m == WindowMeasure(W, 300, time_s=pytest.approx(3.0), energy_j=pytest.approx(
            2 * (300.0 + 310.0 + 290.0)), steps=2, covered=2)
        assert join.windows() == []


def test_marks_before_the_close_count_and_the_close_says_what_is_missing():
    join = WindowJoin([0, 1], mark_timeout_s=10.0)
    join.open(W, begin_step=(0, 0), steps=2, power_limit=300, check_begin=True)
    for r, s in itertools.product((0, 1), (0, 1, 2)):
        if (r, s) != (1, 2):
            assert join.add_mark(r, mark(r, s)) is False  # the window is still open
    join.close(W, (0, 2), now_s=1.0)
    assert join.waiting_for() == {W: [1]}
    assert join.lost() == []  # nothing of rank 1 after step 2 came: not proved lost
    assert join.add_mark(1, mark(1, 2)) is True


def test_time_is_the_maximum_over_ranks_and_energy_the_sum_over_gpus():
    join = closed_join(ranks=(0, 1, 2), begin=3, end=7, steps=4)
    for r, s in itertools.product((2, 0, 1), (3, 7)):
        join.add_mark(r, mark(r, s))
    m = join.measure(join.windows()[0])
    assert m.time_s == pytest.approx(4 * 1.5)  # rank 1 is the slowest
    assert m.energy_j == pytest.approx(4 * (300.0 + 310.0 + 290.0))
    assert (m.covered, m.normalised, m.ran_at) == (4, False, ())


def test_a_mark_missing_behind_a_later_mark_of_its_rank_was_lost():
    join = closed_join(ranks=(0, 1))
    for s in (0, 2):
        join.add_mark(0, mark(0, s))
    join.add_mark(1, mark(1, 0))
    assert join.lost() == [] and join.waiting_for() == {W: [1]}
    assert join.add_mark(1, mark(1, 3)) is False  # step 2's mark of rank 1 never came
    (w,) = join.lost()
    assert w.name == W and w.lost == [1] and not w.complete
    join.drop(W)  # the job redoes it
    assert join.windows() == [] and join.waiting_for() == {}


def test_a_window_closed_after_a_later_mark_knows_at_once_its_mark_was_lost():
    join = WindowJoin([0, 1], mark_timeout_s=10.0)
    join.open(W, begin_step=(0, 0), steps=2, power_limit=300, check_begin=True)
    for s in (0, 1, 2):
        join.add_mark(0, mark(0, s))
    for s in (0, 1, 3):  # rank 1's mark of step 2 was lost
        join.add_mark(1, mark(1, s))
    join.close(W, (0, 2), now_s=0.0)
    assert [w.lost for w in join.lost()] == [[1]]


def test_a_window_missing_marks_nothing_proved_lost_is_overdue_after_the_timeout():
    join = closed_join(ranks=(0, 1), now_s=5.0, timeout_s=10.0)
    for s in (0, 2):
        join.add_mark(0, mark(0, s))
    assert join.overdue(14.9) == []
    assert [w.name for w in join.overdue(15.0)] == [W]
    join.add_mark(1, mark(1, 0))
    join.add_mark(1, mark(1, 2))
    assert join.overdue(100.0) == []  # complete: never overdue
    open_only = WindowJoin([0], mark_timeout_s=1.0)
    open_only.open(W, begin_step=(0, 0), steps=2, power_limit=300, check_begin=True)
    assert open_only.overdue(100.0) == [] and open_only.waiting_for() == {}


def test_a_restarted_mark_count_drops_the_old_counts_later_marks():
    join = WindowJoin([0], mark_timeout_s=10.0)
    for s in range(10):
        join.add_mark(0, mark(0, s, energy_j=1000.0 + s))
    for s in range(RESTART_RUN):  # ascending, behind the highest: the count restarted
        join.add_mark(0, mark(0, s, energy_j=5000.0 + s))
    assert join.kept(0) == RESTART_RUN  # steps 3..9 of the old count are gone
    join.open(W, begin_step=(0, 3), steps=2, power_limit=300, check_begin=True)
    join.close(W, (0, 5), now_s=0.0)
    assert join.waiting_for() == {W: [0]}  # the old count's marks measure nothing
    for s in (3, 4, 5):
        join.add_mark(0, mark(0, s, energy_j=5000.0 + s))
    m = join.measure(join.windows()[0])
    assert m.energy_j == pytest.approx(2.0)  # the new count's marks


def test_a_mark_a_little_behind_is_not_a_restart_but_one_far_behind_or_of_an_older_epoch_is():
    join = WindowJoin([0], mark_timeout_s=10.0)
    for s in range(10):
        join.add_mark(0, mark(0, s, epoch=1))
    join.add_mark(0, mark(0, 8, epoch=1))  # handled out of order
    assert join.kept(0) == 10
    join.add_mark(0, mark(0, 2, epoch=0))  # an earlier epoch: restarted
    assert join.kept(0) == 1
    far = WindowJoin([0], mark_timeout_s=10.0)
    far.add_mark(0, mark(0, MAX_LATE_STEPS + 5))
    far.add_mark(0, mark(0, 4))  # more than MAX_LATE_STEPS behind: restarted
    assert far.kept(0) == 1


def test_marks_of_other_ranks_and_kinds_are_ignored():
    join = closed_join(ranks=(0,))
    assert join.add_mark(7, mark(0, 0)) is False
    end = Mark(kind="step_end", epoch=0, step=0, t_ns=0, energy_j=1.0)
    assert join.add_mark(0, end) is False and join.kept(0) == 0


def test_marks_at_another_limit_say_the_window_ran_at_it():
    join = closed_join(ranks=(0, 1), begin=0, end=2, steps=2)
    for r, s in itertools.product((0, 1), (0, 2)):
        join.add_mark(r, mark(r, s, limit=275 if (r, s) == (1, 2) else 300))
    m = join.measure(join.windows()[0])
    assert m.ran_at == (275,) and (m.time_s, m.energy_j) == (0.0, 0.0)
    assert join.windows() == []


def test_a_limit_set_on_the_windows_first_step_is_checked_at_its_end_only():
    join = closed_join(ranks=(0, 1), check_begin=False)
    for r, s in itertools.product((0, 1), (0, 2)):
        join.add_mark(r, mark(r, s, limit=250 if s == 0 else 300))  # the command came after
    m = join.measure(join.windows()[0])
    assert m.ran_at == () and m.covered == 2 and m.time_s == pytest.approx(3.0)


def test_marks_without_a_limit_pass_the_check():
    join = closed_join(ranks=(0,))
    for s in (0, 2):
        join.add_mark(0, mark(0, s, limit=None))
    assert join.measure(join.windows()[0]).ran_at == ()


def test_a_first_step_at_the_previous_limit_moves_the_window_and_normalises_it():
    join = closed_join(ranks=(0, 1), begin=0, end=6, steps=6)
    for r, s in itertools.product((0, 1), range(7)):
        join.add_mark(r, mark(r, s, limit=275 if (r, s) == (1, 0) else 300))
    m = join.measure(join.windows()[0])
    assert m.ran_at == () and m.covered == 5 and m.normalised
    assert m.time_s == pytest.approx(5 * 1.5 * 6 / 5)
    assert m.energy_j == pytest.approx(5 * (300.0 + 310.0) * 6 / 5)


def test_a_first_step_settled_too_late_leaves_the_window_to_be_redone():
    join = closed_join(ranks=(0, 1), begin=0, end=4, steps=4)
    for r, s in itertools.product((0, 1), range(5)):
        join.add_mark(r, mark(r, s, limit=275 if r == 1 and s < 3 else 300))
    m = join.measure(join.windows()[0])  # steps 3..4 settled: fewer than half of 4 (and 2)
    assert m.ran_at == (275,)


def test_a_closing_step_begun_after_the_next_limit_landed_ends_the_window_earlier():
    """Data-parallel ranks under load: rank 1 begins the closing step (4) a few ms after rank
    0, whose begin made the coordinator command the next limit; rank 1's mark of step 4 shows
    it. The window ends at step 3, the last one every mark agrees on, and is normalised."""
    join = closed_join(ranks=(0, 1), begin=0, end=4, steps=4)
    for r, s in itertools.product((0, 1), range(5)):
        join.add_mark(r, mark(r, s, limit=275 if (r, s) == (1, 4) else 300))
    m = join.measure(join.windows()[0])
    assert m.ran_at == () and m.covered == 3 and m.normalised
    assert m.time_s == pytest.approx(3 * 1.5 * 4 / 3)
    assert m.energy_j == pytest.approx(3 * (300.0 + 310.0) * 4 / 3)


def test_a_window_settled_at_both_ends_keeps_at_least_half_its_steps():
    join = closed_join(ranks=(0, 1), begin=0, end=6, steps=6)
    for r, s in itertools.product((0, 1), range(7)):
        join.add_mark(r, mark(r, s, limit=250 if (r, s) == (1, 0) else
                              275 if (r, s) == (1, 6) else 300))
    m = join.measure(join.windows()[0])
    assert m.ran_at == () and m.covered == 4 and m.normalised  # steps 1..5
    assert m.time_s == pytest.approx(4 * 1.5 * 6 / 4)


def test_a_last_step_settled_too_early_leaves_the_window_to_be_redone():
    join = closed_join(ranks=(0, 1), begin=0, end=4, steps=4)
    for r, s in itertools.product((0, 1), range(5)):
        join.add_mark(r, mark(r, s, limit=275 if r == 1 and s >= 2 else 300))
    m = join.measure(join.windows()[0])  # steps 0..1 settled: fewer than half of 4 (and 2)
    assert m.ran_at == (275,)


def test_a_window_restarted_while_open_begins_later_and_checks_its_begin():
    join = WindowJoin([0], mark_timeout_s=10.0)
    assert join.restart_open((0, 3)) is None
    join.open(W, begin_step=(0, 0), steps=2, power_limit=300, check_begin=False)
    w = join.restart_open((0, 3))
    assert w is not None and w.begin_step == (0, 3) and w.check_begin
    join.close(W, (0, 5), now_s=0.0)
    assert join.open_window() is None and W in join
    join.clear()
    assert W not in join and join.windows() == []


def test_a_closed_window_whose_counted_marks_a_restart_dropped_waits_for_them_again():
    """Defect: rank 1's marks of a closed window's steps were in (the window waited for rank 0
    only); then rank 1's count restarted, which dropped them, and rank 0's last mark completed
    the window: measuring it raised KeyError (0, 3). The dropped marks were of the old count:
    the window waits for rank 1 again, and its new count's marks of the window's steps measure
    it."""
    join = closed_join(ranks=(0, 1), begin=3, end=5, steps=2)
    for s in range(7):
        join.add_mark(1, mark(1, s))
    assert join.waiting_for() == {W: [0]}
    for s in range(RESTART_RUN):  # rank 1's count starts again
        join.add_mark(1, mark(1, s, energy_j=5000.0 + 10.0 * s))
    assert join.waiting_for() == {W: [0, 1]}
    for s in range(7):
        assert join.add_mark(0, mark(0, s)) is False  # rank 1's marks are not in
    assert join.waiting_for() == {W: [1]} and join.lost() == []
    done = [join.add_mark(1, mark(1, s, energy_j=5000.0 + 10.0 * s)) for s in range(RESTART_RUN, 6)]
    assert done == [False, False, True]  # steps 3, 4, 5 of the new count: step 5 completes it
    m = join.measure(join.windows()[0])
    assert m.energy_j == pytest.approx(2 * 300.0 + 2 * 10.0)  # rank 1: the new count's marks
    assert m.time_s == pytest.approx(2 * 1.5)


def test_a_window_waiting_again_after_a_restart_is_lost_when_the_new_count_skips_its_step():
    join = closed_join(ranks=(0, 1), begin=3, end=5, steps=2)
    for s in range(7):
        join.add_mark(1, mark(1, s))
    for s in range(5):
        join.add_mark(0, mark(0, s))
    for s in (0, 1, 2, 3, 4, 6):  # rank 1 restarted; its new count's mark of step 5 was lost
        join.add_mark(1, mark(1, s))
    assert [(w.name, w.lost) for w in join.lost()] == [(W, [1])]
    assert join.add_mark(0, mark(0, 5)) is False and join.waiting_for() == {W: [1]}
