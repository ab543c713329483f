"""The power-limit machine's transition table: what it lists is what the machine accepts.

`TRANSITIONS` maps (phase, state class, input) to a handler. For every phase and state the
machine can be in, and every input: the input reaches exactly the table's handler when the table
lists it, and is refused (`InvalidTransitionError` naming the state and the input) otherwise.
The table in the module docstring is the same table.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.power_limit import machine as machine_module
from coordinator.power_limit.machine import (
    TRANSITIONS,
    Done,
    EndWindow,
    InvalidTransitionError,
    PowerLimitStateMachine,
    Profiling,
    Ready,
    Warmup,
)
from coordinator.power_limit.transitions import NEW, STARTED
from zeus_agent.models import PowerLimitMeasurement

INPUTS = ("start", "on_step_begin", "on_epoch_end", "record", "discard", "redo", "choose",
          "lengthen", "cap")
VIEWS = {"resume_state", "redos"}
"""Public methods that read the machine without changing it."""
PHASES = {"new": NEW, "started": STARTED}


def _small(search: str = "exhaustive", **kw: Any) -> PowerLimitStateMachine:
    return PowerLimitStateMachine(100, 150, wait_steps=0, warmup_steps=1, profile_steps=2,
                                  pl_step=50, search=search, **kw)


def _until(m: PowerLimitStateMachine, done: Callable[[PowerLimitStateMachine], bool],
           closed: list[str]) -> PowerLimitStateMachine:
    for _ in range(100):
        if done(m):
            return m
        for effect in m.on_step_begin():
            if isinstance(effect, EndWindow) and not effect.cancel:
                closed.append(effect.name)
    raise AssertionError(f"never reached: {m.state!r}")


def configurations() -> list[tuple[str, PowerLimitStateMachine, str | None]]:
    """A machine in each (phase, state) it can be in: (label, machine, a pending window)."""
    out: list[tuple[str, PowerLimitStateMachine, str | None]] = []
    out.append(("new Ready", _small(), None))
    loaded = [PowerLimitMeasurement(power_limit=p, energy=10.0, time=1.0) for p in (150, 100)]
    out.append(("new Done", _small(measurements=loaded), None))
    m = _small()
    m.start()
    out.append(("started Ready", copy.deepcopy(m), None))
    closed: list[str] = []
    m = _until(m, lambda m: isinstance(m.state, Warmup), closed)
    out.append(("started Warmup", copy.deepcopy(m), None))
    # Past the first window: a window is pending while the next warms up and is profiled.
    m = _until(m, lambda m: isinstance(m.state, Warmup) and bool(m.pending_windows), closed)
    out.append(("started Warmup, a window pending", copy.deepcopy(m), closed[-1]))
    m = _until(m, lambda m: isinstance(m.state, Profiling), closed)
    out.append(("started Profiling, a window pending", copy.deepcopy(m), closed[-1]))
    for name in list(m.pending_windows):
        m.record(name, 1.0, 10.0)
    m = _until(m, lambda m: bool(m.pending_windows), closed)
    for name in m.pending_windows:
        m.record(name, 1.0, 10.0)
    assert isinstance(m.state, Done)
    out.append(("started Done", m, None))
    waiting = _small("adaptive")
    waiting.start()
    closed = []
    waiting = _until(waiting, lambda m: bool(m.pending_windows), closed)
    assert waiting.state == Ready(next_power_limit=None, steps=0)
    out.append(("started Ready, waiting for a window", waiting, closed[-1]))
    return out


def _arguments(name: str, m: PowerLimitStateMachine, window: str | None) -> tuple[Any, ...]:
    """Arguments the input would accept if the table lists it in `m`'s state."""
    if name == "record":
        return (window or "unknown", 1.0, 10.0)
    if name in ("discard", "redo"):
        return (window or "unknown",)
    if name == "choose":
        return (m.optimal_power_limit or 150,)
    if name == "lengthen":
        return (5,)
    if name == "cap":
        return (120,)
    return ()


def _key(m: PowerLimitStateMachine, name: str) -> tuple[bool, type, str]:
    return (m.current_power_limit is not None, type(m.state), name)


CONFIGURATIONS = configurations()


