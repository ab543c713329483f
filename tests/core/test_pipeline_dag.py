"""The pipeline DAG of the frontier planner: 1F1B order, edges, longest path, extensibility."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from coordinator.pipeline.planner.dag import (
    BACKWARD,
    FORWARD,
    Node,
    Synchronous1F1B,
    build_dag,
)
from zeus_agent.gpu.sim.trainers.pipeline import one_f_one_b


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12])
def test_order_matches_simulated_trainer(num_stages: int, microbatches: int) -> None:
    for stage in range(num_stages):
        assert Synchronous1F1B(num_stages, microbatches).stage_order(stage) == one_f_one_b(
            stage, num_stages, microbatches
        )


@pytest.mark.parametrize(("num_stages", "microbatches"), [(2, 1), (3, 4), (4, 6), (8, 12)])
def test_order_matches_lowtime(num_stages: int, microbatches: int) -> None:
    pytest.importorskip("lowtime")
    from lowtime.cost_model import CostModel
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward
    from lowtime.perseus.schedule import Synchronous1F1B as LowtimeSchedule

    class Flat(CostModel):
        def __call__(self, quant_time: int) -> float:
            return 0.0

    options = CandidateExecutionOptions(
        options=[ExecutionOption(real_time=0.01, unit_time=1e-3, cost=1.0, knob=1410)]
    )
    spec = OperationSpec(options=options, cost_model=Flat())
    specs = {Forward: spec, Backward: spec}
    for stage in range(num_stages):
        theirs = [
            (FORWARD if isinstance(op, Forward) else BACKWARD, op.micro_batch_id)
            for op in LowtimeSchedule(num_stages, microbatches, stage, specs)  # type: ignore[arg-type]
        ]
        assert Synchronous1F1B(num_stages, microbatches).stage_order(stage) == theirs


def test_edges_of_a_small_pipeline() -> None:
    dag = build_dag(Synchronous1F1B(3, 4))
    index = {node: i for i, node in enumerate(dag.nodes)}
    edges = {(dag.nodes[u], dag.nodes[v]) for u, v in dag.edges()}
    expected: set[tuple[Node, Node]] = set()
    for stage, ids in enumerate(dag.stage_nodes):
        order = Synchronous1F1B(3, 4).stage_order(stage)
        assert [(dag.nodes[v].instruction, dag.nodes[v].microbatch) for v in ids] == order
        assert all(dag.nodes[v].stage == stage for v in ids)
        for a, b in zip(order, order[1:], strict=False):
            expected.add((Node(stage, *a), Node(stage, *b)))
    for m in range(4):
        for s in range(2):
            expected.add((Node(s, FORWARD, m), Node(s + 1, FORWARD, m)))
            expected.add((Node(s + 1, BACKWARD, m), Node(s, BACKWARD, m)))
        expected.add((Node(2, FORWARD, m), Node(2, BACKWARD, m)))
    assert edges == expected
    assert len(dag.nodes) == 3 * 2 * 4
    position = {v: i for i, v in enumerate(dag.topo_order)}
    assert sorted(dag.topo_order) == list(range(len(dag.nodes)))
    assert all(position[u] < position[v] for u, v in dag.edges())
    assert all(v in dag.succs[u] for u, v in dag.edges())
    assert index[Node(0, FORWARD, 0)] == 0


@pytest.mark.parametrize(("num_stages", "microbatches"), [(1, 1), (2, 3), (4, 4), (4, 8), (8, 5)])
def test_uniform_stages_take_the_textbook_time(num_stages: int, microbatches: int) -> None:
    # Every stage alike, forward f and backward b: (M + S - 1) * (f + b).
    dag = build_dag(Synchronous1F1B(num_stages, microbatches))
    f, b = 1.0, 2.0
    durations = [f if node.instruction == FORWARD else b for node in dag.nodes]
    assert dag.longest_path(durations) == pytest.approx(
        (microbatches + num_stages - 1) * (f + b)
    )


def test_bad_shapes() -> None:
    with pytest.raises(ValueError):
        Synchronous1F1B(0, 4)
    with pytest.raises(ValueError):
        Synchronous1F1B(2, 0)
    with pytest.raises(ValueError):
        Synchronous1F1B(2, 1).stage_order(2)


@dataclass(frozen=True)
class GPipe:
    """All forwards, then all backwards in reverse: another schedule through the protocol."""

    num_stages: int
    num_microbatches: int

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        forwards = [(FORWARD, m) for m in range(self.num_microbatches)]
        return forwards + [(BACKWARD, m) for m in reversed(range(self.num_microbatches))]

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        yield from Synchronous1F1B(self.num_stages, self.num_microbatches).cross_stage_edges()


def test_another_schedule_plugs_in() -> None:
    dag = build_dag(GPipe(2, 3))
    assert len(dag.nodes) == 12
    durations = [1.0] * len(dag.nodes)
    # Forwards: 3 + 1 (pipeline fill); the last stage's backwards start right after its
    # forwards, then stage 0 trails by one.
    assert dag.longest_path(durations) == pytest.approx(4 + 3 + 1)


@dataclass(frozen=True)
class Deadlock:
    num_stages: int = 2
    num_microbatches: int = 1

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        return [(BACKWARD, 0), (FORWARD, 0)]  # Backward before its own forward.

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        yield from Synchronous1F1B(2, 1).cross_stage_edges()


@dataclass(frozen=True)
class Dangling:
    num_stages: int = 1
    num_microbatches: int = 1

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        return [(FORWARD, 0), (BACKWARD, 0)]

    def cross_stage_edges(self) -> Iterator[tuple[Node, Node]]:
        yield Node(0, FORWARD, 0), Node(1, FORWARD, 0)


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="cycle"):
        build_dag(Deadlock())
    with pytest.raises(ValueError, match="no stage runs"):
        build_dag(Dangling())
