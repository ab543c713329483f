"""`PowerLimitJob` driven by hand: rank 0's trainer events pace it, GPU marks of every rank
measure its windows (time = max over ranks, energy = sum over GPUs), in any arrival order of
ranks and events (each GPU's own marks in step order, as its agent sends them). No event loop,
no mocks."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.optimizer import SaveProgress
from coordinator.power_limit import PowerLimitError, PowerLimitMeasurement, ProfileRangeError
from coordinator.power_limit.job import (
    Action,
    ApplyPowerLimit,
    PowerLimitJob,
    SaveProfile,
    StatusUpdate,
)
from coordinator.power_limit.window_join import RESTART_RUN
from tests.core.power_limit_kit import ev, mark
from zeus_agent.wire.messages import Mark, PowerLimitOptions, TrainerEvent

W300 = "__GlobalPowerLimitOptimizer_300"
W275 = "__GlobalPowerLimitOptimizer_275"

# Per-rank (seconds per step, joules per step) at each limit. Rank 1 is the slowest at 300 W and
# rank 2 at 275 W, so the max over ranks is not always the same rank's.
RATES = {
    300: {0: (1.0, 300.0), 1: (1.2, 310.0), 2: (1.1, 290.0)},
    275: {0: (1.1, 250.0), 1: (1.2, 260.0), 2: (1.3, 240.0)},
}
STEPS = 5  # Steps 0..4 cover both windows of the tiny case below.


def options(**kw) -> PowerLimitOptions:
    base = {"selector": "Energy", "wait_steps": 0, "warmup_steps": 0, "profile_steps": 2,
            "pl_step_w": 25}
    return PowerLimitOptions(**{**base, **kw})


def rank_marks(rank: int, limits_by_step: dict[int, int]) -> list[tuple[int, Mark]]:
    """Marks of one rank for steps 0..STEPS-1, integrating its rate at each step's limit."""
    t, e, out = 100.0 * rank, 1e6 * rank, []  # Each host its own clock and counter origin.
    for step in range(STEPS):
        out.append((rank, mark(step, t, e)))
        dt, de = RATES[limits_by_step[step]][rank]
        t, e = t + dt, e + de
    return out


# Steps 0-1 run at 300 W (window 300 = steps [0, 2)), steps 2-3 at 275 W (window [2, 4)).
LIMIT_AT_STEP = {0: 300, 1: 300, 2: 275, 3: 275, 4: 275}
EXPECTED = {
    300: (max(2 * RATES[300][r][0] for r in range(3)), sum(2 * RATES[300][r][1] for r in range(3))),
    275: (max(2 * RATES[275][r][0] for r in range(3)), sum(2 * RATES[275][r][1] for r in range(3))),
}


def feed(job: PowerLimitJob, items: list[tuple[str, int, object]]) -> list[Action]:
    actions: list[Action] = []
    for what, rank, item in items:
        if what == "event":
            actions += job.on_event(rank, item)  # type: ignore[arg-type]
        else:
            actions += job.on_mark(rank, item)  # type: ignore[arg-type]
    return actions


def events() -> list[tuple[str, int, object]]:
    return [("event", 0, ev(s)) for s in range(STEPS)]


def marks() -> list[tuple[str, int, object]]:
    return [("mark", r, m) for r in range(3) for _, m in rank_marks(r, LIMIT_AT_STEP)]


def shuffled(seed: int) -> Callable[[], list[tuple[str, int, object]]]:
    def order() -> list[tuple[str, int, object]]:
        # Each GPU's marks come in step order (one agent, one connection, handled in order);
        # the ranks' marks are merged in any order.
        rng = random.Random(seed)
        per_rank = [[("mark", r, m) for _, m in rank_marks(r, LIMIT_AT_STEP)] for r in range(3)]
        ms = []
        while any(per_rank):
            ms.append(rng.choice([q for q in per_rank if q]).pop(0))
        # Interleave: events keep their own order, marks come in any order around them.
        out, evs = [], events()
        for i, m in enumerate(ms):
            out.append(m)
            if i % 3 == 2 and evs:
                out.append(evs.pop(0))
        return out + evs

    return order


ORDERS = {
    "marks_before_events": lambda: marks() + events(),
    "marks_after_events": lambda: events() + marks(),
    "marks_reversed_after_events": lambda: events() + marks()[::-1],
    "interleaved_seed_1": shuffled(1),
    "interleaved_seed_2": shuffled(2),
    "interleaved_seed_3": shuffled(3),
}


