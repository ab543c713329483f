"""DeepSpeed's `PipelineEngine`: every `ForwardPass` and `BackwardPass` reported as an instruction.

    engine, _, _, _ = deepspeed.initialize(model=pipeline_module, ...)
    handle = instrument(engine)              # or instrument(engine, optimizer=perseus)
    for _ in range(steps):
        engine.train_batch()                 # step_begin, one instruction per pass, step_end

DeepSpeed's engine (`deepspeed/runtime/pipe/engine.py`) runs a step as a list of schedule
instructions: `_exec_schedule` looks each one's type up in the class attribute
`_INSTRUCTION_MAP` and calls the method found with the instruction's kwargs (`buffer_id`).
`instrument` gives this engine object its own copy of that map in which the `ForwardPass` and
`BackwardPass` entries are wrapped (the classes are found by name, so the adapter needs no
import of DeepSpeed), and wraps `engine.train_batch` for the step events; `eval_batch` and
anything else run outside `train_batch` report nothing. `remove()` deletes both instance
attributes again, so the class's own show through.

Names: `forward:S:M` / `backward:S:M` with `S` the engine's `stage_id` and `M` the
microbatch, numbered in the order the passes run in the step (DeepSpeed's `TrainSchedule` is
1F1B, one stage per rank: its forwards and its backwards each run in microbatch order; the
instructions carry only a buffer id, which is reused). `bare_names=True` reports Zeus 0.16's
`forward`/`backward`, the names the Perseus paper's DeepSpeed fork reported.

Tested against a stand-in with the real engine's names and call shape, not against DeepSpeed
itself (it is not installed in this project's test environment).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zeus_agent.integrations.pipeline_events import (
    EmitEvents,
    Instrumentation,
    Patch,
    PipelineEvents,
    StepGate,
)
from zeus_agent.pipeline_order import BACKWARD, FORWARD

__all__ = ["DeepSpeedInstrumentation", "instrument"]

_KINDS = {"ForwardPass": FORWARD, "BackwardPass": BACKWARD}
"""DeepSpeed's compute instruction classes (`deepspeed/runtime/pipe/schedule.py`)."""


class DeepSpeedInstrumentation(Instrumentation):
    """The wrappers `instrument` installed on one engine; `remove()` undoes them.

    Attributes:
        engine: The instrumented `PipelineEngine`.
        gate: Step state and naming (`gate.steps`: training steps reported so far).
    """

    def __init__(self, engine: Any, gate: StepGate) -> None:
        super().__init__(gate)
        self.engine = engine



def _wrap_pass(gate: StepGate, engine: Any, kind: str,
               method: Callable[..., Any]) -> Callable[..., Any]:
    """One `_INSTRUCTION_MAP` entry (an unbound method called as `method(engine, **kwargs)`)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        def name() -> str:
            stage = int(self.stage_id)
            return gate.name(kind, stage, gate.next_microbatch(kind, stage))

        return gate.run_action(name, lambda: method(self, *args, **kwargs))

    return wrapper


def instrument(
    engine: Any,
    optimizer: PipelineEvents | None = None,
    *,
    bare_names: bool = False,
) -> DeepSpeedInstrumentation:
    """Report a DeepSpeed `PipelineEngine`'s training steps and compute passes.

    Args:
        engine: The engine `deepspeed.initialize` returned for a `PipelineModule`.
        optimizer: Where the events go (a `PerseusOptimizer`, or anything with its four
            `on_*` methods); default `zeus_agent.emit`.
        bare_names: Report Zeus 0.16's `forward`/`backward`.

    Returns:
        The handle; `remove()` undoes the instrumentation.

    Raises:
        TypeError: The engine has no `_INSTRUCTION_MAP` holding `ForwardPass` and
            `BackwardPass`, or no `train_batch`.
        ValueError: The engine is instrumented already.
    """
    table = getattr(engine, "_INSTRUCTION_MAP", None)
    kinds = {cls: _KINDS[getattr(cls, "__name__", "")] for cls in (table or {})
             if getattr(cls, "__name__", "") in _KINDS}
    if not isinstance(table, dict) or len(kinds) != len(_KINDS):
        raise TypeError(
            f"{type(engine).__name__} is not a DeepSpeed PipelineEngine: no _INSTRUCTION_MAP "
            "with ForwardPass and BackwardPass")
    if "_INSTRUCTION_MAP" in getattr(engine, "__dict__", {}):
        raise ValueError("this engine is instrumented already (it has its own _INSTRUCTION_MAP)")
    train_batch = getattr(engine, "train_batch", None)
    if train_batch is None:
        raise TypeError(f"{type(engine).__name__} has no train_batch")
    gate = StepGate(optimizer or EmitEvents(), bare_names=bare_names)
    handle = DeepSpeedInstrumentation(engine, gate)
    own = dict(table)
    for cls, kind in kinds.items():
        own[cls] = _wrap_pass(gate, engine, kind, table[cls])

    @functools.wraps(train_batch)
    def train_wrapper(*args: Any, **kwargs: Any) -> Any:
        return gate.run_step(True, lambda: train_batch(*args, **kwargs))

    handle.add(Patch.install(engine, "_INSTRUCTION_MAP", own))
    handle.add(Patch.install(engine, "train_batch", train_wrapper))
    return handle
