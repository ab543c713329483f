"""The iteration DAG learned from observed orders, and its plans against the fixed 1F1B's."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.pipeline.planner import evaluate, max_frequency_plan, plan_frontier
from coordinator.pipeline.planner.dag import Node, Synchronous1F1B, build_dag
from coordinator.pipeline.planner.learned import LearnedSchedule, ScheduleError
from coordinator.pipeline.planner.profile import InstructionProfile
from coordinator.pipeline.planner.profile_file import load_profile
from coordinator.pipeline.schedulers.perseus import plan_schedule
from zeus_agent.pipeline_order import format_action, one_f_one_b

pytestmark = pytest.mark.core

PROFILES = sorted((Path(__file__).resolve().parents[2] / "data" / "perseus"
                   / "stage_profiles").glob("*.csv"))


def bare(num_stages: int, microbatches: int) -> list[list[str]]:
    """Each rank's 1F1B order in Zeus 0.16's bare names."""
    return [[n for n, _ in one_f_one_b(s, num_stages, microbatches)] for s in range(num_stages)]


def named(orders: list[list[tuple[str, int, int]]]) -> list[list[str]]:
    return [[format_action(*a) for a in row] for row in orders]


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 3), (3, 4), (4, 8), (8, 5)])
def test_bare_1f1b_builds_the_fixed_1f1b_dag(stages: int, microbatches: int) -> None:
    learned = build_dag(LearnedSchedule.from_orders(bare(stages, microbatches)))
    fixed = build_dag(Synchronous1F1B(stages, microbatches))
    assert learned == fixed


def test_four_real_profiles_plan_the_same_on_the_learned_1f1b() -> None:
    assert len(PROFILES) == 4
    m = 6
    for path in PROFILES:
        profile = load_profile(path)
        schedule = LearnedSchedule.from_orders(bare(profile.num_stages, m))
        fixed = plan_frontier(profile, m)
        learned = plan_frontier(profile, m, schedule=schedule)
        assert [(p.time, p.energy, p.plan) for p in learned] == [
            (p.time, p.energy, p.plan) for p in fixed], path.name
        assert max_frequency_plan(profile, m, schedule) == max_frequency_plan(profile, m)
        point = fixed[len(fixed) // 2]
        assert evaluate(profile, point.plan, m, schedule=schedule) == evaluate(
            profile, point.plan, m)
        orders = bare(profile.num_stages, m)
        for rank, order in enumerate(orders):  # The same clocks for every rank.
            ours = plan_schedule(rank, order + ["optimizer"], learned[3].plan[rank], 9999)
            theirs = plan_schedule(rank, order + ["optimizer"], fixed[3].plan[rank], 9999)
            assert ours == theirs


def test_bare_gpipe_is_learned_and_takes_the_textbook_time() -> None:
    s, m = 4, 6
    orders = [["forward"] * m + ["backward"] * m for _ in range(s)]
    dag = build_dag(LearnedSchedule.from_orders(orders))
    assert dag.longest_path([1.0] * len(dag.nodes)) == 2 * (m + s - 1)


def interleaved(ranks: int, chunks: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """A simple interleaved order: all forwards by chunk, then all backwards reversed."""
    orders = []
    for r in range(ranks):
        stages = [r + c * ranks for c in range(chunks)]
        fwd = [("forward", v, mb) for v in stages for mb in range(microbatches)]
        bwd = [("backward", v, mb) for v in reversed(stages) for mb in range(microbatches)]
        orders.append(fwd + bwd)
    return orders


def test_virtual_stages_map_to_the_ranks_that_ran_them() -> None:
    schedule = LearnedSchedule.from_orders(named(interleaved(2, 2, 2)))
    assert schedule.stage_rank == (0, 1, 0, 1)
    assert schedule.num_stages == 2 and schedule.num_virtual_stages == 4
    assert schedule.num_microbatches == 2
    edges = set(schedule.cross_stage_edges())
    node = {(a.split(":")[0], int(a.split(":")[1]), int(a.split(":")[2])): Node(r, a, int(
        a.split(":")[2])) for r, row in enumerate(named(interleaved(2, 2, 2))) for a in row}
    for mb in range(2):
        for v in range(3):
            assert (node[("forward", v, mb)], node[("forward", v + 1, mb)]) in edges
            assert (node[("backward", v + 1, mb)], node[("backward", v, mb)]) in edges
        assert (node[("forward", 3, mb)], node[("backward", 3, mb)]) in edges
    assert len(edges) == 2 * (3 + 3 + 1)
    dag = build_dag(schedule)  # Chains per rank, as they ran.
    assert [dag.nodes[v].instruction for v in dag.stage_nodes[1]] == named(
        interleaved(2, 2, 2))[1]


def test_split_backward_weights_follow_their_input_gradients() -> None:
    orders = [[("forward", 0, 0), ("forward", 0, 1), ("backward_input", 0, 0),
               ("backward_input", 0, 1), ("backward_weight", 0, 1), ("backward_weight", 0, 0)],
              [("forward", 1, 0), ("backward_input", 1, 0), ("forward", 1, 1),
               ("backward_input", 1, 1), ("backward_weight", 1, 0), ("backward_weight", 1, 1)]]
    schedule = LearnedSchedule.from_orders(named(orders))
    edges = {(a.instruction, b.instruction) for a, b in schedule.cross_stage_edges()}
    assert ("backward_input:1:0", "backward_input:0:0") in edges
    assert ("forward:1:1", "backward_input:1:1") in edges
    assert ("backward_input:0:1", "backward_weight:0:1") in edges
    assert ("backward_input:1:0", "backward_weight:1:0") in edges
    dag = build_dag(schedule)
    # F F I I W W on rank 0 waits for rank 1's I of each microbatch.
    assert dag.longest_path([1.0] * len(dag.nodes)) == 8.0
    profile = InstructionProfile.from_rows(
        [(s, k, f, t * 1500 / f, 100.0 * t)
         for s in range(2) for k, t in (("forward", 1.0), ("backward_input", 1.0),
                                        ("backward_weight", 0.5))
         for f in (1500, 1200, 900)])
    frontier = plan_frontier(profile, 2, schedule=schedule)
    assert frontier[0].time == pytest.approx(7.0)
    assert [n for n, _ in frontier[0].plan[0]] == named(orders)[0]


@pytest.mark.parametrize(("orders", "says"), [
    ([["forward:0:0", "recompute:0:0"]], "rank 0: .*unknown kind 'recompute'"),
    ([["forward", "backward_input"]], "a split backward needs its stage and microbatch"),
    ([["forward:0:0", "forward:0:0", "backward:0:0"]], "rank 0 runs forward:0:0 twice"),
    ([["forward", "backward"], ["forward:1:0", "backward:1:0"]], "one schedule needs one naming"),
    ([["forward:0:0", "backward:0:0"], ["forward:0:1", "backward:0:1"]],
     "stage 0 runs on rank 0 and on rank 1"),
    ([["forward:0:0", "backward:0:0"], ["forward:2:0", "backward:2:0"]],
     "no rank runs stage 1 .*a dependency nobody runs"),
    ([["forward:0:0", "forward:0:1", "backward:0:0", "backward:0:1"],
      ["forward:1:0", "backward:1:0"]], "microbatch count must be the same everywhere"),
    ([["forward:0:0", "forward:0:1", "backward:0:0"]], "no backward of microbatch 1"),
    ([["forward:0:0", "backward:0:0", "backward_input:0:0"]], "both a backward and a "),
    ([["forward:0:0", "backward:0:0", "backward_weight:0:0"]],
     "backward_weight of microbatch 0 without its backward_input"),
    ([["optimizer"]], "rank 0 runs no pipeline action"),
    ([], "no ranks"),
])
def test_schedules_the_planner_cannot_model_are_named(orders: list[list[str]], says: str) -> None:
    with pytest.raises(ScheduleError, match=says):
        LearnedSchedule.from_orders(orders)


def test_other_bare_names_stay_out_of_the_dag() -> None:
    orders = bare(2, 2)
    orders[0] = ["data"] + orders[0] + ["optimizer"]
    schedule = LearnedSchedule.from_orders(orders)
    assert schedule.names[0] == tuple(bare(2, 2)[0])
