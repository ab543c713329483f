"""A user's own optimum selector, run in rank 0's process (`TrainerChoice`), in the pure core.

The job profiles as usual; once every limit is measured it asks rank 0 (`AskSelector`) and
keeps the GPUs at the highest limit measured until the answer (a `selection` event) comes; a
failure, an unprofiled limit, a gone or silent rank 0 fall back to the built-in ZeusCost, said
in the status; the choice survives a takeover.
"""

from __future__ import annotations

import pytest

from coordinator.optimizer import Action, ApplyPowerLimit, AskSelector, SaveProfile, StatusUpdate
from coordinator.power_limit.job import PowerLimitJob
from tests.core.power_limit_kit import ev, mark
from zeus_agent.selectors import ZeusCost
from zeus_agent.wire.messages import PowerLimitOptions, TrainerEvent

LIMITS = (300, 250, 200, 150, 100)


def cost(limit: int) -> tuple[float, float]:
    """(s, J) of one step at `limit` (one GPU): the least energy at 250 W."""
    dt = 1.0 + 0.5 * ((300 - limit) / 100) ** 2
    return dt, 0.8 * limit * dt


def custom_job(**kw) -> PowerLimitJob:
    options = PowerLimitOptions(selector="Custom", custom_selector="Cheapest()", wait_steps=0,
                                warmup_steps=0, profile_steps=2, pl_step_w=50,
                                selector_timeout_s=30.0)
    return PowerLimitJob("j", options, ranks=[0, 1], min_power_limit_w=100,
                         max_power_limit_w=300, mark_timeout_s=1e9, **kw)


def profile(job: PowerLimitJob) -> list[Action]:
    """Drive both ranks through every window (2 steps each), one step a second."""
    actions = job.start()
    clocks = {r: (0.0, 0.0) for r in job.ranks}
    for step in range(2 * len(LIMITS) + 1):
        actions += job.on_event(0, ev(step), now_s=float(step))
        limit = job.desired_power_limit
        assert limit is not None
        for r in job.ranks:
            t, e = clocks[r]
            actions += job.on_mark(r, mark(step, t, e))
            dt, de = cost(limit)
            clocks[r] = (t + dt, e + de)
    return actions


def selection(request: int, watts: int | None, error: str = "") -> TrainerEvent:
    return TrainerEvent(kind="selection", t_ns=1, index=request, power_limit_w=watts, name=error)


def statuses(actions: list[Action]) -> list[StatusUpdate]:
    return [a for a in actions if isinstance(a, StatusUpdate)]


def test_a_complete_profile_asks_rank_0_and_holds_the_highest_limit_meanwhile():
    job = custom_job()
    actions = profile(job)
    asks = [a for a in actions if isinstance(a, AskSelector)]
    assert len(asks) == 1 and asks[0].rank == 0 and asks[0].request == 1
    assert sorted(m.power_limit for m in asks[0].measurements) == sorted(LIMITS)
    assert not any(isinstance(a, SaveProfile) for a in actions)
    assert not job.done and job.profiled and job.optimal_power_limit is None
    assert job.desired_power_limit == 300  # the GPUs stay at the highest limit measured
    assert job.progress()["phase"] == "Selecting" and job.snapshot().phase == "selecting"
    assert "Cheapest()" in statuses(actions)[-1].message
    assert job.tick(20.0) == []  # within the timeout: still waiting


def test_rank_0s_answer_is_pinned_and_recorded_as_its_choice():
    job = custom_job()
    profile(job)
    actions = job.on_events(1, [selection(1, 150)], now_s=12.0)
    assert actions == []  # only rank 0 answers
    actions = job.on_events(0, [selection(1, 150)], now_s=12.0)
    assert [a.watts for a in actions if isinstance(a, ApplyPowerLimit)] == [150]
    saved = [a for a in actions if isinstance(a, SaveProfile)]
    assert saved and saved[0].optimal_power_limit == 150 and saved[0].chosen_by_trainer
    assert job.done and job.optimal_power_limit == 150
    done = statuses(actions)[-1]
    assert done.state == "done" and "Cheapest() in rank 0's process" in done.message
    assert job.on_events(0, [selection(1, 100)], now_s=13.0) == []  # answered already


@pytest.mark.parametrize(("answer", "words"), [
    (selection(1, 175), "chose 175 W: 175 W was not profiled"),
    (selection(1, None, "ValueError: no"), "failed in rank 0's process: ValueError: no"),
])
def test_a_bad_answer_falls_back_to_zeus_cost_and_says_why(answer, words):
    job = custom_job()
    profile(job)
    actions = job.on_events(0, [answer], now_s=12.0)
    expected = ZeusCost(eta_knob=0.5, world_size=2).select(job.machine.measurements)
    assert job.done and job.optimal_power_limit == expected
    message = statuses(actions)[-1].message
    assert words in message and "ZeusCost" in message


def test_a_stale_answer_is_ignored():
    job = custom_job()
    profile(job)
    assert job.on_events(0, [selection(7, 150)], now_s=12.0) == []
    assert not job.done


def test_a_silent_rank_0_falls_back_after_the_timeout():
    job = custom_job()
    profile(job)
    assert job.tick(40.0) == []  # asked at t=10: 30 s not over yet
    actions = job.tick(41.0)
    assert job.done and "did not answer within 30 s" in statuses(actions)[-1].message


def test_a_rank_0_that_cannot_be_asked_falls_back_at_once():
    job = custom_job()
    profile(job)
    assert job.selector_unreachable(2, "stale") == []  # not the question asked
    actions = job.selector_unreachable(1, "rank 0's process cannot be asked (trainer left)")
    assert job.done and "trainer left" in statuses(actions)[-1].message


def test_the_choice_survives_a_takeover_and_an_unanswered_question_is_asked_again():
    job = custom_job()
    profile(job)
    job.on_events(0, [selection(1, 200)], now_s=12.0)
    measurements = job.machine.measurements
    taken = custom_job(measurements=measurements, chosen=200)  # (the "chosen" record)
    actions = taken.start()
    assert taken.done and taken.optimal_power_limit == 200
    assert not any(isinstance(a, AskSelector) for a in actions)
    assert [a.watts for a in actions if isinstance(a, ApplyPowerLimit)][-1] == 200
    unanswered = custom_job(measurements=measurements)
    actions = unanswered.start()
    assert [a.request for a in actions if isinstance(a, AskSelector)] == [1]
    assert not unanswered.done and unanswered.desired_power_limit == 300
