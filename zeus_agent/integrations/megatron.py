"""Megatron-core's pipeline schedules: every `forward_step`/`backward_step` reported.

    from megatron.core.pipeline_parallel import schedules
    handle = instrument()                   # or instrument(optimizer=perseus)
    forward_backward = schedules.get_forward_backward_func()   # after instrument()
    for _ in range(steps):
        forward_backward(forward_step_func=..., ...)   # step_begin, instructions, step_end
        optimizer.step()

Megatron-core's schedules (`megatron/core/pipeline_parallel/schedules.py`) run every
microbatch's compute through the module functions `forward_step(...)` and
`backward_step(...)`, which the schedule functions look up in the module's globals at each
call. `instrument` replaces those two module attributes with wrappers, and the three
`forward_backward_*` functions (no pipelining, 1F1B, interleaved) with wrappers that report a
step (a call with `forward_only=True`, an evaluation, reports nothing). Take the function
from `get_forward_backward_func()` after `instrument()`: one fetched before holds the
unwrapped function. `remove()` puts the module's own functions back.

Names: `forward:S:M` / `backward:S:M`. `S` is the virtual stage: with a virtual pipeline, model
chunk `c` on pipeline rank `r` of `p` is stage `c * p + r` (the layers Megatron gives it);
the chunk is the `vp_stage` argument where Megatron passes one, else the virtual rank the
schedule sets in `parallel_state` before each call. `M` is the `current_microbatch` argument
where passed, else the microbatch numbered in the order the stage runs that kind of pass in
the step (Megatron runs each chunk's forwards, and its backwards, in microbatch order).
`bare_names=True` reports Zeus 0.16's `forward`/`backward`.

Tested against a stand-in module with the real one's names and call shape, not against
Megatron-LM itself (it is not installed in this project's test environment).
"""

from __future__ import annotations

import functools
import importlib
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

__all__ = ["MegatronInstrumentation", "instrument"]

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
STEP_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
"""The schedule functions one training iteration calls (those present are wrapped)."""


class MegatronInstrumentation(Instrumentation):
    """The wrappers `instrument` installed on the schedules module; `remove()` undoes them.

    Attributes:
        schedules: The instrumented module.
        gate: Step state and naming (`gate.steps`: training steps reported so far).
    """

    def __init__(self, schedules: Any, gate: StepGate) -> None:
        super().__init__(gate)
        self.schedules = schedules



def _stage(parallel_state: Any, vp_stage: Any) -> int:
    """The virtual stage now running: `chunk * pp_size + pp_rank`, or `pp_rank` without VP."""
    rank = int(parallel_state.get_pipeline_model_parallel_rank())
    chunk = vp_stage
    if chunk is None:
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if vp_size is not None:
            chunk = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if chunk is None:
        return rank
    return int(chunk) * int(parallel_state.get_pipeline_model_parallel_world_size()) + rank


def _wrap_pass(gate: StepGate, parallel_state: Any, kind: str,
               function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        def name() -> str:
            stage = _stage(parallel_state, kwargs.get("vp_stage"))
            given = kwargs.get("current_microbatch")
            counted = gate.next_microbatch(kind, stage)
            return gate.name(kind, stage, counted if given is None else int(given))

        return gate.run_action(name, lambda: function(*args, **kwargs))

    return wrapper


def _wrap_step(gate: StepGate, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        training = not kwargs.get("forward_only", False)
        return gate.run_step(training, lambda: function(*args, **kwargs))

    return wrapper


def instrument(
    schedules: Any | None = None,
    optimizer: PipelineEvents | None = None,
    *,
    bare_names: bool = False,
) -> MegatronInstrumentation:
    """Report Megatron-core's training iterations and compute passes.

    Args:
        schedules: The schedules module; default `megatron.core.pipeline_parallel.schedules`.
        optimizer: Where the events go (a `PerseusOptimizer`, or anything with its four
            `on_*` methods); default `zeus_agent.emit`.
        bare_names: Report Zeus 0.16's `forward`/`backward` (no virtual pipeline).

    Returns:
        The handle; `remove()` undoes the instrumentation.

    Raises:
        ImportError: No `schedules` given and Megatron-core is not installed.
        TypeError: The module lacks `forward_step`, `backward_step` or `parallel_state`.
        ValueError: The module is instrumented already (by an earlier, unremoved handle).
    """
    module = importlib.import_module(SCHEDULES_MODULE) if schedules is None else schedules
    parallel_state = getattr(module, "parallel_state", None)
    passes = {"forward_step": FORWARD, "backward_step": BACKWARD}
    if parallel_state is None or not all(callable(getattr(module, n, None)) for n in passes):
        raise TypeError(
            f"{getattr(module, '__name__', module)!r} is not Megatron-core's schedules module "
            "(forward_step, backward_step, parallel_state)")
    if getattr(module.forward_step, "__zeus_megatron__", False):
        raise ValueError("Megatron's schedules are instrumented already; remove() that first")
    gate = StepGate(optimizer or EmitEvents(), bare_names=bare_names)
    handle = MegatronInstrumentation(module, gate)
    wrappers = {n: _wrap_pass(gate, parallel_state, kind, getattr(module, n))
                for n, kind in passes.items()}
    wrappers.update({n: _wrap_step(gate, getattr(module, n))
                     for n in STEP_FUNCTIONS if callable(getattr(module, n, None))})
    for n, wrapper in wrappers.items():
        wrapper.__zeus_megatron__ = True  # type: ignore[attr-defined]
        handle.add(Patch.install(module, n, wrapper))
    return handle