@pytest.mark.parametrize("order", ORDERS.values(), ids=list(ORDERS))
def test_windows_are_max_time_and_summed_energy_in_any_order(order):
    job = PowerLimitJob("j", options(), ranks=[2, 0, 1], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    actions = feed(job, order())

    assert job.done
    got = {m.power_limit: (m.time, m.energy) for m in job.machine.measurements}
    assert got.keys() == EXPECTED.keys()
    for limit, (time_s, energy_j) in EXPECTED.items():
        assert got[limit] == pytest.approx((time_s, energy_j))
    # Energy selector: 275 W used 1500 J against 1800 J at 300 W.
    saves = [a for a in actions if isinstance(a, SaveProfile)]
    assert len(saves) == 1 and saves[0].optimal_power_limit == 275
    assert [m.power_limit for m in saves[0].measurements] == [300, 275]
    assert actions[-1] == StatusUpdate("done", "optimal power limit 275 W pinned", job.progress())
    assert job.waiting_for() == {}


def test_exact_actions_of_the_tiny_case():
    """Two limits (one 25 W step), no wait, no warm-up, 2-step windows, marks after events."""
    job = PowerLimitJob("j", options(), ranks=[0, 1, 2], min_power_limit_w=275,
                        max_power_limit_w=300)

    def kinds(actions: list[Action]) -> list[tuple]:
        out: list[tuple] = []
        for a in actions:
            if isinstance(a, ApplyPowerLimit):
                out.append(("apply", a.watts))
            elif isinstance(a, SaveProfile):
                out.append(("save", a.optimal_power_limit))
            elif isinstance(a, SaveProgress):
                out.append(("save_progress", a.kind, len(a.state["windows"])))
            else:
                out.append((a.state, a.message))
        return out

    assert kinds(job.start()) == [
        ("apply", 300),
        ("profiling", "profiling 2 power limits (300..275 W, exhaustive search)"),
    ]
    per_step = [kinds(job.on_event(0, ev(s))) for s in range(STEPS)]
    assert per_step == [
        [("profiling", "measuring 300 W from step 0 (epoch 0)")],  # 300 W is already set: no apply.
        [],
        [("apply", 275), ("profiling", "measuring 275 W from step 2 (epoch 0)")],
        [],
        [],  # Window 275 closes; the measurements are still missing.
    ]
    assert job.waiting_for() == {W300: [0, 1, 2], W275: [0, 1, 2]}
    assert not job.done

    all_marks = {r: rank_marks(r, LIMIT_AT_STEP) for r in range(3)}
    for r in (0, 1):
        assert feed(job, [("mark", r, m) for _, m in all_marks[r]]) == []
    assert job.waiting_for() == {W300: [2], W275: [2]}
    final = kinds(feed(job, [("mark", 2, m) for _, m in all_marks[2]]))
    t300, e300 = EXPECTED[300]
    t275, e275 = EXPECTED[275]
    assert final == [
        ("profiling", f"{W300}: {t300:.3f} s, {e300:.1f} J over 3 GPU(s)"),
        ("save_progress", "windows", 1),  # A replica taking over resumes after this window.
        ("profiling", f"{W275}: {t275:.3f} s, {e275:.1f} J over 3 GPU(s)"),
        ("save", 275),
        ("done", "optimal power limit 275 W pinned"),
    ]
    # The optimum 275 W is the current limit already, so no apply is needed.
    assert job.machine.current_power_limit == 275
    # Done ignores further input.
    assert job.on_event(0, ev(5)) == [] and job.on_mark(0, mark(5, 9.0, 9.0)) == []


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ({1: [0]}, {W300: [1]}),
        ({1: [2], 2: [0]}, {W300: [1, 2], W275: [1]}),
        ({0: [4]}, {W275: [0]}),
        ({}, {}),
    ],
)
def test_waiting_for_names_the_ranks_whose_marks_are_missing(missing, expected):
    job = PowerLimitJob("j", options(), ranks=[0, 1, 2], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    feed(job, events())
    items = [("mark", r, m) for r in range(3) for _, m in rank_marks(r, LIMIT_AT_STEP)
             if m.step not in missing.get(r, [])]
    feed(job, items)
    assert job.waiting_for() == expected
    assert job.done is (expected == {})


def test_marks_of_unknown_ranks_and_other_kinds_are_ignored():
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    feed(job, events())
    assert job.on_mark(7, mark(0, 0.0, 0.0)) == []
    assert job.on_mark(0, mark(0, 0.0, 0.0, kind="step_end")) == []
    assert job.on_event(1, ev(9)) == []  # Only rank 0 paces the machine.
    assert job.waiting_for() == {W300: [0, 1], W275: [0, 1]}


def test_epoch_end_cancels_the_open_window_and_redoes_it():
    job = PowerLimitJob("j", options(warmup_steps=1), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    # step 0: warm-up at 300 W; step 1: window 300 opens; epoch ends inside it.
    assert feed(job, [("event", 0, ev(0))]) == []
    opened = feed(job, [("event", 0, ev(1))])
    assert [a.message for a in opened if isinstance(a, StatusUpdate)] == [
        "measuring 300 W from step 1 (epoch 0)"]
    cancelled = job.on_event(0, ev(2, kind="epoch_end"))
    assert [a.message for a in cancelled if isinstance(a, StatusUpdate)] == [
        f"window {W300} cancelled (epoch ended); it will be redone"]
    assert job.waiting_for() == {}
    # Marks of the cancelled window's steps complete nothing.
    for r in (0, 1):
        assert job.on_mark(r, mark(1, 1.0, 10.0)) == []
        assert job.on_mark(r, mark(2, 2.0, 20.0)) == []
    # Next epoch, whose trainer restarts its step count: step 0 warms up again (the limit is
    # already 300 W), step 1 opens the window anew.
    redo = [job.on_event(0, ev(s, epoch=1)) for s in range(2)]
    assert redo[0] == []
    assert [a.message for a in redo[1] if isinstance(a, StatusUpdate)] == [
        "measuring 300 W from step 1 (epoch 1)"]
    # Epoch 0's marks of steps 1 and 3 do not close epoch 1's window [1, 3).
    job.on_event(0, ev(2, epoch=1))
    assert job.on_event(0, ev(3, epoch=1)) == [ApplyPowerLimit(275)]  # Warm-up of 275 W.
    for r in (0, 1):
        assert job.on_mark(r, mark(3, 3.0, 30.0)) == []
    assert job.waiting_for() == {W300: [0, 1]}
    for r in (0, 1):
        job.on_mark(r, mark(1, 10.0, 100.0, epoch=1))
        job.on_mark(r, mark(3, 12.0, 160.0 + r, epoch=1))
    assert job.waiting_for() == {}
    assert [(m.power_limit, m.time, m.energy) for m in job.machine.measurements] == [
        (300, pytest.approx(2.0), pytest.approx(121.0))]


def test_epoch_end_during_a_275_window_goes_back_to_max():
    job = PowerLimitJob("j", options(), ranks=[0], min_power_limit_w=275, max_power_limit_w=300)
    job.start()
    feed(job, [("event", 0, ev(s)) for s in range(3)])  # Window 275 opens at step 2.
    actions = job.on_event(0, ev(3, kind="epoch_end"))
    assert ApplyPowerLimit(300) in actions
    assert job.waiting_for() == {W300: [0]}  # The closed 300 W window still waits.


def test_a_loaded_profile_starts_done_and_applies_the_optimum():
    profile = [
        PowerLimitMeasurement(power_limit=300, energy=1000.0, time=10.0),
        PowerLimitMeasurement(power_limit=250, energy=800.0, time=11.0),
        PowerLimitMeasurement(power_limit=200, energy=900.0, time=14.0),
    ]
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=100,
                        max_power_limit_w=300, measurements=profile)
    assert job.done
    actions = job.start()
    assert actions[0] == ApplyPowerLimit(250)
    assert isinstance(actions[1], StatusUpdate) and actions[1].state == "done"
    assert "loaded profile: optimal power limit 250 W" in actions[1].message
    assert job.progress()["optimal_power_limit_w"] == 250
    # Nothing to save again, nothing else happens.
    assert job.on_event(0, ev(0)) == [] and job.on_mark(0, mark(0, 0.0, 0.0)) == []


def test_a_loaded_profile_outside_the_gpu_range_is_refused():
    profile = [PowerLimitMeasurement(power_limit=400, energy=1.0, time=1.0)]
    with pytest.raises(ProfileRangeError, match="400 W"):
        PowerLimitJob("j", options(), ranks=[0], min_power_limit_w=100, max_power_limit_w=300,
                      measurements=profile)


def test_a_window_without_energy_is_reported():
    job = PowerLimitJob("j", options(), ranks=[0], min_power_limit_w=300, max_power_limit_w=300)
    job.start()
    feed(job, [("event", 0, ev(s)) for s in range(3)])
    job.on_mark(0, mark(0, 0.0, 5.0))
    actions = job.on_mark(0, mark(2, 2.0, 5.0))
    errors = [a for a in actions if isinstance(a, StatusUpdate) and a.state == "error"]
    assert "unusable" in errors[0].message
    gave_up = [a for a in actions if isinstance(a, StatusUpdate) and a.state == "gave_up"]
    assert "no window was measured" in gave_up[0].message  # the only limit: nothing to pick


def test_when_every_window_measures_zero_joules_it_gives_up_at_the_maximum_limit():
    """Defect: the optimiser gave up and left the GPUs at the minimum limit (renewed)."""
    job = PowerLimitJob("j", options(), ranks=[0], min_power_limit_w=250, max_power_limit_w=300)
    job.start()
    actions: list[Action] = []
    # 3 limits x 2 steps; every window measures 0 J.
    for s in range(8):
        actions += job.on_event(0, ev(s))
        actions += job.on_mark(0, mark(s, float(s), 5.0))
    applied = [a.watts for a in actions if isinstance(a, ApplyPowerLimit)]
    assert applied[-1] == 300 and 250 in applied  # went down to 250 W, came back to the max
    assert job.done and job.gave_up and job.desired_power_limit == 300
    status = [a for a in actions if isinstance(a, StatusUpdate) and a.state == "gave_up"]
    assert len(status) == 1 and "maximum limit 300 W" in status[0].message
    assert job.progress()["gave_up"]
    assert not any(isinstance(a, SaveProfile) for a in actions)
    assert job.on_event(0, ev(9)) == [] and job.tick(1e9) == []


def test_lost_step_events_are_counted_by_the_step_counters():
    """Defect: after a NATS restart a 10-step window spanned 46 steps and was accepted."""
    job = PowerLimitJob("j", options(profile_steps=10), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    actions: list[Action] = []
    delivered = [0, 1, 2, 9, 10, 11, 11, 5]  # steps 3-8 lost, 11 twice, 5 late
    for s in delivered:
        actions += job.on_event(0, ev(s))
    # Window 300 opened at step 0 and closed at step 10 (10 steps), though 6 events were lost.
    assert job.waiting_for() == {W300: [0]}
    assert job.last_step == (0, 11)
    actions = job.on_mark(0, mark(0, 0.0, 0.0)) + job.on_mark(0, mark(10, 10.0, 3000.0))
    assert job.machine.window_results[0].time == pytest.approx(10.0)
    assert job.machine.window_results[0].energy == pytest.approx(3000.0)


def test_a_lost_epoch_end_still_cancels_the_window():
    job = PowerLimitJob("j", options(profile_steps=10), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    for s in range(3):
        job.on_event(0, ev(s))
    assert job.machine.state.__class__.__name__ == "Profiling"
    # The epoch_end of epoch 0 was lost; the next event is epoch 1's first step.
    actions = job.on_event(0, ev(0, epoch=1))
    assert any("cancelled" in a.message for a in actions if isinstance(a, StatusUpdate))
    assert job.on_event(0, ev(2, kind="epoch_end")) == []  # late duplicate of that end


def test_a_window_whose_marks_never_come_is_redone_after_the_timeout():
    """Defect: an agent killed mid-profiling lost its marks and the optimiser waited forever."""
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300, mark_timeout_s=5.0)
    job.start()
    for s in range(5):  # windows 300 [0, 2) and 275 [2, 4) close
        job.on_event(0, ev(s), now_s=float(s))
    for s in range(5):
        job.on_mark(0, mark(s, float(s), 100.0 * s))  # rank 1's agent died: no marks
    assert job.waiting_for() == {W300: [1], W275: [1]}
    assert job.tick(5.0) == []  # 300 closed at t=2: not overdue yet
    actions = job.tick(7.5)
    assert any("profiling that limit again" in a.message
               for a in actions if isinstance(a, StatusUpdate))
    assert W300 not in job.waiting_for()
    actions = job.tick(100.0)
    assert job.waiting_for() == {}
    # Both limits are profiled again (warm-up 0 here: the first redo window opened at once, at
    # the last step seen, 4); rank 1's agent is back and marks again.
    actions = []
    for s in range(5, 10):
        actions += job.on_event(0, ev(s), now_s=100.0 + s)
    for r in (0, 1):
        for s in range(4, 10):
            actions += job.on_mark(r, mark(s, float(s), 100.0 * s + r))
    assert job.done and job.gave_up is None
    assert sorted(m.power_limit for m in job.machine.measurements) == [275, 300]
    assert job.progress()["redone"] == {"300": 1, "275": 1}


def test_redone_too_often_a_limit_is_left_out():
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300, mark_timeout_s=1.0)
    job.start()
    now, step = 0.0, 0
    for _ in range(40):  # rank 1 never sends marks
        job.on_event(0, ev(step), now_s=now)
        job.on_mark(0, mark(step, now, 10.0 * step))
        job.tick(now)
        now, step = now + 1.0, step + 1
        if job.done:
            break
    assert job.done and job.gave_up and "no window was measured" in job.gave_up
    assert job.desired_power_limit == 300


def test_a_job_that_finishes_by_leaving_a_limit_out_saves_its_profile():
    """Defect (found by the random traces below): rank 1's marks stop after the 300 W window;
    275 W is redone until left out, on a tick, and the machine chooses 300 W, the limit already
    set: with no effect to act on, the job never saved its profile nor said it was done."""
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300, mark_timeout_s=1.0)
    actions = job.start()
    for s in range(40):
        actions += job.on_event(0, ev(s), now_s=float(s))
        actions += job.on_mark(0, mark(s, float(s), 10.0 * s))
        if s <= 2:
            actions += job.on_mark(1, mark(s, float(s), 10.0 * s))
        actions += job.tick(float(s))
        if job.done:
            break
    assert job.done and job.gave_up is None and job.progress()["redone"] == {"275": 3}
    saved = [a for a in actions if isinstance(a, SaveProfile)]
    assert [(a.optimal_power_limit, len(a.measurements)) for a in saved] == [(300, 1)]
    assert actions[-1] == StatusUpdate("done", "optimal power limit 300 W pinned", job.progress())


