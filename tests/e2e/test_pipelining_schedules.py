"""`instrument(schedule)` on real `torch.distributed.pipelining` schedules, 2 gloo processes.

Each schedule class torch ships runs two training steps of a tiny model (one linear layer per
stage; two stages per rank for the looped, interleaved and V-shape schedules) and one `eval()`;
every rank records what the integration reports and the test compares it with the schedule's
own table of compute actions (`pipeline_order`, or the runtime's `pipeline_order_with_comms`,
its DualPipeV overlapped pairs expanded; for `Schedule1F1B`, Zeus's 1F1B order): each action
exactly once per step, in the order the table gives, with its kind, stage and microbatch.
The eval reports nothing (not run on the V-shape schedules: it fails inside torch 2.13).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from zeus_demo.cluster import free_port

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.e2e

WORLD = 2
MICROBATCHES = 4
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPE = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""Their `eval()` fails inside torch 2.13 (a stage's `get_local_bwd_output` asserts it has a
backward): the eval part is skipped for them."""
KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def _stage_indices(name: str, rank: int) -> list[int]:
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        return [rank]
    if name in V_SHAPE:
        return [rank, 2 * WORLD - 1 - rank]  # the V: rank 0 holds the first and last stage
    return [rank, rank + WORLD]  # looped


def _expected(schedule: Any, rank: int) -> list[str]:
    """The compute actions the schedule's own table gives this rank, as instruction names.

    `Schedule1F1B`'s table in torch 2.13 misnumbers the last rank's forwards (from 1, up to
    `M`), while its code runs synchronous 1F1B: Zeus's order (`one_f_one_b`) is the reference.
    """
    if type(schedule).__name__ == "Schedule1F1B":
        from zeus_agent.pipeline_order import one_f_one_b

        return [f"{kind}:{rank}:{mb}" for kind, mb in one_f_one_b(rank, WORLD, MICROBATCHES)]
    table = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    names = []
    for action in table[rank]:
        if action is None:
            continue
        for a in getattr(action, "sub_actions", None) or [action]:
            kind = KINDS.get(a.computation_type.value)
            if kind is not None:
                names.append(f"{kind}:{a.stage_index}:{a.microbatch_index}")
    return names


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_step_begin(self) -> None:
        self.events.append("step_begin")

    def on_step_end(self) -> None:
        self.events.append("step_end")

    def on_instruction_begin(self, name: str) -> None:
        self.events.append(f"+{name}")

    def on_instruction_end(self, name: str) -> None:
        self.events.append(f"-{name}")


def _run_one(name: str, rank: int) -> dict[str, Any]:
    from torch.distributed import pipelining

    from zeus_agent.integrations import instrument_pipeline

    torch.manual_seed(0)
    indices = _stage_indices(name, rank)
    num_stages = WORLD * len(indices)
    stages = [pipelining.PipelineStage(torch.nn.Linear(8, 8), i, num_stages, torch.device("cpu"))
              for i in indices]
    cls = getattr(pipelining.schedules, name)
    loss = torch.nn.functional.mse_loss
    schedule = cls(stages[0] if len(stages) == 1 else stages, MICROBATCHES, loss_fn=loss)
    recorder = _Recorder()
    handle = instrument_pipeline(schedule, recorder)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(2):
        schedule.step(x, target=y)
    before_eval = len(recorder.events)
    if name not in V_SHAPE:
        with torch.no_grad():
            schedule.eval(x, target=y)
    handle.remove()
    return {"events": recorder.events, "eval_events": len(recorder.events) - before_eval,
            "expected": _expected(schedule, rank)}


def _worker(rank: int, port: int, out_dir: str, names: tuple[str, ...] = SCHEDULES) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))  # a failure fails, never hangs
    results: dict[str, Any] = {}
    try:
        for name in names:
            try:
                results[name] = _run_one(name, rank)
            except Exception as e:  # reported per schedule, so one failure names itself
                results[name] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as tmp

    out = tmp_path_factory.mktemp("pipelining")
    tmp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_compute_action_is_reported_once_per_step(
        name: str, results: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        expected = got["expected"]
        assert expected, f"{name} has no compute actions for rank {rank}"
        assert {n.split(":")[1] for n in expected} == {
            str(i) for i in _stage_indices(name, rank)}
        step = ["step_begin"] + [f"{sign}{n}" for n in expected for sign in "+-"] + ["step_end"]
        assert got["events"] == step * 2, f"rank {rank}"
        assert got["eval_events"] == 0
