"""A stand-in for Megatron-core's `megatron.core.pipeline_parallel.schedules` module.

Mimics the names and call shape of `megatron/core/pipeline_parallel/schedules.py` that the
adapter relies on: module functions `forward_step(forward_step_func, data_iterator, model,
num_microbatches, input_tensor, forward_data_store, config, ..., current_microbatch=None,
vp_stage=None)` (the last two in recent versions) and `backward_step(
input_tensor, output_tensor, output_tensor_grad, model_type, config)`, looked up in the
module's globals by the schedule functions `forward_backward_no_pipelining`,
`forward_backward_pipelining_without_interleaving` and
`forward_backward_pipelining_with_interleaving` (keyword-only arguments, `forward_only`), the
interleaved one setting `parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)` before
each call; `get_forward_backward_func()` choosing among them from `parallel_state`. The
orders are simplified (no Megatron code is copied): 1F1B from `zeus_agent.pipeline_order`,
and for the interleaved one, each chunk's microbatches in order, chunks in turn.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from zeus_agent.pipeline_order import FORWARD, one_f_one_b


class _ParallelState:
    def __init__(self) -> None:
        self.pp_rank, self.pp_size = 0, 1
        self.vp_size: int | None = None
        self.vp_rank: int | None = None

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    def get_virtual_pipeline_model_parallel_world_size(self) -> int | None:
        return self.vp_size

    def get_virtual_pipeline_model_parallel_rank(self) -> int | None:
        return self.vp_rank

    def set_virtual_pipeline_model_parallel_rank(self, rank: int) -> None:
        self.vp_rank = rank


parallel_state = _ParallelState()
log: list[tuple[str, Any]] = []


def forward_step(forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
                 input_tensor: Any, forward_data_store: list[Any], config: Any,
                 collect_non_loss_data: bool = False,
                 checkpoint_activations_microbatch: Any = None,
                 is_first_microbatch: bool = False, current_microbatch: int | None = None,
                 vp_stage: int | None = None) -> Any:
    log.append(("forward", model))
    return forward_step_func(data_iterator, model)


def backward_step(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any,
                  model_type: Any, config: Any) -> Any:
    log.append(("backward", output_tensor))
    return None


def _config() -> Any:
    return SimpleNamespace(timers=None)


def forward_backward_no_pipelining(*, forward_step_func: Any, data_iterator: Any, model: Any,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, forward_only: bool = False,
                                   **kwargs: Any) -> list[Any]:
    store: list[Any] = []
    for _ in range(num_microbatches):
        out = forward_step(forward_step_func, data_iterator, model, num_microbatches, None,
                           store, _config())
        if not forward_only:
            backward_step(None, out, None, None, _config())
    return store


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
        seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
        **kwargs: Any) -> list[Any]:
    store: list[Any] = []
    order = ([(FORWARD, mb) for mb in range(num_microbatches)] if forward_only else
             one_f_one_b(parallel_state.pp_rank, parallel_state.pp_size, num_microbatches))
    for name, mb in order:
        if name == FORWARD:
            forward_step(forward_step_func, data_iterator, model, num_microbatches, None,
                         store, _config())
        else:
            backward_step(None, mb, None, None, _config())
    return store


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Any, data_iterator: list[Any], model: list[Any],
        num_microbatches: int, seq_length: int = 0, micro_batch_size: int = 0,
        forward_only: bool = False, **kwargs: Any) -> list[Any]:
    store: list[Any] = []
    for chunk in range(len(model)):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        for _ in range(num_microbatches):
            forward_step(forward_step_func, data_iterator[chunk], model[chunk],
                         num_microbatches, None, store, _config())
    if not forward_only:
        for chunk in reversed(range(len(model))):
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
            for mb in range(num_microbatches):
                backward_step(None, mb, None, None, _config())
    return store


def get_forward_backward_func() -> Any:
    if parallel_state.pp_size > 1:
        if parallel_state.vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
