"""Profiling under a power budget's cap (issue 37 item 3): only the limits at or under it.

The machine (`PowerLimitStateMachine.cap`) and the job (`PowerLimitJob.set_cap`) driven by
hand against a simulated GPU that clamps every limit to the cap, as an agent holding a node
cap does: no window is measured at a limit above the cap while it holds (it would measure the
cap), the limits above it are profiled once it lifts, and the job ends at the optimum it finds
without a budget.
"""

from __future__ import annotations

import pytest

from coordinator.power_limit.job import ApplyPowerLimit, PowerLimitJob, StatusUpdate
from coordinator.power_limit.machine import (
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    PowerLimitStateMachine,
    SetPowerLimit,
)
from coordinator.power_limit.search import Adaptive
from tests.core.capped_kit import RATE, Gpu
from tests.core.power_limit_kit import ev
from zeus_agent.wire.messages import Mark, PowerLimitOptions

LIMITS = [300, 250, 200, 150]


def drive(m: PowerLimitStateMachine, gpu: Gpu, steps: int, caps: dict[int, int | None],
          seen: list[tuple[int, int | None, str]]) -> None:
    """`steps` steps of the machine; a window's record comes at once; caps set at given steps.

    `seen`: (step, cap, what) for every limit set and window measured, to check afterwards.
    """
    opened = gpu.opened
    for step in range(steps):
        effects: list[Effect] = []
        if step in caps:
            gpu.cap = caps[step]
            effects += m.cap(caps[step])
        if isinstance(m.state, Done):
            break
        effects += m.on_step_begin()
        for effect in effects:
            if isinstance(effect, SetPowerLimit):
                gpu.asked = effect.watts
                seen.append((step, gpu.cap, f"set {effect.watts}"))
            elif isinstance(effect, BeginWindow):
                opened[effect.name] = (gpu.t, gpu.e, gpu.limit)
            elif isinstance(effect, EndWindow):
                t0, e0, ran = opened.pop(effect.name)
                if effect.cancel:
                    continue
                assert ran == gpu.limit
                seen.append((step, gpu.cap, f"measured {effect.name.rsplit('_', 1)[1]} at {ran}"))
                m.record(effect.name, gpu.t - t0, gpu.e - e0)
        gpu.run_step()


def machine(search: str | Adaptive = "exhaustive") -> PowerLimitStateMachine:
    from coordinator.power_limit.selectors import Energy

    m = PowerLimitStateMachine(150, 300, Energy(), wait_steps=0, warmup_steps=1,
                               profile_steps=2, pl_step=50, search=search)
    m.start()
    return m


def measured_limits(seen: list[tuple[int, int | None, str]]) -> list[int]:
    return [int(w.split()[1]) for _, _, w in seen if w.startswith("measured")]


def test_a_cap_from_the_start_profiles_the_limits_under_it_then_the_rest_once_lifted() -> None:
    m, gpu, seen = machine(), Gpu(), []
    drive(m, gpu, 40, {0: 200}, seen)
    # Every limit at or under the cap is measured, the GPU parked at the best of them.
    assert measured_limits(seen) == [200, 150]
    assert m.parked and m.cap_w == 200 and m.current_power_limit == 200
    assert not isinstance(m.state, Done)
    assert all(int(w.split()[1]) <= 200 for _, _, w in seen if w.startswith("set"))
    drive(m, gpu, 40, {0: None}, seen)
    assert isinstance(m.state, Done) and m.optimal_power_limit == 200
    assert sorted(measured_limits(seen)) == sorted(LIMITS)  # each once: Zeus's sweep
    for meas in m.measurements:  # each at its own limit: time and energy per step
        assert meas.time == pytest.approx(2 * RATE[meas.power_limit][0])
        assert meas.energy == pytest.approx(2 * RATE[meas.power_limit][1])


def test_a_cap_arriving_during_a_window_above_it_cancels_that_window() -> None:
    m, gpu, seen = machine(), Gpu(), []
    drive(m, gpu, 6, {}, seen)  # 300 measured, 250 under way
    assert measured_limits(seen) == [300] and m.current_power_limit == 250
    drive(m, gpu, 30, {0: 200}, seen)
    assert measured_limits(seen) == [300, 200, 150] and m.parked
    drive(m, gpu, 30, {0: None}, seen)
    assert measured_limits(seen) == [300, 200, 150, 250]
    assert isinstance(m.state, Done) and m.optimal_power_limit == 200


def test_a_cap_that_rises_lets_the_limits_under_it_be_profiled() -> None:
    m, gpu, seen = machine(), Gpu(), []
    drive(m, gpu, 30, {0: 150}, seen)
    assert measured_limits(seen) == [150] and m.parked and m.current_power_limit == 150
    drive(m, gpu, 30, {0: 250}, seen)
    assert measured_limits(seen) == [150, 250, 200] and m.parked
    drive(m, gpu, 30, {0: None}, seen)
    assert sorted(measured_limits(seen)) == sorted(LIMITS) and m.optimal_power_limit == 200


