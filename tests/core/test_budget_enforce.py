"""From a governing budget to caps per GPU: jobs' profiles, idle GPUs, the tightener."""

from __future__ import annotations

from coordinator.budget import enforce
from coordinator.budget.budgets import Cluster, Governed, GpuInfo
from zeus_agent.models import PowerLimitMeasurement

GPUS = [("n", i) for i in range(6)]


def cluster() -> Cluster:
    c = Cluster()
    c.announce("n", {}, {i: GpuInfo(100, 300) for i in range(6)})
    for key, w in zip(GPUS, (280, 280, 250, 250, 30, 30), strict=True):
        c.sample(*key, w)
    return c


def profile() -> tuple[PowerLimitMeasurement, ...]:
    """Two GPUs, 10-step windows: energy summed over both, time per window."""
    rows = [(300, 10.0, 2 * 280.0), (250, 10.3, 2 * 245.0), (200, 11.0, 2 * 200.0),
            (150, 13.0, 2 * 150.0), (100, 18.0, 2 * 100.0)]
    return tuple(PowerLimitMeasurement(power_limit=lim, time=t, energy=w * t)
                 for lim, t, w in rows)


NOTHING = enforce.alloc.Allocation((), 0.0, 0.0, 0.0, 1.0)
"""An empty allocation, for plans whose caps alone matter."""

JOBS = [enforce.JobView("a", (GPUS[0], GPUS[1]), profile(), 300),
        enforce.JobView("b", (GPUS[2], GPUS[3]))]


def governed(room_w: float) -> Governed:
    return Governed("grid", room_w, room_w, tuple(GPUS))


def test_an_ample_budget_keeps_every_job_at_its_own_limit_and_idle_gpus_at_the_minimum():
    p = enforce.plan(governed(5000), JOBS, cluster())
    assert [p.caps[k] for k in GPUS] == [300, 300, 300, 300, 100, 100]
    share = p.allocation.by_job["a"]
    assert share.slowdown == 0 and share.expected_w == 2 * 280.0  # energy / time / GPUs


def test_a_tight_budget_picks_limits_whose_expected_draw_fits():
    room = 2 * 200 + 2 * 200 + 60  # a at 200 W fits with b proportionally capped
    p = enforce.plan(governed(room), JOBS, cluster())
    assert p.allocation.expected_w <= room
    assert p.caps[GPUS[0]] == p.caps[GPUS[1]] <= 250
    assert p.caps[GPUS[2]] == p.caps[GPUS[3]] < 300  # unprofiled: proportional
    assert p.caps[GPUS[4]] == 100


def test_the_backoff_shrinks_the_room_but_never_under_the_floor():
    c = cluster()
    base = enforce.plan(governed(1200), JOBS, c)
    tighter = enforce.plan(governed(1200), JOBS, c, backoff_w=200)
    assert tighter.room_w == 1000 and tighter.allocation.expected_w <= 1000
    assert sum(tighter.caps.values()) <= sum(base.caps.values())
    floor = enforce.plan(governed(1200), JOBS, c, backoff_w=10_000)
    assert floor.room_w == floor.allocation.floor_w


def test_a_job_outside_the_group_or_a_profile_without_its_optimum_is_handled():
    stray = enforce.JobView("z", (("elsewhere", 0),))
    odd = enforce.JobView("a", (GPUS[0], GPUS[1]), profile(), 275)  # not a measured limit
    p = enforce.plan(governed(5000), [stray, odd, JOBS[1]], cluster())
    assert "z" not in p.allocation.by_job
    assert p.allocation.by_job["a"].key is None  # capped proportionally


def test_the_tightener_acts_on_a_lasting_excess_and_gives_the_room_back_slowly():
    t = enforce.Tightener()
    assert t.update(1100, 1000) == 0  # one round over: noise
    assert t.update(1100, 1000) == 100
    assert t.update(1050, 1000) == 155  # 50 over, and a band of half its 10 W jitter under
    assert t.update(None, 1000) == 155  # not every GPU sampled: no decision
    backoffs = [t.update(900, 1000) for _ in range(30)]
    assert backoffs[0] == 0.8 * 155 and backoffs == sorted(backoffs, reverse=True)
    assert backoffs[-1] == 0


def test_a_jittery_draw_is_held_a_band_under_the_room_a_steady_one_at_it():
    steady = enforce.Tightener()
    assert [steady.update(995, 1000) for _ in range(12)] == [0] * 12
    jittery = enforce.Tightener()  # the same mean draw over pairs of rounds, jumping 30 W
    backoffs = [jittery.update(w, 1000) for w in [995, 995, 965, 965] * 3]
    assert max(backoffs) > 0 and 0 < jittery.band_w(1000) <= 15
    assert enforce.Tightener(jitter_w=1e6).band_w(1000) == enforce.MAX_BAND * 1000


