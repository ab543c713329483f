"""A stand-in for DeepSpeed's `PipelineEngine`: the names and call shape the adapter relies on.

Mimics `deepspeed/runtime/pipe/engine.py` (`PipelineEngine._INSTRUCTION_MAP`, a class
attribute mapping instruction classes to unbound `_exec_*` methods; `_exec_schedule`, which
calls `MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)`; `train_batch` and
`eval_batch`, which run a schedule through it; `stage_id`) and
`deepspeed/runtime/pipe/schedule.py` (`PipeInstruction` carrying its kwargs; `ForwardPass`,
`BackwardPass`, `LoadMicroBatch`, `OptimizerStep`, ... by class name; `TrainSchedule`, a
synchronous 1F1B with buffers reused modulo the buffer count; `InferenceSchedule`). No
DeepSpeed code is copied: the schedule here comes from `zeus_agent.pipeline_order`.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from zeus_agent.pipeline_order import FORWARD, one_f_one_b


class PipeInstruction:
    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs


class BufferOpInstruction(PipeInstruction):
    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class OptimizerStep(PipeInstruction):
    pass


class ReduceGrads(PipeInstruction):
    pass


class LoadMicroBatch(BufferOpInstruction):
    pass


class ForwardPass(BufferOpInstruction):
    pass


class BackwardPass(BufferOpInstruction):
    pass


class TrainSchedule:
    """1F1B steps, each a list of instructions; buffers reused modulo `num_pipe_buffers`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def __iter__(self) -> Any:
        buffers = self.num_pipe_buffers()
        for name, mb in one_f_one_b(self.stage_id, self.stages, self.micro_batches):
            if name == FORWARD:
                yield [LoadMicroBatch(mb % buffers), ForwardPass(mb % buffers)]
            else:
                yield [BackwardPass(mb % buffers)]
        yield [ReduceGrads(), OptimizerStep()]


class InferenceSchedule(TrainSchedule):
    def __iter__(self) -> Any:
        for mb in range(self.micro_batches):
            yield [LoadMicroBatch(mb % 2), ForwardPass(mb % 2)]


class PipelineEngine:
    def __init__(self, stage_id: int, num_stages: int, micro_batches: int) -> None:
        self.stage_id, self.num_stages, self.micro_batches = stage_id, num_stages, micro_batches
        self.log: list[tuple[str, int]] = []

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        self.log.append(("load", buffer_id))

    def _exec_forward_pass(self, buffer_id: int) -> None:
        self.log.append(("forward", buffer_id))

    def _exec_backward_pass(self, buffer_id: int) -> None:
        self.log.append(("backward", buffer_id))

    def _exec_reduce_grads(self) -> None:
        self.log.append(("reduce", -1))

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        self.log.append(("step", -1))

    _INSTRUCTION_MAP = {
        OptimizerStep: _exec_optimizer_step,
        ReduceGrads: _exec_reduce_grads,
        LoadMicroBatch: _exec_load_micro_batch,
        ForwardPass: _exec_forward_pass,
        BackwardPass: _exec_backward_pass,
    }

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"does not understand instruction {cmd!r}")
                self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
                self._exec_instr(**cmd.kwargs)

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return 0.5

    def eval_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(InferenceSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return 0.25
