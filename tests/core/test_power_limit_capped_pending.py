"""A cap arriving while a window at or under it is open: that limit is not profiled twice.

Zeus's sweep closes a window and asks for the next probe before the window's measurement is
recorded (`waits_for_results` False). The cap's detour (every limit at or under the cap not
measured yet) then counted the limit just closed as not measured and opened a second window at
it: a repeated window under the cap, wasted steps at a limit already known.
"""

from __future__ import annotations

from coordinator.power_limit.job_parts import resume_arguments
from coordinator.power_limit.machine import (
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    PowerLimitStateMachine,
    SetPowerLimit,
)
from coordinator.power_limit.selectors import Energy
from tests.core.capped_kit import Gpu


def machine(**kw: object) -> PowerLimitStateMachine:
    m = PowerLimitStateMachine(150, 300, Energy(), wait_steps=0, warmup_steps=1,
                               profile_steps=2, pl_step=50, **kw)  # type: ignore[arg-type]
    m.start()
    return m


def drive(m: PowerLimitStateMachine, gpu: Gpu, steps: int, cap: int | None,
          measured: list[int]) -> None:
    """`steps` steps under `cap` (set first); each window recorded as it closes."""
    opened = gpu.opened
    gpu.cap = cap
    effects: list[Effect] = m.cap(cap)
    for _ in range(steps):
        if isinstance(m.state, Done):
            return
        effects += m.on_step_begin()
        for effect in effects:
            if isinstance(effect, SetPowerLimit):
                gpu.asked = effect.watts
            elif isinstance(effect, BeginWindow):
                opened[effect.name] = (gpu.t, gpu.e, gpu.limit)
            elif isinstance(effect, EndWindow):
                t0, e0, _ = opened.pop(effect.name)
                if not effect.cancel:
                    measured.append(int(effect.name.rsplit("_", 1)[1]))
                    m.record(effect.name, gpu.t - t0, gpu.e - e0)
        effects = []
        gpu.run_step()


def test_a_cap_during_a_window_under_it_profiles_each_limit_once() -> None:
    m, gpu, measured = machine(), Gpu(), []
    drive(m, gpu, 6, None, measured)  # 300 measured, 250's window open
    drive(m, gpu, 40, 250, measured)
    drive(m, gpu, 40, None, measured)
    assert isinstance(m.state, Done) and m.optimal_power_limit == 200
    assert sorted(measured) == [150, 200, 250, 300]  # each once: Zeus's sweep


def test_a_takeover_under_a_cap_profiles_each_limit_once() -> None:
    m, gpu, measured = machine(), Gpu(), []
    drive(m, gpu, 6, None, measured)
    drive(m, gpu, 3, 250, measured)
    again = machine(**resume_arguments(m.resume_state()))
    gpu.opened.clear()  # (The old owner's open window is lost with it.)
    drive(again, gpu, 40, 250, measured)
    drive(again, gpu, 40, None, measured)
    assert isinstance(again.state, Done) and again.optimal_power_limit == 200
    assert sorted(measured) == [150, 200, 250, 300]
