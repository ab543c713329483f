"""No power-limit command for a window already past (issue 33), and the machine's range guard.

Seen by an adversarial probe with real processes: after a nats-server restart the coordinator
set 175 W, then 150 W, for 50-100 ms each, for windows already past, before it noticed their
marks were lost and profiled 200 W again. The steps of the outage had reached it neither as
events nor as marks; the first event after it replays them (steps are counted by the trainers'
counters), and every window opened and closed on them sent its limit to the GPUs.

A simulated trainer: rank 0's event of each step, then every rank's mark of it; the GPUs follow
the commands the job sends (the limit lands at once: the step whose event sent it runs at it,
its mark still shows the limit before, as an agent stamps a mark when its step begins).
"""

from __future__ import annotations

import time

import pytest

from coordinator.power_limit import (
    MAX_POWER_LIMITS,
    PowerLimitError,
    PowerLimitRangeError,
    PowerLimitStateMachine,
)
from coordinator.power_limit.commands import latest_limit_only
from coordinator.power_limit.job import Action, ApplyPowerLimit, PowerLimitJob, StatusUpdate
from zeus_agent.wire.messages import Mark, PowerLimitOptions, TrainerEvent

LIMITS = [200, 175, 150]
OPTIMUM = 175  # the least energy per step (`step_cost`)


def step_cost(limit: int) -> tuple[float, float]:
    """(s, J) of one step of one GPU at `limit`: slower below 200 W, least energy at 175 W."""
    dt = 1.0 + 0.5 * ((200 - limit) / 50) ** 2
    return dt, 0.8 * limit * dt


def make_job(warmup_steps: int = 1) -> PowerLimitJob:
    # 200, 175, 150 W; warm-up 1, windows of 4 steps: 200 W warm-up at step 0, window [1, 5),
    # 175 W warm-up at 5, window [6, 10), 150 W warm-up at 10, window [11, 15).
    opts = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=warmup_steps,
                             profile_steps=4, pl_step_w=25)
    return PowerLimitJob("j", opts, ranks=[0, 1], min_power_limit_w=150,
                         max_power_limit_w=200, mark_timeout_s=1e9)


def commands(actions: list[Action]) -> list[int]:
    return [a.watts for a in actions if isinstance(a, ApplyPowerLimit)]


class Trainer:
    """Two GPUs whose limits follow the job's commands; rank 0's events pace the job."""

    def __init__(self, job: PowerLimitJob) -> None:
        self.job = job
        self.gpu_limit: int | None = None
        self.clocks = {r: (100.0 * r, 1e6 * r) for r in job.ranks}
        self.ran_at: dict[int, int] = {}
        self.per_input: list[tuple[str, int, list[int]]] = []  # (what, step, commands)
        self.actions = self.take("start", -1, job.start())

    def take(self, what: str, step: int, actions: list[Action]) -> list[Action]:
        sent = commands(actions)
        self.per_input.append((what, step, sent))
        if sent:
            self.gpu_limit = sent[-1]
        return actions

    def event(self, step: int, stamp: bool = True) -> TrainerEvent:
        limit = self.ran_at.get(step, self.gpu_limit) if stamp else None
        return TrainerEvent(kind="step_begin", t_ns=step * 10**9, epoch=0, step=step,
                            power_limit_w=limit)

    def run(self, step: int, send_event: bool = True, send_marks: bool = True) -> None:
        """Step `step`: its event (unless lost), then it runs, then its marks (unless lost)."""
        before = self.gpu_limit
        assert before is not None
        if send_event:
            self.actions += self.take("event", step, self.job.on_event(
                0, self.event(step), now_s=float(step)))
        limit = self.gpu_limit
        assert limit is not None
        self.ran_at[step] = limit
        for r in self.job.ranks:
            t, e = self.clocks[r]
            if send_marks:
                m = Mark(kind="step_begin", epoch=0, step=step, t_ns=round(t * 1e9),
                         energy_j=e, power_limit_w=before)
                self.actions += self.take("mark", step, self.job.on_mark(r, m))
            dt, de = step_cost(limit)
            self.clocks[r] = (t + dt, e + de)