def test_zeus_cost_world_size_from_the_options_wins_over_the_rank_count():
    from coordinator.power_limit.job_parts import make_selector
    from zeus_agent.wire.messages import PowerLimitOptions

    explicit = make_selector(PowerLimitOptions(selector="ZeusCost", eta_knob=0.3, world_size=8), 4)
    default = make_selector(PowerLimitOptions(selector="ZeusCost", eta_knob=0.3), 4)
    assert (explicit.eta_knob, explicit.world_size) == (0.3, 8)
    assert default.world_size == 4


def test_a_window_whose_steps_ran_at_another_limit_is_redone():
    """Found with real processes: after a NATS restart the agents delivered their buffered events
    at once, and windows were closed and recorded for steps that all ran at an earlier limit."""
    job = PowerLimitJob("j", options(), ranks=[0], min_power_limit_w=275, max_power_limit_w=300)
    job.start()
    actions: list[Action] = []
    for s in range(5):  # the burst: windows 300 [0, 2) and 275 [2, 4) close at once
        actions += job.on_event(0, ev(s))
    # ...but every step ran at 300 W, as the agent's marks say.
    for s in range(5):
        m = mark(s, float(s), 100.0 * s).model_copy(update={"power_limit_w": 300})
        actions += job.on_mark(0, m)
    assert [m.power_limit for m in job.machine.measurements] == [300]
    assert job.progress()["redone"] == {"275": 1}
    assert any("ran at [300] W, not 275 W" in a.message
               for a in actions if isinstance(a, StatusUpdate))
    assert not job.done


