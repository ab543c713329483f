"""After a raise of the caps, a draw over the target counts while the samples settle.

A takeover's guard ends with the new owner's own caps, none under the guarded ones; the
backoff's release lets a plan raise caps. The samples of the next rounds show at most the
draw to come, so a draw over the target then is over it. The tightener used to hold still
for `SETTLE_ROUNDS` rounds after any change: a raise whose draw the models undercounted (a
Perseus job moved to a point at 300 W counted at 837 W drew ~1,400 W, 16 x 8, 2026-12-07)
stayed over the cap for `SETTLE_ROUNDS` + `OVER_ROUNDS` rounds (476 J after the owner's kill).
"""

from __future__ import annotations

from coordinator.budget import allocator as alloc
from coordinator.budget import enforce

GPU = ("n", 0)
NOTHING = alloc.Allocation((), 0.0, 0.0, 0.0, 1.0)


def test_a_takeovers_own_caps_measured_over_the_target_tighten_without_waiting() -> None:
    """Fails on main (50d9958): the backoff stays 500 W for the 3 settling rounds."""
    t = enforce.Tightener(backoff_w=500.0)
    t.resume({GPU: 200}, 0.0)
    plan = enforce.CapPlan("grid", {GPU: 300}, NOTHING, 9_500.0)
    for _ in range(enforce.GUARD_ROUNDS):
        t.update(9_000.0, 10_000.0)
        enforce.guarded(plan, t)
    assert enforce.guarded(plan, t).caps == {GPU: 300}  # Its own caps, raised.
    backoffs = [t.update(10_300.0, 10_000.0) for _ in range(enforce.SETTLE_ROUNDS)]
    assert backoffs == [500.0, 800.0, 1_100.0]  # Over the room (no jitter: no band) twice.


def test_after_a_raise_a_draw_under_the_target_gives_nothing_back_while_it_settles() -> None:
    t = enforce.Tightener(backoff_w=100.0)
    t.update(900.0, 1_000.0)  # (Settled: a fifth given back.)
    t.hold(raised=True)
    assert [t.update(800.0, 1_000.0) for _ in range(enforce.SETTLE_ROUNDS)] == [80.0] * 3
    assert t.update(800.0, 1_000.0) == 80.0 * (1 - enforce.RELEASE)


def test_a_raise_while_a_cut_settles_stays_a_cuts_hold() -> None:
    """The samples still show the cut's excess: counted, the room would shrink far too much."""
    t = enforce.Tightener()
    t.hold()  # A cut.
    t.update(1_500.0, 1_000.0)
    t.hold(raised=True)  # A raise one round later.
    assert [t.update(1_500.0, 1_000.0) for _ in range(enforce.SETTLE_ROUNDS)] == [0.0] * 3
    t.hold(raised=True)  # Settled: a raise now counts.
    assert [t.update(1_500.0, 1_000.0) for _ in range(2)] == [0.0, 500.0]


def test_a_raise_lowers_no_cap_and_caps_no_gpu_anew() -> None:
    a, b = ("n", 0), ("n", 1)
    assert enforce.raised_only({a: 100, b: 100}, {a: 150, b: 100})
    assert enforce.raised_only({a: 100, b: 100}, {a: 150})  # (b lifted.)
    assert not enforce.raised_only({a: 100, b: 100}, {a: 150, b: 75})
    assert not enforce.raised_only({a: 100}, {a: 100, b: 300})  # b capped anew.
    assert not enforce.raised_only(None, {a: 300})  # The first caps.
