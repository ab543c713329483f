"""What the pipeline adapters share: where events go, the step gate, and undoable patches.

The adapters for `torch.distributed.pipelining` (`pipelining`), DeepSpeed (`deepspeed`) and
Megatron-core (`megatron`) each wrap a framework's compute entry points; this module holds the
parts that do not depend on the framework:

* `PipelineEvents`: what receives the events, with `PerseusOptimizer`'s method names, so the
  drop-in can be passed as is (it then checks the instructions against the pushed schedule).
* `EmitEvents`: the default receiver, `zeus_agent.emit`'s module-level calls (looked up at each
  call, so a test or a later `emit.init` is honoured).
* `StepGate`: the state of one instrumentation: whether a training step is running (actions
  outside one, as in an evaluation pass, are not reported: the planner sees iterations only),
  per-step microbatch counters for frameworks whose calls carry no microbatch, and the name an
  action gets (`kind:stage:microbatch`, or Zeus 0.16's bare `forward`/`backward`).
* `Patch`: one attribute replaced on an object, restored by `restore()`.
* `Instrumentation`: an adapter's handle, the patches it installed, undone by `remove()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from zeus_agent.pipeline_order import BACKWARD, FORWARD, format_action

__all__ = ["EmitEvents", "Instrumentation", "Patch", "PipelineEvents", "StepGate"]

_MISSING = object()


class PipelineEvents(Protocol):
    """Receives a pipeline rank's events (`PerseusOptimizer` is one)."""

    def on_step_begin(self) -> None:
        """A training step begins."""

    def on_step_end(self) -> None:
        """The training step ends."""

    def on_instruction_begin(self, name: str) -> None:
        """A compute action named `name` begins."""

    def on_instruction_end(self, name: str) -> None:
        """The compute action named `name` ends."""


class EmitEvents:
    """Send the events through `zeus_agent.emit`'s default publisher."""

    def on_step_begin(self) -> None:
        """`emit.step_begin()`."""
        from zeus_agent import emit

        emit.step_begin()

    def on_step_end(self) -> None:
        """`emit.step_end()`."""
        from zeus_agent import emit

        emit.step_end()

    def on_instruction_begin(self, name: str) -> None:
        """`emit.instruction_begin(name)`."""
        from zeus_agent import emit

        emit.instruction_begin(name)

    def on_instruction_end(self, name: str) -> None:
        """`emit.instruction_end(name)`."""
        from zeus_agent import emit

        emit.instruction_end(name)


@dataclass
class StepGate:
    """One instrumentation's state: in a step or not, microbatch counters, naming.

    Attributes:
        events: Where the events go.
        bare_names: Report Zeus 0.16's bare `forward`/`backward` (one stage per rank, full
            backwards only) instead of `kind:stage:microbatch`.
        steps: Training steps reported so far.
    """

    events: PipelineEvents
    bare_names: bool = False
    steps: int = 0
    _active: bool = False
    _counters: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether a training step is running (actions are reported only then)."""
        return self._active

    def name(self, kind: str, stage: int, microbatch: int) -> str:
        """The instruction name of one action.

        Raises:
            ValueError: A split backward with `bare_names` (Zeus 0.16 has no name for it), or
                what `format_action` rejects.
        """
        if self.bare_names:
            if kind not in (FORWARD, BACKWARD):
                raise ValueError(
                    f"a {kind} action has no bare Zeus 0.16 name; instrument without "
                    "bare_names to report kind:stage:microbatch")
            return kind
        return format_action(kind, stage, microbatch)

    def next_microbatch(self, kind: str, stage: int) -> int:
        """Number the actions of one kind on one stage in the order they run this step."""
        key = (kind, stage)
        number = self._counters.get(key, 0)
        self._counters[key] = number + 1
        return number

    def run_step(self, training: bool, call: Callable[[], Any]) -> Any:
        """Run one call of the framework's step, reported as a step when `training`.

        A step that raises is not ended (its iteration is incomplete); the exception
        propagates unchanged. A nested step (a framework's step calling itself) is not
        reported again.
        """
        if not training or self._active:
            return call()
        self._counters.clear()
        self.events.on_step_begin()
        self._active = True
        try:
            result = call()
        finally:
            self._active = False
        self.steps += 1
        self.events.on_step_end()
        return result

    def run_action(self, name: Callable[[], str], call: Callable[[], Any]) -> Any:
        """Run one compute action, reported (named by `name()`) when a step is running."""
        if not self._active:
            return call()
        instruction = name()
        self.events.on_instruction_begin(instruction)
        try:
            return call()
        finally:
            self.events.on_instruction_end(instruction)


@dataclass
class Patch:
    """One attribute of `target` replaced by a wrapper; `restore()` puts the old one back.

    An attribute the object held itself (in its `__dict__`: an instance attribute, a module's
    function) is put back; one it inherited from its class is removed again, so the class's
    own shows through.
    """

    target: Any
    attribute: str
    previous: Any = _MISSING

    @classmethod
    def install(cls, target: Any, attribute: str, wrapper: Any) -> Patch:
        """Set `target.attribute = wrapper`, remembering what to restore."""
        own = getattr(target, "__dict__", {})
        patch = cls(target, attribute, own.get(attribute, _MISSING))
        setattr(target, attribute, wrapper)
        return patch

    def restore(self) -> None:
        """Undo `install` (idempotent)."""
        if self.previous is _MISSING:
            if self.attribute in getattr(self.target, "__dict__", {}):
                delattr(self.target, self.attribute)
        else:
            setattr(self.target, self.attribute, self.previous)


class Instrumentation:
    """The wrappers an adapter installed; `remove()` (or leaving a `with`) undoes them.

    Attributes:
        gate: Step state and naming (`gate.steps`: training steps reported so far).
    """

    def __init__(self, gate: StepGate) -> None:
        self.gate = gate
        self._patches: list[Patch] = []

    @property
    def installed(self) -> bool:
        """Whether the wrappers are in place."""
        return bool(self._patches)

    def add(self, patch: Patch) -> None:
        """Keep an installed patch, to be undone by `remove()`."""
        self._patches.append(patch)

    def remove(self) -> None:
        """Put every patched attribute back, in reverse order (idempotent)."""
        while self._patches:
            self._patches.pop().restore()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
