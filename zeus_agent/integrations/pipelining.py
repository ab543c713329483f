"""`torch.distributed.pipelining` in one line: every compute action reported as an instruction.

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    handle = instrument(schedule)            # or instrument(schedule, optimizer=perseus)
    for batch in data:
        schedule.step(...)                   # step_begin, one instruction per action, step_end

`instrument` wraps, on this schedule object and its stage objects only (no class is changed,
no schedule code is copied):

* `schedule.step`: `step_begin`/`step_end` around each training step. A step run for
  `schedule.eval()` (no backward) reports nothing, so evaluation never looks like an iteration.
* each stage's `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk`: an
  `instruction_begin`/`instruction_end` pair named `kind:stage:microbatch`
  (`zeus_agent.pipeline_order.format_action`): `forward`, `backward` (a full backward),
  `backward_input` (`backward_one_chunk(full_backward=False)`, a zero-bubble schedule's `I`),
  `backward_weight` (its `W`); the stage is the stage object's `stage_index` (the virtual stage
  on interleaved and V-shape schedules), the microbatch the chunk id torch passes.

This covers every schedule torch 2.13 ships, single-stage (`ScheduleGPipe`, `Schedule1F1B`)
and multi-stage (`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`,
`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`): all run their
compute through those three stage methods. A compute function registered with the runtime's
`register_custom_function` bypasses them and is not reported.

Events go to `zeus_agent.emit` (call `emit.init(...)` first, as for any instrumented loop), or
to the object passed as `optimizer` (`PerseusOptimizer`, which checks each instruction against
the schedule the agent pushed). `bare_names=True` reports Zeus 0.16's `forward`/`backward`
instead (single-stage schedules with full backwards only: GPipe, 1F1B).

torch is not imported by this module: the schedule passed in is inspected by its attributes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from zeus_agent.integrations.pipeline_events import (
    EmitEvents,
    Instrumentation,
    Patch,
    PipelineEvents,
    StepGate,
)
from zeus_agent.pipeline_order import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

__all__ = ["PipelineInstrumentation", "instrument", "schedule_stages"]

_MARK = "__zeus_pipelining__"
"""Attribute set on every wrapper, so a second `instrument` of the same objects is refused."""


def schedule_stages(schedule: Any) -> list[Any]:
    """The stage objects a torch pipeline schedule runs on this rank.

    Raises:
        TypeError: The object has neither a multi-stage schedule's `_stages` nor a
            single-stage schedule's `_stage`.
    """
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = None if stage is None else [stage]
    if not stages:
        raise TypeError(
            f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule "
            "(no _stages or _stage): pass a PipelineScheduleSingle or PipelineScheduleMulti")
    return list(stages)


def _full_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, ...)`'s flag."""
    if "full_backward" in kwargs:
        return bool(kwargs["full_backward"])
    return bool(args[1]) if len(args) > 1 else True


def _chunk_id(args: tuple[Any, ...], kwargs: dict[str, Any], keyword: str) -> int:
    return int(args[0] if args else kwargs[keyword])


class PipelineInstrumentation(Instrumentation):
    """The wrappers `instrument` installed; `remove()` (or leaving a `with`) undoes them.

    Attributes:
        schedule: The instrumented schedule.
        stages: Its stage objects on this rank.
        gate: Step state and naming (`gate.steps`: training steps reported so far).
    """

    def __init__(self, schedule: Any, stages: Sequence[Any], gate: StepGate) -> None:
        super().__init__(gate)
        self.schedule = schedule
        self.stages = list(stages)

    def _install(self) -> None:
        schedule, gate = self.schedule, self.gate
        for obj, attribute in [(schedule, "step"), *self._stage_methods()]:
            if getattr(getattr(obj, attribute, None), _MARK, False):
                raise ValueError(
                    f"{type(obj).__name__}.{attribute} is instrumented already; remove() the "
                    "earlier instrumentation first")
        step = schedule.step

        @functools.wraps(step)
        def step_wrapper(*args: Any, **kwargs: Any) -> Any:
            training = bool(getattr(schedule, "_has_backward", True))
            return gate.run_step(training, lambda: step(*args, **kwargs))

        self._patch(schedule, "step", step_wrapper)
        for stage in self.stages:
            self._wrap_stage(stage)

    def _stage_methods(self) -> list[tuple[Any, str]]:
        names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        return [(stage, name) for stage in self.stages for name in names]

    def _patch(self, obj: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
        setattr(wrapper, _MARK, True)
        self.add(Patch.install(obj, attribute, wrapper))

    def _wrap_stage(self, stage: Any) -> None:
        gate = self.gate
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk

        @functools.wraps(forward)
        def forward_wrapper(*args: Any, **kwargs: Any) -> Any:
            return gate.run_action(
                lambda: gate.name(FORWARD, stage.stage_index,
                                  _chunk_id(args, kwargs, "fwd_chunk_id")),
                lambda: forward(*args, **kwargs))

        @functools.wraps(backward)
        def backward_wrapper(*args: Any, **kwargs: Any) -> Any:
            kind = BACKWARD if _full_backward(args, kwargs) else BACKWARD_INPUT
            return gate.run_action(
                lambda: gate.name(kind, stage.stage_index,
                                  _chunk_id(args, kwargs, "bwd_chunk_id")),
                lambda: backward(*args, **kwargs))

        @functools.wraps(weight)
        def weight_wrapper(*args: Any, **kwargs: Any) -> Any:
            return gate.run_action(
                lambda: gate.name(BACKWARD_WEIGHT, stage.stage_index,
                                  _chunk_id(args, kwargs, "bwd_chunk_id")),
                lambda: weight(*args, **kwargs))

        self._patch(stage, "forward_one_chunk", forward_wrapper)
        self._patch(stage, "backward_one_chunk", backward_wrapper)
        self._patch(stage, "backward_weight_one_chunk", weight_wrapper)


def instrument(
    schedule: Any,
    optimizer: PipelineEvents | None = None,
    *,
    bare_names: bool = False,
) -> PipelineInstrumentation:
    """Report a `torch.distributed.pipelining` schedule's steps and compute actions.

    Args:
        schedule: A schedule object (`Schedule1F1B(...)`, `ScheduleZBVZeroBubble(...)`, ...).
        optimizer: Where the events go: a `PerseusOptimizer` (or any object with its
            `on_step_begin`, `on_step_end`, `on_instruction_begin(name)`,
            `on_instruction_end(name)`); default `zeus_agent.emit`'s module-level calls.
        bare_names: Report Zeus 0.16's `forward`/`backward` (a single-stage schedule only).

    Returns:
        The handle; `remove()` undoes the instrumentation.

    Raises:
        TypeError: `schedule` is not a pipelining schedule.
        ValueError: `bare_names` on a schedule running several stages on this rank, or a
            schedule instrumented already.
    """
    stages = schedule_stages(schedule)
    if bare_names and len(stages) != 1:
        raise ValueError(
            f"bare_names needs one stage per rank; {type(schedule).__name__} runs "
            f"{len(stages)} here: report kind:stage:microbatch names instead")
    handle = PipelineInstrumentation(
        schedule, stages, StepGate(optimizer or EmitEvents(), bare_names=bare_names))
    try:
        handle._install()
    except BaseException:
        handle.remove()
        raise
    return handle