def test_a_limit_that_lands_just_after_the_window_began_starts_the_window_later():
    """Found with real processes under CPU load: the limit command reached one GPU just after
    the window's first step began there (its mark shows the previous limit), and the window was
    redone, 3 times in a row until the limit was left out. Now the window starts at the first
    step every GPU ran at its limit and is normalised to its intended steps."""
    job = PowerLimitJob("j", options(warmup_steps=1, profile_steps=6), ranks=[0, 1],
                        min_power_limit_w=275, max_power_limit_w=300)
    job.start()
    actions: list[Action] = []
    for s in range(8):  # 300 W: warm-up at step 0, window [1, 7)
        actions += job.on_event(0, ev(s))
    for rank in (0, 1):
        for s in range(8):
            limit = 275 if (rank, s) == (1, 1) else 300  # rank 1's step 1: not landed yet
            m = mark(s, float(s), 100.0 * s).model_copy(update={"power_limit_w": limit})
            actions += job.on_mark(rank, m)
    assert [(m.power_limit, m.time, m.energy) for m in job.machine.measurements] == [
        (300, 6.0, 1200.0)]  # steps 2..7 (5 steps), normalised to 6
    assert job.progress()["redone"] == {}
    assert any("covered 5 steps, not 6: normalised" in a.message
               for a in actions if isinstance(a, StatusUpdate))


