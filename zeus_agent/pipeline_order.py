"""Synchronous 1F1B: the order in which a pipeline stage runs its instructions. Pure.

Written once, for both sides of a pipeline job: the simulated pipeline trainer runs it
(`zeus_agent.gpu.sim.trainers.pipeline`) and the coordinator's Perseus planner builds its
iteration DAG from it and checks that a rank's observed instructions follow it
(`coordinator.pipeline.planner.dag`, `coordinator.pipeline.schedulers.perseus`). The
instruction names are those a trainer reports ("forward", "backward").

Schedules other than 1F1B (interleaved, looped BFS, zero bubble: PyTorch's
`torch.distributed.pipelining`) run several virtual stages per rank and split a backward into
its input and weight parts. Their instructions carry the action's kind, its (virtual) stage and
its microbatch in the name, `kind:stage:microbatch` (`format_action`, `parse_action`), so the
coordinator can learn each rank's order from what it observes and build the iteration's DAG
from it. The bare names (`forward`, `backward`) keep Zeus 0.16's meaning: the rank's one stage,
microbatches in the order they run.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "KINDS",
    "Action",
    "action_kind",
    "format_action",
    "one_f_one_b",
    "parse_action",
]

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"
"""The input-gradient half of a split backward (zero-bubble schedules: torch's `I`)."""
BACKWARD_WEIGHT = "backward_weight"
"""The weight-gradient half of a split backward (zero-bubble schedules: torch's `W`)."""
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
"""Every action kind an instruction name may carry."""

_MAX_INDEX = 1_000_000
"""Bound on a stage or microbatch index in a name (a wire value; far above any real job)."""


class Action(NamedTuple):
    """One compute action of a pipeline schedule: its kind, (virtual) stage and microbatch."""

    kind: str
    stage: int
    microbatch: int


def format_action(kind: str, stage: int, microbatch: int) -> str:
    """The instruction name of one action: `kind:stage:microbatch` (`forward:3:0`).

    Raises:
        ValueError: An unknown kind or an index out of range.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline action kind {kind!r}; known: {', '.join(KINDS)}")
    for what, value in (("stage", stage), ("microbatch", microbatch)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_INDEX:
            raise ValueError(f"{what} must be an integer in [0, {_MAX_INDEX}), got {value!r}")
    return f"{kind}:{stage}:{microbatch}"


def parse_action(name: str) -> Action | None:
    """The action a `kind:stage:microbatch` name carries; None for a bare name (`forward`).

    Raises:
        ValueError: A name with colons that is not a well-formed action (its text says which
            part is wrong), so a schedule the planner cannot model is named, never guessed.
    """
    if ":" not in name:
        return None
    parts = name.split(":")
    if len(parts) != 3:
        raise ValueError(f"instruction {name!r}: expected kind:stage:microbatch")
    kind, stage, microbatch = parts
    if kind not in KINDS:
        raise ValueError(f"instruction {name!r}: unknown kind {kind!r} "
                         f"(known: {', '.join(KINDS)})")
    numbers = []
    for what, text in (("stage", stage), ("microbatch", microbatch)):
        if not text.isascii() or not text.isdigit() or len(text) > 7:
            raise ValueError(f"instruction {name!r}: {what} {text!r} is not an index")
        numbers.append(int(text))
    if max(numbers) >= _MAX_INDEX:
        raise ValueError(f"instruction {name!r}: index out of range [0, {_MAX_INDEX})")
    return Action(kind, numbers[0], numbers[1])


def action_kind(name: str) -> str | None:
    """The kind of the action an instruction name stands for; None outside the pipeline.

    A bare `forward` or `backward` is its own kind (Zeus 0.16); `kind:stage:microbatch` gives
    its kind; any other bare name (an optimizer step, a loss) is not a pipeline action: it
    runs at the highest clock, outside the planned DAG.

    Raises:
        ValueError: A malformed `kind:stage:microbatch` name, or a bare split-backward kind
            (`backward_input` needs its stage and microbatch: where would it go?).
    """
    action = parse_action(name)
    if action is not None:
        return action.kind
    if name in (FORWARD, BACKWARD):
        return name
    if name in KINDS:
        raise ValueError(f"instruction {name!r}: a split backward needs its stage and "
                         f"microbatch ({name}:stage:microbatch)")
    return None


def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """One stage's synchronous 1F1B instruction order for one iteration.

    Stage `s` of `S` with `M` microbatches runs `min(S - s - 1, M)` warm-up forwards, then
    alternates one forward and one backward while forwards remain, then the remaining
    backwards. Microbatches are numbered from 0 in each direction.

    Args:
        stage: This stage, 0 <= stage < num_stages.
        num_stages: Pipeline stages S >= 1.
        microbatches: Microbatches M >= 1.

    Returns:
        `(instruction, microbatch)` pairs, `2 * M` of them.

    Raises:
        ValueError: An argument out of range.
    """
    if num_stages < 1 or microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"need 0 <= stage < num_stages and microbatches >= 1, got stage={stage}, "
            f"num_stages={num_stages}, microbatches={microbatches}"
        )
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(FORWARD, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order.append((FORWARD, warmup + i))
        order.append((BACKWARD, i))
    order.extend((BACKWARD, mb) for mb in range(microbatches - warmup, microbatches))
    return order
