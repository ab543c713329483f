"""Zeus-shaped drop-ins built on `zeus_agent.emit`: change the imports, keep the training loop.

* `ZeusMonitor`, `Measurement` (`monitor`): named, overlapping energy windows measured by the
  node's agent (`zeus.monitor`).
* `GlobalPowerLimitOptimizer`, `power_limit_options` (`power_limit`): registers the job with
  the coordinator's power-limit optimizer and forwards step/epoch events
  (`zeus.optimizer.power_limit`).
* `PerseusOptimizer` / `PipelineFrequencyOptimizer` (`perseus`): a pipeline-parallel rank of
  the coordinator's frequency optimizer; the node's agent sets each instruction's SM clock
  (`zeus.optimizer.perseus`).
* `instrument_pipeline` (`pipelining.instrument`), `PipelineInstrumentation`: one line
  reports every compute action of a `torch.distributed.pipelining` schedule as an instruction;
  `deepspeed.instrument(engine)` and `megatron.instrument()` do the same for DeepSpeed's
  `PipelineEngine` and Megatron-core's schedules.
* `HFGlobalPowerLimitOptimizer` (`huggingface`): the same as a `transformers.TrainerCallback`;
  imported on first access, so this package imports without transformers.
* `OptimumSelector`, `Energy`, `Time`, `ZeusCost`, `MaxSlowdownConstraint`
  (`zeus_agent.selectors`): Zeus's optimum selectors; subclass `OptimumSelector` for your own
  (`zeus.optimizer.power_limit`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeus_agent.integrations.monitor import Measurement, ZeusMonitor
from zeus_agent.integrations.perseus import PerseusOptimizer, PipelineFrequencyOptimizer
from zeus_agent.integrations.pipelining import PipelineInstrumentation
from zeus_agent.integrations.pipelining import instrument as instrument_pipeline
from zeus_agent.integrations.power_limit import GlobalPowerLimitOptimizer, power_limit_options
from zeus_agent.integrations.profiling import ProfilingResult, ZeusProfilingService
from zeus_agent.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
)

if TYPE_CHECKING:
    from zeus_agent.integrations.huggingface import HFGlobalPowerLimitOptimizer

__all__ = [
    "Energy",
    "GlobalPowerLimitOptimizer",
    "HFGlobalPowerLimitOptimizer",
    "MaxSlowdownConstraint",
    "Measurement",
    "OptimumSelector",
    "PerseusOptimizer",
    "PipelineFrequencyOptimizer",
    "PipelineInstrumentation",
    "PowerLimitMeasurement",
    "ProfilingResult",
    "Time",
    "ZeusCost",
    "ZeusMonitor",
    "ZeusProfilingService",
    "instrument_pipeline",
    "power_limit_options",
]


def __getattr__(name: str) -> Any:
    if name == "HFGlobalPowerLimitOptimizer":
        from zeus_agent.integrations.huggingface import HFGlobalPowerLimitOptimizer

        return HFGlobalPowerLimitOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
