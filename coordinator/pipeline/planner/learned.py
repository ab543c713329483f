"""A pipeline schedule learned from each rank's observed instruction order. Pure.

Trainers run many schedules (1F1B, GPipe, interleaved 1F1B, looped BFS, zero bubble); the
planner need not know them by name: each rank's order of one iteration, plus the data
dependencies every pipeline has, is the iteration's DAG (`build_dag`):

* a stage's forward of microbatch m after the previous stage's forward of m (activations);
* a stage's backward (or backward_input) of m after the next stage's (gradients);
* the last stage's backward of m after its forward of m (the turnaround);
* a backward_weight after the backward_input of the same stage and microbatch;
* each rank's own order as a chain (a GPU runs one action at a time).

Names are `zeus_agent.pipeline_order`'s: `kind:stage:microbatch`, where stage is the
(virtual) stage, run by whichever rank reported it (ranks run several under interleaved and
V-shaped schedules); or bare `forward`/`backward` (Zeus 0.16: the rank's own stage, the k-th
of a kind being microbatch k). Other bare names are not pipeline actions: left out of the DAG.
A schedule the DAG cannot describe (an unknown kind, an action run twice, a stage two ranks
claim, a microbatch count that differs between stages, a dependency nobody runs) raises
`ScheduleError`, whose text names the problem.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from coordinator.pipeline.planner.dag import Node
from zeus_agent.pipeline_order import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    action_kind,
    parse_action,
)

__all__ = ["LearnedSchedule", "ScheduleError", "node_kind"]

_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}


class ScheduleError(ValueError):
    """The observed orders are not a pipeline schedule the planner can model."""


def node_kind(node: Node) -> str:
    """The action kind of a DAG node (its profile's instruction)."""
    return action_kind(node.instruction) or node.instruction


@dataclass(frozen=True)
class LearnedSchedule:
    """Each rank's pipeline actions in order and the stages they belong to.

    Attributes:
        names: Per rank (pipeline position), its pipeline action names in execution order.
        actions: The same, parsed (bare names numbered by count).
        stage_rank: Per (virtual) stage, the rank that runs it.
        num_microbatches: Microbatches per iteration (the same for every stage).
    """

    names: tuple[tuple[str, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    stage_rank: tuple[int, ...]
    num_microbatches: int

    @classmethod
    def from_orders(cls, orders: Sequence[Sequence[str]]) -> LearnedSchedule:
        """Learn the schedule from each rank's instruction names of one iteration.

        Raises:
            ScheduleError: The orders are not a schedule the planner can model (see the
                module docstring).
        """
        if not orders:
            raise ScheduleError("no ranks")
        names, actions = _parse(orders)
        stage_rank = _stage_ranks(actions)
        micro = _check_microbatches(actions, len(stage_rank))
        return cls(names, actions, stage_rank, micro)

    @property
    def num_stages(self) -> int:
        """Ranks (GPU chains) of the pipeline; each may run several virtual stages."""
        return len(self.names)

    @property
    def num_virtual_stages(self) -> int:
        """(Virtual) stages the model is cut into."""
        return len(self.stage_rank)

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """Rank `stage`'s (name, microbatch) pairs in execution order."""
        return [(n, a.microbatch) for n, a in zip(self.names[stage], self.actions[stage],
                                                  strict=True)]

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        """The data dependencies (module docstring)."""
        node: dict[Action, Node] = {}
        for rank, (names, actions) in enumerate(zip(self.names, self.actions, strict=True)):
            for name, action in zip(names, actions, strict=True):
                node[action] = Node(rank, name, action.microbatch)
        last = len(self.stage_rank) - 1
        for m in range(self.num_microbatches):
            grads = [node.get(Action(BACKWARD, v, m)) or node[Action(BACKWARD_INPUT, v, m)]
                     for v in range(last + 1)]
            for v in range(last):
                yield node[Action(FORWARD, v, m)], node[Action(FORWARD, v + 1, m)]
                yield grads[v + 1], grads[v]
            yield node[Action(FORWARD, last, m)], grads[last]
            for v in range(last + 1):
                weight = node.get(Action(BACKWARD_WEIGHT, v, m))
                if weight is not None:
                    yield node[Action(BACKWARD_INPUT, v, m)], weight

    def letters(self, rank: int, limit: int = 40) -> str:
        """A short view of a rank's order: F, B, I, W with the stage and microbatch."""
        text = " ".join(f"{_LETTER[a.kind]}{a.stage}.{a.microbatch}" for a in self.actions[rank])
        return text if len(text) <= limit else text[:limit] + "..."


def _parse(
    orders: Sequence[Sequence[str]],
) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[Action, ...], ...]]:
    """Each rank's pipeline names and actions; bare names become the rank's own stage."""
    names: list[tuple[str, ...]] = []
    actions: list[tuple[Action, ...]] = []
    styles: dict[bool, int] = {}
    for rank, order in enumerate(orders):
        kept: list[str] = []
        parsed: list[Action] = []
        counts = {FORWARD: 0, BACKWARD: 0}
        seen: set[Action] = set()
        for name in order:
            try:
                kind = action_kind(name)
                action = parse_action(name)
            except ValueError as e:
                raise ScheduleError(f"rank {rank}: {e}") from None
            if kind is None:
                continue
            styles.setdefault(action is not None, rank)
            if action is None:
                action = Action(kind, rank, counts[kind])
                counts[kind] += 1
            if action in seen:
                raise ScheduleError(f"rank {rank} runs {name} twice in one iteration")
            seen.add(action)
            kept.append(name)
            parsed.append(action)
        if not parsed:
            raise ScheduleError(f"rank {rank} runs no pipeline action (forward, backward, ...)")
        names.append(tuple(kept))
        actions.append(tuple(parsed))
    if len(styles) > 1:
        raise ScheduleError(
            f"rank {styles[False]} reports bare forward/backward names and rank {styles[True]} "
            "kind:stage:microbatch names: one schedule needs one naming")
    return tuple(names), tuple(actions)


def _stage_ranks(actions: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Which rank runs each (virtual) stage; stages must be 0..N-1, each on one rank."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            other = owner.setdefault(action.stage, rank)
            if other != rank:
                raise ScheduleError(
                    f"stage {action.stage} runs on rank {other} and on rank {rank}: a stage "
                    "belongs to one rank of the pipeline")
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        gap = next(s for s in range(len(stages) + 1) if s not in owner)
        raise ScheduleError(f"no rank runs stage {gap} (ranks run stages "
                            f"{_span(stages)}): a dependency nobody runs")
    return tuple(owner[s] for s in stages)


def _check_microbatches(actions: Sequence[Sequence[Action]], num_stages: int) -> int:
    """The microbatch count M: every stage runs forwards and backwards of 0..M-1."""
    by_kind: dict[tuple[int, str], set[int]] = {}
    for row in actions:
        for a in row:
            by_kind.setdefault((a.stage, a.kind), set()).add(a.microbatch)
    expected = set(range(len(by_kind.get((0, FORWARD), ()))))
    if not expected:
        raise ScheduleError("stage 0 runs no forward")
    for stage in range(num_stages):
        fwd = by_kind.get((stage, FORWARD), set())
        full = by_kind.get((stage, BACKWARD), set())
        split = by_kind.get((stage, BACKWARD_INPUT), set())
        weight = by_kind.get((stage, BACKWARD_WEIGHT), set())
        if fwd != expected:
            raise ScheduleError(
                f"stage {stage} runs forwards of microbatches {_span(fwd)}, stage 0 of "
                f"{_span(expected)}: the microbatch count must be the same everywhere")
        if full & split:
            raise ScheduleError(f"stage {stage} runs both a backward and a backward_input of "
                                f"microbatch {min(full & split)}")
        if full | split != expected:
            missing = min(expected - (full | split), default=None)
            what = (f"no backward of microbatch {missing}" if missing is not None else
                    f"backwards of microbatches {_span((full | split) - expected)} it never "
                    "ran forward")
            raise ScheduleError(f"stage {stage} runs {what}")
        if not weight <= split:
            raise ScheduleError(f"stage {stage} runs a backward_weight of microbatch "
                                f"{min(weight - split)} without its backward_input")
    return len(expected)


def _span(values: set[int] | Sequence[int]) -> str:
    """A short text for a set of indices."""
    ordered = sorted(values)
    if not ordered:
        return "none"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    text = ", ".join(str(v) for v in ordered[:8])
    return text + (", ..." if len(ordered) > 8 else "")
