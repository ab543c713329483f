"""The power-limit machine's transitions as data, as h11 keeps its tables.

Which method of `PowerLimitStateMachine` handles each input in each phase and state; the
machine's module docstring prints the same table (`tests/core/test_power_limit_transitions.py`
holds the two to each other).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from coordinator.power_limit.states import Done, Profiling, Ready, State, Warmup

__all__ = ["CALLS", "NEW", "STARTED", "TRANSITIONS", "WINDOW_INPUTS"]

NEW, STARTED = False, True
"""The phase of the machine: before `start()` (`new`) or after it (`started`)."""

TRANSITIONS: Final[Mapping[tuple[bool, type[State], str], str]] = {
    (NEW, Ready, "start"): "_start_profiling",
    (NEW, Ready, "lengthen"): "_lengthen",
    (NEW, Ready, "cap"): "_capped",
    (NEW, Done, "start"): "_start_done",
    (NEW, Done, "choose"): "_choose",
    (NEW, Done, "lengthen"): "_lengthen",
    (NEW, Done, "cap"): "_capped",
    (STARTED, Ready, "on_step_begin"): "_step_ready",
    (STARTED, Ready, "on_epoch_end"): "_ignore",
    (STARTED, Ready, "record"): "_record_ready",
    (STARTED, Ready, "discard"): "_discard_ready",
    (STARTED, Ready, "redo"): "_redo_ready",
    (STARTED, Ready, "lengthen"): "_lengthen",
    (STARTED, Ready, "cap"): "_capped",
    (STARTED, Warmup, "on_step_begin"): "_step_warmup",
    (STARTED, Warmup, "on_epoch_end"): "_interrupt",
    (STARTED, Warmup, "record"): "_record",
    (STARTED, Warmup, "discard"): "_discard",
    (STARTED, Warmup, "redo"): "_redo",
    (STARTED, Warmup, "lengthen"): "_lengthen_warmup",
    (STARTED, Warmup, "cap"): "_capped",
    (STARTED, Profiling, "on_step_begin"): "_step_profiling",
    (STARTED, Profiling, "on_epoch_end"): "_interrupt_window",
    (STARTED, Profiling, "record"): "_record",
    (STARTED, Profiling, "discard"): "_discard",
    (STARTED, Profiling, "redo"): "_redo",
    (STARTED, Profiling, "lengthen"): "_lengthen_window",
    (STARTED, Profiling, "cap"): "_capped",
    (STARTED, Done, "on_step_begin"): "_ignore",
    (STARTED, Done, "on_epoch_end"): "_ignore",
    (STARTED, Done, "choose"): "_choose",
    (STARTED, Done, "lengthen"): "_lengthen",
    (STARTED, Done, "cap"): "_capped",
}
"""(phase, state class, input) -> the name of the machine's method that handles the input.

The handler is called with the state, then the input's arguments."""

CALLS: Final[Mapping[str, str]] = {
    "start": "start()",
    "on_step_begin": "on_step_begin()",
    "on_epoch_end": "on_epoch_end()",
    "record": "record({0!r}, time={1!r}, energy={2!r})",
    "discard": "discard({0!r})",
    "redo": "redo({0!r})",
    "choose": "choose({0})",
    "lengthen": "lengthen({0})",
    "cap": "cap({0})",
}
"""How an error names each input's call (formatted with its arguments)."""

WINDOW_INPUTS = frozenset({"record", "discard", "redo"})
"""Inputs naming a closed window: refused, their error lists the pending windows."""
