"""Differential test: our PowerLimitStateMachine against an oracle that follows Zeus 0.16's
GlobalPowerLimitOptimizer line by line, on random parameters and random sequences of
step and epoch events. Effects must come out identical, in order, and so must the optimum.

The oracle keeps Zeus 0.16's milliwatt arithmetic and its mutable step counters; it only
replaces NVML and the monitor by lists. Zeus 0.16 crashes with warmup_steps=0, so the oracle is
only asked about warmup_steps >= 1.
"""

from __future__ import annotations

from hypothesis import event as note_event
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.power_limit import (
    BeginWindow,
    EndWindow,
    Energy,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitStateMachine,
    SetPowerLimit,
    Time,
    ZeusCost,
)


def measure(power_limit_w: int) -> tuple[float, float]:
    """A deterministic, non-monotone (time, energy) per limit, with ties now and then."""
    time = 10.0 + (300 - power_limit_w) * 0.013 + (power_limit_w % 50 == 0) * 0.2
    energy = 1000.0 - power_limit_w * 0.9 + (power_limit_w % 75) * 1.5
    return round(time, 1), round(energy, 0)


class SeedOracle:
    """Zeus 0.16's state machine with NVML and the monitor replaced by an effect list."""

    def __init__(self, min_w, max_w, selector, wait_steps, warmup_steps, profile_steps, pl_step):
        self.selector = selector
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.pl_step = pl_step * 1000
        self.power_limits = list(range(max_w * 1000, min_w * 1000 - 1, -self.pl_step))
        self.current_power_limit = 0
        self.measurements: list[PowerLimitMeasurement] = []
        self.effects: list[tuple] = []
        self.state = ["Ready", self.power_limits[0], wait_steps + 1]
        self.optimal: int | None = None
        self._set(max(self.power_limits))

    def _set(self, pl_mw: int) -> None:
        if self.current_power_limit == pl_mw:
            return
        self.effects.append(("set", pl_mw // 1000))
        self.current_power_limit = pl_mw

    def _name(self, pl_mw: int) -> str:
        return f"__GlobalPowerLimitOptimizer_{pl_mw // 1000}"

    def on_epoch_end(self) -> None:
        kind = self.state[0]
        if kind in ("Warmup", "Profiling"):
            if kind == "Profiling":
                self.effects.append(("end", self._name(self.state[1]), True))
            self.state = ["Ready", self.state[1], 1]
            self._set(max(self.power_limits))

    def on_step_begin(self) -> None:
        kind = self.state[0]
        if kind == "Ready":
            self.state[2] -= 1
            if self.state[2] == 0:
                self._set(self.state[1])
                self.state = ["Warmup", self.state[1], self.warmup_steps]
        elif kind == "Warmup":
            self.state[2] -= 1
            if self.state[2] == 0:
                self.state = ["Profiling", self.state[1], self.profile_steps]
                self.effects.append(("begin", self._name(self.state[1])))
        elif kind == "Profiling":
            self.state[2] -= 1
            if self.state[2] == 0:
                pl = self.state[1]
                self.effects.append(("end", self._name(pl), False))
                time, energy = measure(pl // 1000)
                self.measurements.append(
                    PowerLimitMeasurement(power_limit=pl // 1000, energy=energy, time=time)
                )
                index = self.power_limits.index(pl)
                if index == len(self.power_limits) - 1:
                    self.optimal = self.selector.select(self.measurements) * 1000
                    self.state = ["Done", self.optimal]
                    self._set(self.optimal)
                else:
                    nxt = self.power_limits[index + 1]
                    self._set(nxt)
                    self.state = ["Warmup", nxt, self.warmup_steps]


def as_tuples(effects) -> list[tuple]:
    out = []
    for e in effects:
        if isinstance(e, SetPowerLimit):
            out.append(("set", e.watts))
        elif isinstance(e, BeginWindow):
            out.append(("begin", e.name))
        elif isinstance(e, EndWindow):
            out.append(("end", e.name, e.cancel))
    return out


selectors = st.sampled_from(
    [Energy(), Time(), ZeusCost(0.0), ZeusCost(0.5, world_size=4), ZeusCost(1.0),
     MaxSlowdownConstraint(1.05), MaxSlowdownConstraint(1.5)]
)


@settings(max_examples=300, deadline=None)
@given(
    min_w=st.integers(50, 200),
    span=st.integers(0, 150),
    pl_step=st.integers(20, 60),
    wait_steps=st.integers(0, 4),
    warmup_steps=st.integers(1, 4),
    profile_steps=st.integers(1, 5),
    selector=selectors,
    events=st.lists(st.sampled_from(["step"] * 9 + ["epoch"]), min_size=0, max_size=250),
)
def test_effects_match_zeus_016(
    min_w, span, pl_step, wait_steps, warmup_steps, profile_steps, selector, events
):
    max_w = min_w + span
    oracle = SeedOracle(min_w, max_w, selector, wait_steps, warmup_steps, profile_steps, pl_step)
    machine = PowerLimitStateMachine(
        min_w, max_w, optimum_selector=selector, wait_steps=wait_steps,
        warmup_steps=warmup_steps, profile_steps=profile_steps, pl_step=pl_step,
    )  # fmt: skip
    ours = as_tuples(machine.start())

    def feed(effects):
        out = as_tuples(effects)
        for e in effects:
            if isinstance(e, EndWindow) and not e.cancel:
                limit = int(e.name.rsplit("_", 1)[1])
                out += feed(machine.record(e.name, *measure(limit)))
        return out

    for event in events:
        if event == "step":
            oracle.on_step_begin()
            ours += feed(machine.on_step_begin())
        else:
            oracle.on_epoch_end()
            ours += feed(machine.on_epoch_end())
        assert ours == oracle.effects
    note_event("done" if oracle.optimal is not None else "not done")
    if oracle.optimal is not None:
        assert machine.optimal_power_limit == oracle.optimal // 1000
        assert machine.measurements == oracle.measurements
    else:
        assert machine.optimal_power_limit is None