def test_a_window_that_began_on_steps_at_another_limit_is_redone():
    """Found with real processes: a window opened on a late (stale) step and closed on a fresh
    one; with a warm-up before it, its begin marks must show its limit too."""
    job = PowerLimitJob("j", options(warmup_steps=1), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    actions: list[Action] = []
    for s in range(4):  # 300 W: warm-up at step 0, window [1, 3)
        actions += job.on_event(0, ev(s))
    limits = {0: 300, 1: 250, 2: 300, 3: 300}  # step 1's mark: an older limit
    for s in range(4):
        m = mark(s, float(s), 100.0 * s).model_copy(update={"power_limit_w": limits[s]})
        actions += job.on_mark(0, m)
    assert job.machine.measurements == [] and job.progress()["redone"] == {"300": 1}


def test_late_steps_that_ran_before_the_limit_count_toward_no_window():
    """Found with real processes: after a NATS outage the agents delivered ~45 buffered steps
    at once, all run at the outage's limit. The machine, paced by them, opened and closed
    windows on them; each was redone until the limits were left out of the profile. Events
    now carry the limit their step began at: such steps are skipped and the window starts at
    the first step that ran at its limit, measured over exactly its intended steps."""
    job = PowerLimitJob("j", options(profile_steps=4), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    limit_at = {s: 300 for s in range(0, 5)}  # 300 W window: steps [0, 4)
    limit_at |= {s: 300 for s in range(5, 40)}  # the backlog: 275 W was set, not yet in force
    limit_at |= {s: 275 for s in range(40, 50)}
    actions: list[Action] = []
    for s in range(50):
        actions += job.on_event(0, ev(s).model_copy(update={"power_limit_w": limit_at[s]}))
    for s in range(50):
        m = mark(s, float(s), 100.0 * s + (s > 40) * 10.0 * (s - 40))
        actions += job.on_mark(0, m.model_copy(update={"power_limit_w": limit_at[s]}))
    # 275 W opened at step 4 (its command sent then), steps 5..39 skipped, window [40, 44).
    assert [(m.power_limit, m.time, m.energy) for m in job.machine.measurements] == [
        (300, 4.0, 400.0), (275, 4.0, 440.0)]
    assert job.progress()["redone"] == {}
    assert any("steps 5..39 (epoch 0) ran before 275 W was set" in a.message
               and "starts at step 40 instead" in a.message
               for a in actions if isinstance(a, StatusUpdate))


def test_a_gpu_that_stays_at_another_limit_does_not_stall_the_search():
    """Late steps are skipped only for `mark_timeout_s` in a row (coordinator time): steps that
    keep coming at another limit (a GPU that does not follow its commands) count again, and
    the marks' check redoes their windows instead."""
    job = PowerLimitJob("j", options(profile_steps=2), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300, mark_timeout_s=5.0)
    job.start()
    actions: list[Action] = []
    for s in range(40):
        limit = 300  # never follows the 275 W command
        actions += job.on_event(0, ev(s).model_copy(update={"power_limit_w": limit}), float(s))
        m = mark(s, float(s), 100.0 * s).model_copy(update={"power_limit_w": limit})
        actions += job.on_mark(0, m)
    messages = [a.message for a in actions if isinstance(a, StatusUpdate)]
    assert any("steps 3..7 (epoch 0) ran before 275 W" in m for m in messages)  # 5 s of them
    assert job.progress()["redone"] == {"275": 3}  # then redone until left out, as before
    assert job.done and job.machine.optimal_power_limit == 300


# Lost windows: redone at the next step, the GPUs at the maximum meanwhile ---------------------
def _step_cost(limit: int) -> tuple[float, float]:
    """(s, J) of one step at `limit`: slower below 300 W; the least energy at 250 W."""
    dt = 1.0 + 0.5 * ((300 - limit) / 100) ** 2
    return dt, 0.8 * limit * dt


def run_job(job: PowerLimitJob, steps: int, lost_marks: set[tuple[int, int]] = frozenset(),
            lost_events: set[int] = frozenset(),
            marks_first: bool = False) -> tuple[list[int], list[Action]]:
    """A trainer of `steps` steps: rank 0's event and every rank's mark, step by step.

    The marks of a step come after its event (or before it, `marks_first`). Returns the limit
    each step ran at (the one in force when it began) and every action. Nothing ticks: no
    window can be redone by the timeout.
    """
    actions = job.start()
    ran_at: list[int] = []
    clocks = {r: (100.0 * r, 1e6 * r) for r in job.ranks}
    for s in range(steps):
        limit = job.desired_power_limit  # In force before this step's event (marks_first).
        if not marks_first and s not in lost_events:
            actions += job.on_event(0, ev(s), now_s=float(s))
            limit = job.desired_power_limit
        assert limit is not None
        ran_at.append(limit)
        for r in job.ranks:
            t, e = clocks[r]
            if (r, s) not in lost_marks:
                actions += job.on_mark(r, mark(s, t, e))
            dt, de = _step_cost(limit)
            clocks[r] = (t + dt, e + de)
        if marks_first and s not in lost_events:
            actions += job.on_event(0, ev(s), now_s=float(s))
    return ran_at, actions


def lost_window_job() -> PowerLimitJob:
    # 300..100 W by 50 W; warm-up 1, window 4: windows [1,5) [6,10) [11,15) [16,20) [21,25).
    return PowerLimitJob("j", options(warmup_steps=1, profile_steps=4, pl_step_w=50),
                         ranks=[0, 1], min_power_limit_w=100, max_power_limit_w=300,
                         mark_timeout_s=1e9)


def test_a_window_whose_marks_an_agent_restart_lost_is_redone_at_the_next_step():
    """Defect: rank 1's agent restarted during the 150 W and 100 W windows; their marks were
    lost and the job trained on at 100 W for the whole 30 s timeout (a 320-step job spent its
    last ~190 steps there and never chose). The restarted agent's next marks prove the loss:
    the windows are redone at the next step, and the job chooses."""
    job = lost_window_job()
    ran_at, actions = run_job(job, 60, lost_marks={(1, s) for s in range(18, 24)})
    assert job.done and job.gave_up is None
    assert job.machine.optimal_power_limit == 250
    assert job.progress()["redone"] == {"150": 1, "100": 1}
    assert [m.power_limit for m in job.machine.measurements] == [300, 250, 200, 150, 100]
    assert any("marks of rank(s) [1] were lost" in a.message and "profiling that limit again"
               in a.message for a in actions if isinstance(a, StatusUpdate))
    done_at = max(i for i, w in enumerate(ran_at) if w != 250) + 1
    assert done_at <= 40  # two more windows (warm-up 1, 4 steps each) after step 25
    assert ran_at[done_at:] == [250] * (60 - done_at)
    # Its window and its redo (warm-up included), and the step whose marks recorded the redo.
    assert ran_at.count(100) <= 2 * 5 + 1


def test_a_window_a_broker_outage_cut_is_redone_at_the_next_step():
    """Steps 14-16 reached the coordinator neither as events nor as marks (the bus was down):
    window 200 W [11, 15) can never complete; the marks after the outage say so."""
    job = lost_window_job()
    gap = range(14, 17)
    ran_at, actions = run_job(job, 60, lost_marks={(r, s) for r in (0, 1) for s in gap},
                              lost_events=set(gap))
    assert job.done and job.machine.optimal_power_limit == 250
    assert job.progress()["redone"].get("200") == 1
    assert ran_at[-15:] == [250] * 15


def test_windows_closed_on_the_steps_of_a_long_outage_are_redone_once_after_it():
    """Steps 3-40 reached the coordinator neither as events nor as marks, and the marks of
    step 41 came before rank 0's event: the steps replayed then close every window on lost
    marks. They are redone from step 41, once each, not at replayed steps (whose redo windows
    would be lost again, until their limits were left out)."""
    job = lost_window_job()
    gap = range(3, 41)
    _, actions = run_job(job, 100, lost_marks={(r, s) for r in (0, 1) for s in gap},
                         lost_events=set(gap), marks_first=True)
    assert job.done and job.machine.optimal_power_limit == 250
    assert [m.power_limit for m in job.machine.measurements] == [300, 250, 200, 150, 100]
    assert job.progress()["redone"] == dict.fromkeys(("300", "250", "200", "150", "100"), 1)
    redone_from = {a.message.rsplit(" ", 1)[1] for a in actions
                   if isinstance(a, StatusUpdate) and "were lost" in a.message}
    assert redone_from == {"41"}


def test_while_a_lost_window_is_awaited_the_gpus_run_at_the_maximum():
    """Rank 1's agent is gone for good: nothing proves its marks lost, so the windows wait for
    the timeout; meanwhile nothing is measured and the GPUs run at the maximum, not at 100 W."""
    job = lost_window_job()
    ran_at, _ = run_job(job, 40, lost_marks={(1, s) for s in range(18, 40)})
    assert not job.done and job.waiting_for()
    assert ran_at[20:26] == [100] * 6  # 100 W: warm-up, window [21, 25), its closing step
    assert ran_at[26:] == [300] * 14


# Step counters that jump: re-anchored, never frozen -------------------------------------------
def run_trainer(job: PowerLimitJob, keys: list[tuple[int, int]]) -> tuple[list[int], list[Action]]:
    """Like `run_job`, but rank 0's event and every rank's mark carry the given step counters
    (one iteration each, run at the limit in force after its event)."""
    actions = job.start()
    ran_at: list[int] = []
    clocks = {r: (100.0 * r, 1e6 * r) for r in job.ranks}
    for i, (epoch, step) in enumerate(keys):
        actions += job.on_event(0, ev(step, epoch=epoch), now_s=float(i))
        limit = job.desired_power_limit
        assert limit is not None
        ran_at.append(limit)
        for r in job.ranks:
            t, e = clocks[r]
            actions += job.on_mark(r, mark(step, t, e, epoch=epoch))
            dt, de = _step_cost(limit)
            clocks[r] = (t + dt, e + de)
    return ran_at, actions


def assert_measured_exactly(job: PowerLimitJob) -> None:
    """Every limit measured over its 4 steps on both GPUs, from marks of the current count."""
    assert job.done and job.gave_up is None and job.machine.optimal_power_limit == 250
    got = {m.power_limit: (m.time, m.energy) for m in job.machine.measurements}
    assert got.keys() == {300, 250, 200, 150, 100}
    for limit, (time_s, energy_j) in got.items():
        dt, de = _step_cost(limit)
        assert (time_s, energy_j) == pytest.approx((4 * dt, 2 * 4 * de))


def test_one_bogus_future_step_does_not_freeze_the_job_at_a_low_limit():
    """Defect: one step counter from the future (step 10**12) made every later step of rank 0
    a 'duplicate', and its replay closed windows whose marks never came: the job stayed in
    warm-up at 100 W for good. The jump re-anchors the count: the 100 W window is abandoned
    and redone, the GPUs at the maximum meanwhile."""
    job = lost_window_job()
    keys = [(0, s) for s in range(22)] + [(0, 10**12)] + [(0, s) for s in range(22, 60)]
    ran_at, actions = run_trainer(job, keys)
    assert ran_at[21] == 100 and ran_at[22] == 300  # the bogus step: back to the maximum
    assert_measured_exactly(job)
    assert job.progress()["redone"] == {}  # abandoned while open, not redone as lost
    messages = [a.message for a in actions if isinstance(a, StatusUpdate)]
    assert any("jumped from step 21 to step 1000000000000" in m for m in messages)
    assert any("went back to step 22" in m for m in messages)


@pytest.mark.parametrize("back_to", [0, 10])
def test_a_trainer_that_restarts_its_step_count_is_followed(back_to):
    """Defect: a trainer restarted from step 0 (same registration, so the job's state is kept)
    had its steps ignored until it passed the old count, hundreds of steps at 150 W with
    nothing measured. A few steps behind in a row (or one far behind) restart the count:
    the open window is redone from there, measured on the new count's marks only."""
    job = lost_window_job()
    keys = [(0, s) for s in range(18)] + [(0, s) for s in range(back_to, back_to + 60)]
    ran_at, actions = run_trainer(job, keys)
    assert ran_at[16:18] == [150, 150] and ran_at[18:20] == [150, 150]  # two steps ignored
    assert ran_at[20] == 300  # the third restarts the count: back to the maximum
    assert_measured_exactly(job)
    assert any("went back to step" in a.message for a in actions if isinstance(a, StatusUpdate))


def test_a_restart_far_back_re_anchors_at_once():
    job = lost_window_job()
    keys = [(0, s) for s in range(200, 218)] + [(0, s) for s in range(60)]
    ran_at, _ = run_trainer(job, keys)
    assert ran_at[17] == 150 and ran_at[18] == 300
    assert_measured_exactly(job)


def test_a_restart_in_an_earlier_epoch_is_followed():
    job = lost_window_job()
    keys = [(3, s) for s in range(18)] + [(0, s) for s in range(60)]
    ran_at, _ = run_trainer(job, keys)
    assert ran_at[20] == 300 and job.done
    assert_measured_exactly(job)


def test_windows_longer_than_the_marks_kept_per_rank_are_measured():
    """Defect: with profile_steps above ~4,096 the pruning of old marks dropped the begin mark
    of the open window; its close read that as a lost mark, every limit was redone until left
    out, and the job gave up with 'Can't handle discard(...)'."""
    job = PowerLimitJob("j", options(profile_steps=9000), ranks=[0], min_power_limit_w=275,
                        max_power_limit_w=300)
    ran_at, _ = run_job(job, 18_001)
    assert job.done and job.gave_up is None and job.progress()["redone"] == {}
    got = {m.power_limit: (m.time, m.energy) for m in job.machine.measurements}
    for limit in (300, 275):
        dt, de = _step_cost(limit)
        assert got[limit] == pytest.approx((9000 * dt, 9000 * de))
    assert job._join.kept(0) <= 2 * 4096 + 2  # old marks are still forgotten


def test_giving_up_says_why_in_words():
    job = PowerLimitJob("j", options(), ranks=[0, 1], min_power_limit_w=275,
                        max_power_limit_w=300, mark_timeout_s=1.0)
    job.start()
    for step in range(40):  # rank 1 never sends marks
        job.on_event(0, ev(step), now_s=float(step))
        job.on_mark(0, mark(step, float(step), 10.0 * step))
        job.tick(float(step))
    assert job.gave_up is not None and "Can't handle" not in job.gave_up
    assert "nothing to choose from" in job.gave_up and "redone too often" in job.gave_up


def test_a_window_closed_before_a_ranks_marks_showed_the_restart_is_measured_on_the_new_count():
    """Defect: every rank's trainer restarted from step 0; rank 0's events re-anchored the job
    at once and window 150 W [4, 8) of the new count closed while rank 1's marks lagged: its
    old count's marks of steps 4 and 8 were still kept, so the window waited for rank 0 only.
    Rank 1's new marks then showed the restart (its old count's later marks dropped) and
    rank 0's mark of step 8 made measuring the window raise KeyError out of `on_mark`. The
    window waits for rank 1's new count's marks of its steps, and every limit is measured on
    the marks of the count it ran in."""
    job = lost_window_job()
    actions = job.start()
    keys = [(0, s) for s in range(18)] + [(0, s) for s in range(60)]
    clocks = {r: (100.0 * r, 1e6 * r) for r in job.ranks}
    held: list[Mark] = []  # rank 1's marks of the new count's steps 0..7: its agent lags
    for i, (epoch, step) in enumerate(keys):
        actions += job.on_event(0, ev(step, epoch=epoch), now_s=float(i))
        limit = job.desired_power_limit
        assert limit is not None
        now = {}
        for r in job.ranks:
            t, e = clocks[r]
            now[r] = mark(step, t, e, epoch=epoch)
            dt, de = _step_cost(limit)
            clocks[r] = (t + dt, e + de)
        if 18 <= i < 26:
            held.append(now[1])
            actions += job.on_mark(0, now[0])
            continue
        if i == 26:  # the window closed on this step's event (rank 0's mark of it not in yet)
            assert job.waiting_for() == {"__GlobalPowerLimitOptimizer_150": [0]}
            for m in held[:RESTART_RUN]:  # rank 1's marks say its count restarted...
                actions += job.on_mark(1, m)
            assert job.waiting_for() == {"__GlobalPowerLimitOptimizer_150": [0, 1]}
            actions += job.on_mark(0, now[0])  # ...before rank 0's mark of step 8 comes
            held = held[RESTART_RUN:]
        for m in [*held, now[1]]:
            actions += job.on_mark(1, m)
        held = []
        if i != 26:
            actions += job.on_mark(0, now[0])
    assert_measured_exactly(job)
    assert job.progress()["redone"] == {}


def test_a_restart_of_one_ranks_mark_count_after_a_window_counted_its_marks_does_not_crash():
    """The reviewer's case: rank 1's count alone goes back after window 300 W [3, 5) counted its
    marks in; rank 0's marks come last. The window waits for rank 1's marks again (measured
    from its new count's marks of steps 3 and 5, or redone if they never come)."""
    job = PowerLimitJob("j", options(wait_steps=3, profile_steps=2), ranks=[0, 1],
                        min_power_limit_w=275, max_power_limit_w=300)
    job.start()
    for s in range(6):
        job.on_event(0, ev(s))
    for s in [*range(7), 0, 1, 2]:  # rank 1's count restarted after step 6
        job.on_mark(1, mark(s, float(s), 100.0 * s))
    assert job.waiting_for() == {W300: [0, 1]}
    for s in range(7):
        assert job.on_mark(0, mark(s, float(s), 100.0 * s)) == []
    assert job.waiting_for() == {W300: [1]}
    actions: list[Action] = []
    for s in (3, 4, 5):  # the new count's marks of the window's steps
        actions += job.on_mark(1, mark(s, 10.0 + s, 1000.0 + 50.0 * s))
    assert job.waiting_for() == {}
    assert [(m.power_limit, m.time, m.energy) for m in job.machine.measurements] == [
        (300, pytest.approx(2.0), pytest.approx(200.0 + 100.0))]
    assert any(isinstance(a, SaveProgress) for a in actions)


# Random traces: nothing but PowerLimitError escapes, and the job ends in a known state --------
_RANK = st.integers(0, 2)
_DISTURBANCE = st.one_of(
    st.tuples(st.just("lag"), _RANK, st.integers(1, 12)),  # its agent holds its marks a while
    st.tuples(st.just("deliver"), _RANK, st.integers(1, 8)),  # some held marks come
    st.tuples(st.just("drop"), _RANK, st.integers(1, 6)),  # its oldest pending marks are lost
    st.tuples(st.just("dup"), _RANK),  # its last mark is delivered again
    st.tuples(st.just("swap"), _RANK),  # its next two marks are handled in reverse order
    st.tuples(st.just("count_back"), _RANK, st.sampled_from([1, 3, 20, 150])),  # its count
    st.tuples(st.just("epoch_end"), st.booleans(), st.booleans()),  # (event lost, count resets)
    st.tuples(st.just("tick"), st.sampled_from([0.3, 1.0, 5.0, 30.0])),
    st.tuples(st.just("dead"), _RANK),  # the rank's energy counter stops (toggle)
    st.tuples(st.just("all_dead"), st.booleans()),  # every counter stops, or runs again
    st.tuples(st.just("event_lost"), _RANK),  # rank 0's next event never comes
    st.tuples(st.just("no_limit"), _RANK),  # its marks and events carry no limit (toggle)
    st.tuples(st.just("advance"), st.sampled_from([0, 2, -1, -3, 1500])),  # every count moves
)
_STATES = {"profiling", "done", "error", "gave_up"}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nranks=st.integers(1, 3),
    search=st.sampled_from(["exhaustive", "adaptive"]),
    selector=st.sampled_from(["Energy", "Time", "ZeusCost"]),
    steps=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 4)),
    limits=st.sampled_from([(250, 300), (200, 300), (100, 300)]),
    mark_timeout_s=st.sampled_from([0.5, 2.0, 10.0]),
    rounds=st.integers(20, 150),
    disturbances=st.lists(st.tuples(st.integers(0, 79), _DISTURBANCE), max_size=60),
)
def test_random_traces_raise_nothing_and_end_in_a_known_state(
    nranks, search, selector, steps, limits, mark_timeout_s, rounds, disturbances
):
    """One step per round (rank 0's event, every rank's mark) plus random disturbances: marks
    of the ranks in random interleavings, duplicates, reordered, lost or held back, count
    restarts of one rank or of all, lost events and epoch ends, dead energy counters, ticks
    past the mark timeout. No exception but `PowerLimitError` leaves the job (the coordinator's
    shell catches only that one: anything else stops the job's measurement batch), every limit
    it sends is in range, and it either finished, keeps profiling, or gave up and said so."""
    wait, warmup, profile = steps
    lo, hi = limits
    job = PowerLimitJob(
        "j",
        options(selector=selector, wait_steps=wait, warmup_steps=warmup, profile_steps=profile,
                search=search),
        ranks=range(nranks), min_power_limit_w=lo, max_power_limit_w=hi,
        mark_timeout_s=mark_timeout_s,
    )
    at: dict[int, list[tuple]] = {}
    for i, d in disturbances:
        at.setdefault(i, []).append(d)
    actions: list[Action] = []
    applied = dict.fromkeys(range(nranks), hi)
    pending: dict[int, list[Mark]] = {r: [] for r in range(nranks)}
    last: dict[int, Mark] = {}
    offset = dict.fromkeys(range(nranks), 0)
    held_until = dict.fromkeys(range(nranks), 0)  # Rounds until a rank's marks come.
    dead: set[int] = set()
    no_limit: set[int] = set()
    clocks = {r: (10**9 * r, 1e5 * r) for r in range(nranks)}
    epoch, step, now, event_lost = 0, 0, 0.0, False

    def deliver(r: int, n: int) -> None:
        nonlocal actions
        for m in pending[r][:n]:
            actions += job.on_mark(r, m)
            last[r] = m
        del pending[r][:n]

    try:
        actions += job.start()
        for i in range(rounds):
            if job.done:
                break
            advance = 1
            for kind, *arg in at.get(i, []):
                r = arg[0] % nranks if type(arg[0]) is int else 0
                if kind == "lag":
                    held_until[r] = max(held_until[r], i + arg[1])
                elif kind == "deliver":
                    deliver(r, arg[1])
                elif kind == "drop":
                    del pending[r][: arg[1]]
                elif kind == "dup" and r in last:
                    actions += job.on_mark(r, last[r])
                elif kind == "swap":
                    pending[r][:2] = pending[r][:2][::-1]
                elif kind == "count_back":
                    offset[r] -= arg[1]
                elif kind == "epoch_end":
                    lost, reset = arg
                    if not lost:
                        actions += job.on_event(0, ev(step, "epoch_end", epoch), now)
                    epoch += 1
                    if reset:
                        step, advance, offset = 0, 0, dict.fromkeys(range(nranks), 0)
                elif kind == "tick":
                    now += arg[0]
                    actions += job.tick(now)
                elif kind == "dead":
                    dead ^= {r}
                elif kind == "all_dead":
                    dead = set(range(nranks)) if arg[0] else set()
                elif kind == "no_limit":
                    no_limit ^= {r}
                elif kind == "event_lost":
                    event_lost = True
                elif kind == "advance":
                    advance = arg[0]
            step = max(0, step + advance)
            now += 0.2
            for r in range(nranks):
                key = (epoch, max(0, step + offset[r]))
                limit = None if r in no_limit else applied[r]
                if r == 0 and not event_lost:
                    step_begin = TrainerEvent(kind="step_begin", t_ns=clocks[r][0],
                                              epoch=key[0], step=key[1], power_limit_w=limit)
                    actions += job.on_event(0, step_begin, now)
                if r > 0 and i % 7 == 0:  # other ranks' events change nothing
                    assert job.on_event(r, ev(key[1], epoch=key[0]), now) == []
                t, e = clocks[r]
                pending[r].append(Mark(kind="step_begin", epoch=key[0], step=key[1], t_ns=t,
                                       energy_j=e, power_limit_w=limit))
                dt = 0.1 * (1 + (hi - applied[r]) / hi)
                clocks[r] = (t + round(dt * 1e9), e if r in dead else e + dt * applied[r])
            event_lost = False
            for a in actions:
                if isinstance(a, ApplyPowerLimit):
                    applied = dict.fromkeys(range(nranks), a.watts)
            for r in range(nranks):
                if i >= held_until[r]:
                    deliver(r, len(pending[r]))
        for r in range(nranks):
            deliver(r, len(pending[r]))
        actions += job.tick(now + 1e3)
    except PowerLimitError:
        return  # the documented error (the shell reports it)
    assert all(lo <= a.watts <= hi for a in actions if isinstance(a, ApplyPowerLimit))
    statuses = [a for a in actions if isinstance(a, StatusUpdate)]
    assert {a.state for a in statuses} <= _STATES
    saved = [a for a in actions if isinstance(a, SaveProfile)]
    if job.gave_up is not None:
        assert job.done and job.desired_power_limit == hi
        assert [a.state for a in statuses].count("gave_up") == 1
    elif job.done:
        assert len(saved) == 1 and saved[0].optimal_power_limit == job.desired_power_limit
        assert lo <= saved[0].optimal_power_limit <= hi
    else:  # still profiling
        assert saved == [] and "gave_up" not in {a.state for a in statuses}
        assert lo <= (job.desired_power_limit or 0) <= hi