def test_the_adaptive_search_measures_nothing_above_the_cap_while_it_holds() -> None:
    m, gpu, seen = machine("adaptive"), Gpu(), []
    drive(m, gpu, 60, {3: 200}, seen)
    capped = [w for _, cap, w in seen if cap is not None and w.startswith("measured")]
    assert capped and all(int(w.split()[1]) <= 200 for w in capped)
    assert m.parked
    drive(m, gpu, 200, {0: None}, seen)
    assert isinstance(m.state, Done) and m.optimal_power_limit == 200


def test_a_takeover_while_capped_resumes_where_the_search_stood() -> None:
    m, gpu, seen = machine(), Gpu(), []
    drive(m, gpu, 6, {}, seen)
    drive(m, gpu, 30, {0: 200}, seen)  # 300, then 200 and 150 under the cap
    state = m.resume_state()
    assert state["cap_offset"] == 2
    from coordinator.power_limit.job_parts import resume_arguments
    from coordinator.power_limit.selectors import Energy

    again = PowerLimitStateMachine(150, 300, Energy(), wait_steps=0, warmup_steps=1,
                                   profile_steps=2, pl_step=50, **resume_arguments(state))
    again.start()
    more: list[tuple[int, int | None, str]] = []
    gpu.cap = None  # (lifted meanwhile: the new owner profiles what is left)
    drive(again, gpu, 30, {}, more)
    assert measured_limits(more) == [250]  # not 200 nor 150 again
    assert isinstance(again.state, Done) and again.optimal_power_limit == 200


def test_a_cap_once_done_changes_nothing() -> None:
    m, gpu, seen = machine(), Gpu(), []
    drive(m, gpu, 40, {}, seen)
    assert isinstance(m.state, Done)
    assert m.cap(150) == [] and m.optimal_power_limit == 200
    from coordinator.power_limit.job_parts import progress_of

    progress = progress_of(m, "Done", m.optimal_power_limit, None)
    assert progress["cap_w"] is None and not progress["parked"]  # (the budget's to share now)


# The job: a simulated GPU clamped to its cap, marks carrying the limit it ran at ----------------


def options() -> PowerLimitOptions:
    return PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2,
                             pl_step_w=50)


def run_job(job: PowerLimitJob, gpu: Gpu, first: int, steps: int,
            actions: list[object]) -> int:
    """Steps `first`.. of rank 0 (one rank), its GPU clamped to its cap; the next step."""
    for step in range(first, first + steps):
        if job.done:
            return step
        # (The agent marks the step's begin before the command its event brings arrives.)
        mark = Mark(kind="step_begin", epoch=0, step=step, t_ns=round(gpu.t * 1e9),
                    energy_j=gpu.e, power_limit_w=gpu.limit)
        for a in job.on_event(0, ev(step)):
            actions.append(a)
            if isinstance(a, ApplyPowerLimit):
                gpu.asked = a.watts
        actions += job.on_mark(0, mark)
        gpu.run_step()
    return first + steps


def apply(gpu: Gpu, actions: list[object]) -> list[object]:
    for a in actions:
        if isinstance(a, ApplyPowerLimit):
            gpu.asked = a.watts
    return actions


def test_a_job_capped_while_profiling_measures_under_the_cap_then_every_limit() -> None:
    job = PowerLimitJob("j", options(), [0], 150, 300)
    gpu, actions = Gpu(), list(job.start())
    step = run_job(job, gpu, 0, 6, actions)  # 300 measured, 250 under way
    gpu.cap = 200  # the budget's node cap reaches the agent...
    said = apply(gpu, job.set_cap(200))  # ...the job learns it (a reply's capped_w, the plan)
    assert any(isinstance(a, StatusUpdate) and "capped at 200 W" in a.message for a in said)
    assert job.progress()["cap_w"] == 200
    capped_from = len(actions)
    step = run_job(job, gpu, step, 30, actions)
    assert all(a.watts <= 200 for a in actions[capped_from:] if isinstance(a, ApplyPowerLimit))
    windows = [w.power_limit for w in job.machine.window_results]
    assert windows == [300, 200, 150] and job.machine.parked and not job.done
    assert job.desired_power_limit == 200  # the best under the cap, nothing above it
    assert job.set_cap(200) == []  # (the same cap again: nothing to say)
    gpu.cap = None
    lifted = apply(gpu, job.set_cap(None))
    assert any(isinstance(a, StatusUpdate) and "lifted" in a.message for a in lifted)
    assert ApplyPowerLimit(250) in lifted  # the limit above the old cap, profiled now
    run_job(job, gpu, step, 30, actions)
    assert job.done and job.optimal_power_limit == 200
    assert job.machine.redos() == {}  # no window ran clamped
    assert sorted(m.power_limit for m in job.machine.measurements) == LIMITS[::-1]
    for m in job.machine.measurements:
        assert m.time == pytest.approx(2 * RATE[m.power_limit][0])
    assert job.set_cap(150) == []  # profiled: the budget shares the cap by the profile