def test_the_tightener_holds_still_while_the_samples_show_caps_since_changed():
    t = enforce.Tightener()
    t.hold()
    assert [t.update(1500, 1000) for _ in range(enforce.SETTLE_ROUNDS)] == [0, 0, 0]
    assert t.update(1100, 1000) == 0  # the caps' own effect, measured: one round is noise
    # (The 400 W step from the settling rounds' draw counts in the jitter: the band at most.)
    assert t.update(1100, 1000) == 100 + enforce.MAX_BAND * 1000


def test_the_jitter_is_learnt_while_the_samples_settle_but_for_the_caps_own_step():
    t = enforce.Tightener()
    t.update(1000, 2000)
    t.hold()
    draws = [1500, 1540, 1500]  # the first: the caps' step from 1,000 W (not counted)
    assert [t.update(w, 2000) for w in draws] == [0, 0, 0]
    assert t.jitter_w == enforce.JITTER_WEIGHT * 40 * (2 - enforce.JITTER_WEIGHT)


def test_a_backoff_kept_beyond_the_room_is_cut_to_it_and_decays_in_a_minute_at_most():
    t = enforce.Tightener(backoff_w=1e12)  # A predecessor's, finite but absurd.
    t.resume({}, 0.0)
    plan = enforce.CapPlan("grid", {}, NOTHING, 1000.0)

    def round_w() -> float:  # (As the loop plans: the guard spent a round at a time.)
        backoff = t.update(900, 1000)
        enforce.guarded(plan, t)
        return backoff

    assert round_w() <= 1000  # The whole room at most: the group's floor, not 2 minutes of it.
    rounds = 1 + next(i for i in range(120) if round_w() == 0)
    # Kept through the guard and the settling after it, then 1000 W x 0.8^31 < 1 W.
    assert rounds <= enforce.GUARD_ROUNDS + enforce.SETTLE_ROUNDS + 35


def test_a_new_owner_keeps_its_predecessors_backoff_while_the_guard_bounds_its_caps():
    """The caps of a takeover's first rounds are the least of two plans' (`guarded`): the
    group draws under either, which says nothing of the room. Given back then, the backoff
    let the plans up to the room as the guard ended (a 16 x 8 takeover: 641 W over)."""
    t = enforce.Tightener(backoff_w=500.0)
    t.resume({("n", 0): 200}, 0.0)
    plan = enforce.CapPlan("grid", {("n", 0): 300}, NOTHING, 10_000.0)
    for _ in range(enforce.GUARD_ROUNDS):
        assert t.update(9000.0, 10_000.0) == 500.0  # 1,000 W under: kept
        assert enforce.guarded(plan, t).caps == {("n", 0): 200}
    assert enforce.guarded(plan, t).caps == {("n", 0): 300}  # Its own caps now...
    # ...whose samples take the settling rounds to come: the guarded caps' are not counted.
    assert [t.update(9000.0, 10_000.0) for _ in range(enforce.SETTLE_ROUNDS)] == [500.0] * 3
    assert t.update(9000.0, 10_000.0) == 500.0 * (1 - enforce.RELEASE)


def test_a_new_budget_keeps_a_margin_back_at_first_and_gives_it_back_once_under():
    fresh = enforce.Tightener(fresh=True)
    assert fresh.update(1500, 1000) == enforce.START_MARGIN * 1000  # The draw before caps.
    fresh.hold()  # The first caps sent.
    assert [fresh.update(1500, 1000) for _ in range(enforce.SETTLE_ROUNDS)] == [30.0] * 3
    assert fresh.update(950, 1000) == 0.8 * 30.0  # Under: given back a fifth a round.
    resumed = enforce.Tightener(fresh=True)
    resumed.resume({}, 0.0)  # A predecessor's backoff (none): no margin on top.
    assert resumed.update(950, 1000) == 0


def test_measured_draw_needs_every_gpu_sampled():
    c = cluster()
    assert enforce.measured_w(GPUS[:2], c) == 560
    assert enforce.measured_w([("n", 9)], c) is None


def test_a_job_of_higher_priority_is_slowed_less_than_an_identical_one():
    """Two identical profiled jobs, room for one at its optimum and one cut: the one whose
    registration gave priority 2 keeps the higher limit, whichever id sorts first."""
    for first, second in ((2.0, 1.0), (1.0, 2.0)):
        jobs = [enforce.JobView("a", (GPUS[0], GPUS[1]), profile(), 300, first),
                enforce.JobView("b", (GPUS[2], GPUS[3]), profile(), 300, second)]
        room = 2 * 280 + 2 * 200 + 60  # idle GPUs at their 30 W
        p = enforce.plan(governed(room), jobs, cluster())
        favoured, other = ("a", "b") if first > second else ("b", "a")
        assert p.allocation.by_job[favoured].limit_w > p.allocation.by_job[other].limit_w