def test_a_rank_gone_while_profiling_stops_the_job_at_the_maximum_limit():
    """A rank SIGKILLed mid-profiling (`torchrun` then tears the group down): its agent restored
    its GPU and says `trainer_gone`; the job stops, the other GPUs go back to the maximum limit,
    and its status says which rank went and why."""
    job = PowerLimitJob("j", options(), ranks=[0, 1, 2], min_power_limit_w=250,
                        max_power_limit_w=300)
    job.start()
    for s in range(3):
        job.on_event(0, ev(s))
    assert job.desired_power_limit == 275  # profiling 275 W
    assert job.on_agent_error(1, "gap_never_ended", "step 4 never ended", 0.0) == []
    actions = job.on_agent_error(1, "trainer_gone", "trainer pid 7 (job j, rank 1) is gone "
                                 "(process exited without goodbye)", 0.0)
    assert [a.watts for a in actions if isinstance(a, ApplyPowerLimit)] == [300]
    (status,) = [a for a in actions if isinstance(a, StatusUpdate)]
    assert status.state == "stopped"
    assert status.message.startswith("rank 1 is gone while profiling (trainer pid 7")
    assert job.done and job.optimal_power_limit is None and job.progress()["gave_up"]
    assert job.on_event(0, ev(3)) == [] and job.tick(1e9) == []
    assert job.on_agent_error(2, "trainer_gone", "rank 2 is gone", 0.0) == []  # said once


def test_a_rank_gone_after_the_pin_changes_nothing():
    job = PowerLimitJob("j", options(), ranks=[0, 1, 2], min_power_limit_w=275,
                        max_power_limit_w=300)
    job.start()
    feed(job, events() + marks())
    assert job.done and job.optimal_power_limit == 275
    assert job.on_agent_error(1, "trainer_gone", "rank 1 is gone", 0.0) == []
    assert job.optimal_power_limit == 275
