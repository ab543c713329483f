"""Pipeline computation DAGs for the frequency planner (Perseus, SOSP '24). Pure.

A pipeline schedule says, for each stage, the order in which it runs its instructions (one
forward and one backward per microbatch for synchronous 1F1B), and which instructions of other
stages each one waits for. `build_dag` turns a schedule into a `PipelineDAG`: one node per
instruction, an edge from every instruction to the next one of the same stage (a GPU runs one
instruction at a time) and the schedule's cross-stage edges (activations and gradients).

New schedules (interleaved 1F1B, activation recomputation, ...) implement the small
`PipelineSchedule` protocol: `num_stages`, `num_microbatches`, `stage_order(stage)` and
`cross_stage_edges()`. The planner only needs the DAG and each node's (stage, instruction).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from zeus_agent.pipeline_order import BACKWARD, FORWARD, one_f_one_b

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Node",
    "PipelineDAG",
    "PipelineSchedule",
    "Synchronous1F1B",
    "build_dag",
]


@dataclass(frozen=True, order=True)
class Node:
    """One instruction of one iteration: stage, instruction name, microbatch."""

    stage: int
    instruction: str
    microbatch: int


class PipelineSchedule(Protocol):
    """What a schedule tells the DAG builder."""

    @property
    def num_stages(self) -> int:
        """Pipeline stages S."""
        ...

    @property
    def num_microbatches(self) -> int:
        """Microbatches M per iteration."""
        ...

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """The (instruction, microbatch) pairs stage `stage` runs, in execution order."""
        ...

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        """Dependencies between instructions of different stages (or of different kinds)."""
        ...


@dataclass(frozen=True)
class Synchronous1F1B:
    """Synchronous 1F1B (DeepSpeed / Megatron's default pipeline schedule).

    Cross-stage edges: forward(s, m) -> forward(s+1, m), backward(s+1, m) -> backward(s, m),
    and forward(S-1, m) -> backward(S-1, m) (the last stage turns around).
    """

    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        """Check the shape."""
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ValueError(
                f"need num_stages >= 1 and num_microbatches >= 1, got {self.num_stages} and "
                f"{self.num_microbatches}"
            )

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """Stage `stage`'s 1F1B order (`zeus_agent.pipeline_order`, as the trainers run it)."""
        return one_f_one_b(stage, self.num_stages, self.num_microbatches)

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        """Activations forward, gradients backward, the last stage's turnaround."""
        last = self.num_stages - 1
        for m in range(self.num_microbatches):
            for s in range(last):
                yield Node(s, FORWARD, m), Node(s + 1, FORWARD, m)
                yield Node(s + 1, BACKWARD, m), Node(s, BACKWARD, m)
            yield Node(last, FORWARD, m), Node(last, BACKWARD, m)


@dataclass(frozen=True)
class PipelineDAG:
    """An iteration's instructions and their dependencies.

    Attributes:
        nodes: Every instruction, numbered stage by stage in execution order.
        stage_nodes: For each stage, its node indices in execution order.
        preds: For each node, the indices of the nodes it waits for (sorted).
        succs: For each node, the indices of the nodes waiting for it (sorted).
        topo_order: The node indices in a topological order.
    """

    nodes: tuple[Node, ...]
    stage_nodes: tuple[tuple[int, ...], ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    topo_order: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return len(self.stage_nodes)

    def edges(self) -> Iterator[tuple[int, int]]:
        """Every dependency as (from, to) node indices."""
        for v, ps in enumerate(self.preds):
            for u in ps:
                yield u, v

    def longest_path(self, durations: Sequence[float]) -> float:
        """The iteration time: the longest path when node `i` takes `durations[i]`."""
        finish = [0.0] * len(self.nodes)
        preds = self.preds
        for v in self.topo_order:
            ps = preds[v]
            start = max(finish[u] for u in ps) if ps else 0.0
            finish[v] = start + durations[v]
        return max(finish, default=0.0)


def _a_cycle(preds: Sequence[Sequence[int]], indegree: Sequence[int]) -> list[int]:
    """One cycle among the nodes Kahn's algorithm left (each waits for another of them)."""
    v = next(i for i, d in enumerate(indegree) if d > 0)
    seen: dict[int, int] = {}
    path: list[int] = []
    while v not in seen:
        seen[v] = len(path)
        path.append(v)
        v = next(u for u in preds[v] if indegree[u] > 0)
    return path[seen[v]:][::-1]


def build_dag(schedule: PipelineSchedule) -> PipelineDAG:
    """Build the DAG of one iteration of `schedule`.

    Raises:
        ValueError: The schedule names an instruction twice, a cross-stage edge names an
            instruction no stage runs, or the dependencies form a cycle (a deadlocking schedule).
    """
    nodes: list[Node] = []
    index: dict[Node, int] = {}
    stage_nodes: list[tuple[int, ...]] = []
    for stage in range(schedule.num_stages):
        ids: list[int] = []
        for name, mb in schedule.stage_order(stage):
            node = Node(stage, name, mb)
            if node in index:
                raise ValueError(f"stage {stage} runs {name} of microbatch {mb} twice")
            index[node] = len(nodes)
            ids.append(len(nodes))
            nodes.append(node)
        stage_nodes.append(tuple(ids))
    pred_sets: list[set[int]] = [set() for _ in nodes]
    for chain in stage_nodes:
        for first, second in zip(chain, chain[1:], strict=False):
            pred_sets[second].add(first)
    for src, dst in schedule.cross_stage_edges():
        if src not in index or dst not in index:
            missing = src if src not in index else dst
            raise ValueError(f"a cross-stage edge names {missing}, which no stage runs")
        pred_sets[index[dst]].add(index[src])
    preds = tuple(tuple(sorted(p)) for p in pred_sets)
    succ_lists: list[list[int]] = [[] for _ in nodes]
    for v, ps in enumerate(preds):
        for u in ps:
            succ_lists[u].append(v)
    # Kahn's algorithm (deterministic).
    indegree = [len(p) for p in preds]
    ready = [v for v, d in enumerate(indegree) if d == 0]
    order: list[int] = []
    while ready:
        done = ready.pop()
        order.append(done)
        for w in succ_lists[done]:
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    if len(order) != len(nodes):
        cycle = _a_cycle(preds, indegree)
        where = " -> ".join(f"rank {nodes[v].stage}'s {nodes[v].instruction} (microbatch "
                            f"{nodes[v].microbatch})" for v in cycle[:4])
        raise ValueError(f"the schedule's dependencies form a cycle (it would deadlock): "
                         f"{where}{' -> ...' if len(cycle) > 4 else ''}")
    return PipelineDAG(
        nodes=tuple(nodes),
        stage_nodes=tuple(stage_nodes),
        preds=preds,
        succs=tuple(tuple(sorted(s)) for s in succ_lists),
        topo_order=tuple(order),
    )