def test_configurations_reach_every_phase_and_state_of_the_table() -> None:
    reached = {_key(m, "")[:2] for _, m, _ in CONFIGURATIONS}
    assert reached == {(phase, state) for phase, state, _ in TRANSITIONS}
    assert reached == {(NEW, Ready), (NEW, Done), *((STARTED, s) for s in (Ready, Warmup,
                                                                            Profiling, Done))}


def test_the_table_names_every_input_and_only_handlers_of_the_machine() -> None:
    public = {n for n in dir(PowerLimitStateMachine)
              if not n.startswith("_") and callable(getattr(PowerLimitStateMachine, n))}
    assert public - VIEWS == set(INPUTS)
    assert {name for _, _, name in TRANSITIONS} == set(INPUTS)
    for handler in TRANSITIONS.values():
        assert callable(getattr(PowerLimitStateMachine, handler)), handler


@pytest.mark.parametrize("label, machine, window", CONFIGURATIONS,
                         ids=[c[0] for c in CONFIGURATIONS])
@pytest.mark.parametrize("name", INPUTS)
def test_an_input_reaches_the_tables_handler_or_is_refused(
        label: str, machine: PowerLimitStateMachine, window: str | None, name: str) -> None:
    """Every handler replaced by a spy: the input calls the table's, or none and raises."""
    m = copy.deepcopy(machine)
    called: list[str] = []
    for handler in set(TRANSITIONS.values()):
        setattr(m, handler, lambda *_a, _h=handler: called.append(_h) or [])
    key = _key(m, name)
    args = _arguments(name, m, window)
    if key in TRANSITIONS:
        getattr(m, name)(*args)
        assert called == [TRANSITIONS[key]]
    else:
        with pytest.raises(InvalidTransitionError) as e:
            getattr(m, name)(*args)
        assert called == []
        assert f"Can't handle {name}(" in str(e.value)
        assert f"in state {m.state!r}" in str(e.value)


@pytest.mark.parametrize("label, machine, window", CONFIGURATIONS,
                         ids=[c[0] for c in CONFIGURATIONS])
@pytest.mark.parametrize("name", INPUTS)
def test_the_machine_accepts_exactly_what_the_table_lists(
        label: str, machine: PowerLimitStateMachine, window: str | None, name: str) -> None:
    """With arguments that fit (a pending window, a measured limit), no spies."""
    m = copy.deepcopy(machine)
    key = _key(m, name)
    if key in TRANSITIONS and name in ("record", "discard", "redo") and window is None:
        # Listed, but there is no window to name: the handler refuses the argument.
        with pytest.raises(InvalidTransitionError, match="pending windows are none"):
            getattr(m, name)(*_arguments(name, m, window))
    elif key in TRANSITIONS:
        getattr(m, name)(*_arguments(name, m, window))
    else:
        with pytest.raises(InvalidTransitionError, match=re.escape(type(m.state).__name__)):
            getattr(m, name)(*_arguments(name, m, window))


def _accepted(phase: bool, state: type, name: str) -> bool:
    """The machine's rules, in words: what it accepts in each phase and state."""
    if name == "start":
        return phase == NEW  # once
    if name in ("lengthen", "cap"):
        return True  # any time
    if name == "choose":
        return state is Done  # only once the profile is complete
    if phase == NEW:
        return False  # steps, epochs and windows only after start()
    if name in ("record", "discard", "redo"):
        return state is not Done  # no window is pending once done
    return True  # on_step_begin, on_epoch_end


def test_the_table_lists_every_pair_the_machine_accepts() -> None:
    reached = {_key(m, "")[:2] for _, m, _ in CONFIGURATIONS}
    for phase, state in reached:
        for name in INPUTS:
            listed = (phase, state, name) in TRANSITIONS
            assert listed == _accepted(phase, state, name), (phase, state.__name__, name)


def _documented() -> dict[tuple[bool, type, str], str]:
    doc = machine_module.__doc__
    assert doc is not None
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == [
        "phase", "state", "input", "handler"])
    rows: dict[tuple[bool, type, str], str] = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        phase, state, name, handler = line.split()
        key = (PHASES[phase], getattr(machine_module, state), name)
        assert key not in rows, f"documented twice: {line.strip()}"
        rows[key] = handler
    return rows


def test_the_module_docstring_documents_the_table() -> None:
    documented = _documented()
    assert documented == dict(TRANSITIONS)
    assert list(documented) == list(TRANSITIONS)  # (in the same order, to read side by side)