def assert_profile_true_to_its_steps(job: PowerLimitJob) -> None:
    """Every limit measured, over 4 steps that all ran at it, on both GPUs; the optimum chosen."""
    assert job.done and job.gave_up is None
    assert job.machine.optimal_power_limit == OPTIMUM
    got = {m.power_limit: (m.time, m.energy) for m in job.machine.measurements}
    assert sorted(got, reverse=True) == LIMITS
    for limit, (time_s, energy_j) in got.items():
        dt, de = step_cost(limit)
        assert (time_s, energy_j) == pytest.approx((4 * dt, 2 * 4 * de)), limit


def test_an_outage_that_spans_several_windows_sends_no_limit_for_them():
    """Steps 3-19 reach the coordinator neither as events nor as marks (nats-server down; the
    agents reconnected first, so what they buffered reached nobody). Step 20's event replays
    them: the 200 W window closes, 175 W and 150 W are warmed up and profiled on steps long
    past. Was: that one event sent 175 W, 150 W and 200 W. Now: no command (the GPUs stay at
    200 W, the limit needed now: every window is awaited, then redone)."""
    job = make_job()
    trainer = Trainer(job)
    gap = range(3, 20)
    for s in range(80):
        trainer.run(s, send_event=s not in gap, send_marks=s not in gap)
        if job.done:
            break

    after_gap = [sent for what, step, sent in trainer.per_input if (what, step) == ("event", 20)]
    assert after_gap == [[]]
    # No input sent more than one limit, and each limit sent ran for at least one step.
    assert all(len(sent) <= 1 for _, _, sent in trainer.per_input)
    ran = [trainer.ran_at[s] for s in sorted(trainer.ran_at)]
    assert 175 not in ran[3:21] and 150 not in ran[3:21]
    assert ran[3:21] == [200] * 18
    assert_profile_true_to_its_steps(job)
    assert job.progress()["redone"] == dict.fromkeys(("200", "175", "150"), 1)
    assert trainer.gpu_limit == OPTIMUM


def test_an_outage_whose_marks_came_measures_each_limit_on_its_own_steps():
    """Only the events of steps 3-12 were lost; the marks came (stamped with the limit each step
    ran at, 200 W: nothing was commanded meanwhile). Step 13's event replays the steps: the
    200 W window was measured, 175 W's closed on steps that ran at 200 W (redone), 150 W's
    warm-up and window opened on replayed steps. Only 150 W is sent, at step 13; the 150 W
    window, opened on a replayed step, is measured from the first step that ran at 150 W or
    redone, never over steps at 200 W."""
    job = make_job()
    trainer = Trainer(job)
    gap = range(3, 13)
    for s in range(80):
        trainer.run(s, send_event=s not in gap)
        if job.done:
            break
    at_13 = [sent for what, step, sent in trainer.per_input if (what, step) == ("event", 13)]
    assert at_13 == [[150]]
    assert all(len(sent) <= 1 for _, _, sent in trainer.per_input)
    assert_profile_true_to_its_steps(job)


def test_a_window_opened_on_a_replayed_step_is_not_measured_on_steps_at_another_limit():
    """No warm-up: windows 200 W [0, 4), 175 W [4, 8), 150 W [8, 12). The events of steps 3-9
    are lost, their marks come. Step 10's event replays them: 175 W and 150 W are set and their
    windows opened on replayed steps; only 150 W is sent, at step 10, so steps 8 and 9 ran at
    200 W. Was: the window's first marks went unchecked (a limit set on its first step may land
    just after it began) and 150 W was measured over two steps at 200 W. Now its first marks
    are checked (nothing was sent at a replayed step): it is redone."""
    job = make_job(warmup_steps=0)
    trainer = Trainer(job)
    gap = range(3, 10)
    for s in range(80):
        trainer.run(s, send_event=s not in gap)
        if job.done:
            break
    at_10 = [sent for what, step, sent in trainer.per_input if (what, step) == ("event", 10)]
    assert at_10 == [[150]]
    assert [trainer.ran_at[s] for s in range(8, 12)] == [200, 200, 150, 150]
    assert job.progress()["redone"].get("150") == 1
    assert_profile_true_to_its_steps(job)


