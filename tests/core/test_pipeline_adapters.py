"""The DeepSpeed and Megatron-core adapters, against stand-ins of those frameworks' classes.

Neither framework is installed here; `tests/fakes/deepspeed_pipe.py` and
`tests/fakes/megatron_schedules.py` mimic the names and call shapes the adapters rely on (their
docstrings cite the real files).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.core.pipeline_events_kit import Recorder
from tests.fakes import deepspeed_pipe, megatron_schedules
from zeus_agent.integrations import deepspeed, megatron
from zeus_agent.pipeline_order import one_f_one_b

pytestmark = pytest.mark.core


def _begins(rec: Recorder) -> list[str]:
    return [e[1] for e in rec.events if e[0] == "begin"]


# ----------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_reports_each_pass_of_a_train_batch() -> None:
    engine = deepspeed_pipe.PipelineEngine(stage_id=1, num_stages=4, micro_batches=6)
    rec = Recorder()
    handle = deepspeed.instrument(engine, rec)
    assert engine.train_batch() == 0.5
    expected = [f"{n}:1:{mb}" for n, mb in one_f_one_b(1, 4, 6)]
    assert _begins(rec) == expected
    assert rec.events[0] == ("step_begin",) and rec.events[-1] == ("step_end",)
    assert [e[1] for e in rec.events if e[0] == "end"] == expected  # each closed, in order
    engine.train_batch()  # microbatches numbered afresh every step
    assert _begins(rec)[len(expected):] == expected
    assert handle.gate.steps == 2
    assert len([x for x in engine.log if x[0] in ("forward", "backward")]) == 24


def test_deepspeed_eval_and_remove() -> None:
    engine = deepspeed_pipe.PipelineEngine(stage_id=0, num_stages=2, micro_batches=2)
    rec = Recorder()
    handle = deepspeed.instrument(engine, rec, bare_names=True)
    engine.eval_batch()
    assert rec.events == []
    engine.train_batch()
    assert _begins(rec) == ["forward", "forward", "backward", "backward"]
    with pytest.raises(ValueError, match="instrumented already"):
        deepspeed.instrument(engine, rec)
    handle.remove()
    assert "_INSTRUCTION_MAP" not in vars(engine) and "train_batch" not in vars(engine)
    assert engine._INSTRUCTION_MAP is deepspeed_pipe.PipelineEngine._INSTRUCTION_MAP
    engine.train_batch()
    assert len(rec.events) == 10  # nothing more reported


def test_deepspeed_refuses_what_is_not_an_engine() -> None:
    with pytest.raises(TypeError, match="not a DeepSpeed PipelineEngine"):
        deepspeed.instrument(object(), Recorder())


# ----------------------------------------------------------------------------- Megatron
@pytest.fixture
def schedules() -> Iterator[Any]:
    state = megatron_schedules.parallel_state
    yield megatron_schedules
    state.pp_rank, state.pp_size, state.vp_size, state.vp_rank = 0, 1, None, None
    megatron_schedules.log.clear()


def _train(schedules: Any, chunks: int = 1, microbatches: int = 4,
           forward_only: bool = False) -> None:
    func = schedules.get_forward_backward_func()
    model: Any = [f"chunk{c}" for c in range(chunks)] if chunks > 1 else "model"
    data: Any = [iter(()) for _ in range(chunks)] if chunks > 1 else iter(())
    func(forward_step_func=lambda it, m: (m, None), data_iterator=data, model=model,
         num_microbatches=microbatches, seq_length=8, micro_batch_size=1,
         forward_only=forward_only)


def test_megatron_1f1b(schedules: Any) -> None:
    schedules.parallel_state.pp_rank, schedules.parallel_state.pp_size = 2, 4
    rec = Recorder()
    with megatron.instrument(schedules, rec) as handle:
        _train(schedules, microbatches=5)
        _train(schedules, microbatches=5, forward_only=True)  # an evaluation
    assert _begins(rec) == [f"{n}:2:{mb}" for n, mb in one_f_one_b(2, 4, 5)]
    assert rec.events.count(("step_begin",)) == 1 and handle.gate.steps == 1
    assert schedules.forward_step.__name__ == "forward_step"
    assert not hasattr(schedules.forward_step, "__zeus_megatron__")  # removed


def test_megatron_virtual_stages(schedules: Any) -> None:
    state = schedules.parallel_state
    state.pp_rank, state.pp_size, state.vp_size = 1, 4, 2
    rec = Recorder()
    handle = megatron.instrument(schedules, rec)
    _train(schedules, chunks=2, microbatches=3)
    forwards = [f"forward:{s}:{mb}" for s in (1, 5) for mb in range(3)]
    backwards = [f"backward:{s}:{mb}" for s in (5, 1) for mb in range(3)]
    assert _begins(rec) == forwards + backwards
    with pytest.raises(ValueError, match="instrumented already"):
        megatron.instrument(schedules, rec)
    handle.remove()


def test_megatron_uses_the_microbatch_and_chunk_megatron_passes(schedules: Any) -> None:
    rec = Recorder()
    handle = megatron.instrument(schedules, rec)
    schedules.parallel_state.pp_size = 2
    handle.gate._active = True  # inside a step
    schedules.forward_step(lambda it, m: (m, None), None, "m", 4, None, [], None,
                           current_microbatch=3, vp_stage=1)
    assert _begins(rec) == ["forward:2:3"]
    handle.gate._active = False
    handle.remove()


def test_megatron_refuses_another_module() -> None:
    import json

    with pytest.raises(TypeError, match="not Megatron-core's schedules module"):
        megatron.instrument(json, Recorder())
