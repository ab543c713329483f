"""A plan that raises some caps and lowers others sends its cuts a round before its raises.

A GPU takes a higher cap at once, a lower one only at its job's next step: landing both at
once, the group drew over the cap (h-bins, 2026-12-07: both of main's bins over in a 60 s
takeover event). A raise is held back one counting round, never more (issue 37's ratchet: a
job capped at its draw would otherwise be cut round after round).
"""

from __future__ import annotations

from coordinator.budget import allocator as alloc
from coordinator.budget import enforce

A, B, C = ("n", 0), ("n", 1), ("n", 2)
NOTHING = alloc.Allocation((), 0.0, 0.0, 0.0, 1.0)


def plan(caps: dict[tuple[str, int], int]) -> enforce.CapPlan:
    return enforce.CapPlan("grid", caps, NOTHING, 1_000.0)


def test_cuts_go_first_and_the_raises_the_round_after() -> None:
    t = enforce.Tightener()
    sent = {A: 200, B: 300, C: 250}
    p = enforce.staged(plan({A: 300, B: 200, C: 250}), sent, t)
    assert p.caps == {A: 200, B: 200, C: 250}  # The cut and the unchanged; A held.
    assert t.deferred == {A}
    p = enforce.staged(plan({A: 300, B: 200, C: 250}), p.caps, t)
    assert p.caps == {A: 300, B: 200, C: 250}  # Only a raise left: it goes.
    assert t.deferred == frozenset()


def test_a_plan_that_only_raises_or_only_cuts_goes_as_it_is() -> None:
    t = enforce.Tightener()
    sent = {A: 200, B: 300}
    assert enforce.staged(plan({A: 250, B: 300}), sent, t).caps == {A: 250, B: 300}
    assert enforce.staged(plan({A: 150, B: 250}), sent, t).caps == {A: 150, B: 250}
    assert t.deferred == frozenset()


def test_the_first_caps_go_at_once() -> None:
    t = enforce.Tightener()
    assert enforce.staged(plan({A: 300, B: 100}), None, t).caps == {A: 300, B: 100}


def test_a_gpu_capped_anew_is_a_cut() -> None:
    t = enforce.Tightener()
    p = enforce.staged(plan({A: 300, C: 100}), {A: 200}, t)
    assert p.caps == {A: 200, C: 100}
    assert t.deferred == {A}


def test_a_raise_held_back_once_goes_next_round_whatever_that_round_cuts() -> None:
    """The ratchet: a cut every round must not hold a raise back every round."""
    t = enforce.Tightener()
    sent = {A: 200, B: 300, C: 300}
    sent = enforce.staged(plan({A: 260, B: 250, C: 300}), sent, t).caps
    assert sent == {A: 200, B: 250, C: 300}
    sent = enforce.staged(plan({A: 270, B: 250, C: 240}), sent, t).caps
    assert sent == {A: 270, B: 250, C: 240}  # A's raise goes with C's cut.
    assert t.deferred == frozenset()


def test_a_job_capped_at_its_draw_is_not_ratcheted_down() -> None:
    """A's plan follows its draw (the cap sent, plus what it would take): a cut elsewhere
    every round. Its cap never goes down, and goes up at least every second round.
    """
    t = enforce.Tightener()
    sent = {A: 150, B: 300}
    history = []
    for i in range(8):
        sent = enforce.staged(plan({A: sent[A] + 20, B: 290 - 10 * i}), sent, t).caps
        history.append(sent[A])
    assert history == sorted(history)
    assert history[-1] >= 150 + 20 * 4


def test_a_woken_round_sends_no_raise_it_held_back() -> None:
    """Its samples are the last round's: the raise waits for the next counting round."""
    t = enforce.Tightener()
    sent = enforce.staged(plan({A: 300, B: 200}), {A: 200, B: 300}, t).caps
    woken = enforce.staged(plan({A: 300, B: 190}), sent, t, counting=False).caps
    assert woken == {A: 200, B: 190}
    assert t.deferred == {A}
    assert enforce.staged(plan({A: 300, B: 180}), woken, t).caps == {A: 300, B: 180}


def test_a_raise_held_back_shows_its_job_held_under_its_share() -> None:
    """Its steps are not its option's that round (`held_under`: not measured)."""
    share = alloc.Share("job", 0, 300, 600.0, 0.1)
    p = enforce.CapPlan("grid", {A: 300, B: 300, C: 100}, alloc.Allocation(
        (share,), 600.0, 0.0, 0.0, 1.0), 1_000.0, {"job": (A, B)})
    t = enforce.Tightener()
    staged = enforce.staged(p, {A: 200, B: 200, C: 300}, t)
    assert enforce.held_under([staged]) == {"job"}