def test_a_late_batch_of_events_sends_one_limit_at_most():
    """Coordinator first: after the outage the agent's buffered events of steps 3-19 come in one
    batch (an agent that does not know its GPU's limit: no stamps, so no step of the burst is
    known to have run before its window's limit). `on_events` takes the batch as one input:
    the windows it closes on steps long past send nothing; only the limit the batch ends at."""
    job = make_job()
    trainer = Trainer(job)
    for s in range(3):
        trainer.run(s)
    burst = list(range(3, 20))
    for s in burst:  # the trainer runs on at 200 W; nothing reaches the coordinator
        trainer.ran_at[s] = 200
    batch = [trainer.event(s, stamp=False) for s in burst]
    actions = job.on_events(0, batch, now_s=20.0)
    sent = commands(actions)
    assert len(sent) <= 1
    assert sent == ([job.desired_power_limit] if job.desired_power_limit != 200 else [])
    assert any(isinstance(a, StatusUpdate) and a.message.startswith("measuring 150 W")
               for a in actions)  # the batch went through the windows


def test_one_input_keeps_only_its_last_limit():
    apply_175, apply_150, apply_200 = (ApplyPowerLimit(w) for w in (175, 150, 200))
    status = StatusUpdate("profiling", "x")
    assert latest_limit_only([apply_175], before=175) == [apply_175]  # alone: as it was
    assert latest_limit_only([apply_175, status, apply_150], before=200) == [status, apply_150]
    assert latest_limit_only([apply_175, apply_150, apply_200, status], before=200) == [status]
    assert latest_limit_only([apply_175, apply_200], before=200, resend=True) == [apply_200]


# The machine's range guard --------------------------------------------------------------------
@pytest.mark.parametrize(("low", "high"), [(0, 300), (-100, 300), (300, 299), (-5, -1)])
def test_limits_that_are_not_0_lt_min_le_max_are_refused(low, high):
    with pytest.raises(PowerLimitRangeError, match="0 < min_power_limit <= max_power_limit"):
        PowerLimitStateMachine(min_power_limit=low, max_power_limit=high)


@pytest.mark.parametrize("high", [2**63 - 1, 10**30, 100 + 25 * MAX_POWER_LIMITS])
def test_a_hostile_maximum_is_refused_before_any_list_is_built(high):
    """`max_power_limit_w = 2**63 - 1` in an agent's description crashed every replica with a
    `MemoryError` (`list(range(max, min - 1, -25))`)."""
    t0 = time.monotonic()
    with pytest.raises(PowerLimitRangeError, match=f"MAX_POWER_LIMITS={MAX_POWER_LIMITS}"):
        PowerLimitStateMachine(min_power_limit=100, max_power_limit=high, pl_step=25)
    assert time.monotonic() - t0 < 1.0
    opts = PowerLimitOptions(selector="Energy", pl_step_w=25)
    with pytest.raises(PowerLimitError, match="MAX_POWER_LIMITS"):
        PowerLimitJob("j", opts, ranks=[0], min_power_limit_w=100, max_power_limit_w=high)


def test_the_most_limits_allowed_are_built_and_errors_stay_value_errors():
    m = PowerLimitStateMachine(min_power_limit=1, max_power_limit=MAX_POWER_LIMITS, pl_step=1)
    assert len(m.power_limits) == MAX_POWER_LIMITS
    with pytest.raises(ValueError, match="4097 candidate limits"):
        PowerLimitStateMachine(min_power_limit=1, max_power_limit=MAX_POWER_LIMITS + 1,
                               pl_step=1)
    with pytest.raises(ValueError, match="pl_step must be positive"):
        PowerLimitStateMachine(min_power_limit=1, max_power_limit=10**30, pl_step=0)
