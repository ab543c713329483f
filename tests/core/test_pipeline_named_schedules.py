"""The named schedules' orders (offline planning) against PyTorch's own tables, and their DAGs."""

from __future__ import annotations

import types
from typing import Any

import pytest

from coordinator.pipeline.planner.dag import build_dag
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.planner.schedules import SCHEDULES, rank_orders

pytestmark = pytest.mark.core

LETTER = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


class _Stage:
    """What a torch schedule reads of its stages to lay out its `pipeline_order`."""

    def __init__(self, index: int, num_stages: int, ranks: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = ranks, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = types.SimpleNamespace()


def torch_orders(cls: Any, ranks: int, chunks: int, microbatches: int,
                 v_shape: bool = False) -> list[list[str]]:
    """Each rank's compute actions in torch's `pipeline_order`, as instruction names."""
    out = []
    for rank in range(ranks):
        idx = ([rank, 2 * ranks - 1 - rank] if v_shape
               else [rank + c * ranks for c in range(chunks)])
        stages = [_Stage(i, ranks * chunks, ranks, rank) for i in idx]
        table = cls(stages, microbatches).pipeline_order[rank]
        names = []
        for action in table:
            if action is None:
                continue
            text = str(action)  # e.g. "2F0": stage, letter, microbatch
            pos = next(i for i, ch in enumerate(text) if ch.isalpha())
            names.append(f"{LETTER[text[pos]]}:{text[:pos]}:{text[pos + 1:]}")
        out.append(names)
    return out


@pytest.mark.parametrize(("ranks", "chunks", "microbatches"),
                         [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 8), (2, 2, 6), (8, 2, 16)])
@pytest.mark.parametrize(("name", "cls_name"), [
    ("interleaved-1f1b", "ScheduleInterleaved1F1B"), ("looped-bfs", "ScheduleLoopedBFS"),
    ("zero-bubble", "ScheduleInterleavedZeroBubble")])
def test_orders_match_torch(name: str, cls_name: str, ranks: int, chunks: int,
                            microbatches: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name)
    assert rank_orders(name, ranks, microbatches, chunks) == torch_orders(
        cls, ranks, chunks, microbatches)


def test_torch_zbv_is_learned_with_its_v_shaped_stages() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    orders = torch_orders(schedules.ScheduleZBVZeroBubble, 4, 2, 8, v_shape=True)
    schedule = LearnedSchedule.from_orders(orders)
    assert schedule.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    build_dag(schedule)  # No cycle, no missing dependency.


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 1), (2, 4), (4, 8), (3, 6)])
def test_every_named_schedule_builds_a_dag(name: str, ranks: int, microbatches: int) -> None:
    orders = rank_orders(name, ranks, microbatches)
    schedule = LearnedSchedule.from_orders(orders)
    assert schedule.num_microbatches == microbatches
    dag = build_dag(schedule)
    per_action = 3 if name == "zero-bubble" else 2
    chunks = schedule.num_virtual_stages // ranks
    assert len(dag.nodes) == ranks * chunks * microbatches * per_action


def test_bad_names_and_shapes() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        rank_orders("zb", 2, 4)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        rank_orders("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="multiple of their rounds"):
        rank_orders("interleaved-1f1b", 4, 9, 2)
