"""`HFGlobalPowerLimitOptimizer`: the power-limit optimizer as a Hugging Face `TrainerCallback`.

Pass it in `Trainer(..., callbacks=[plo])` (or `trl.SFTTrainer`); it forwards `on_step_begin`
and `on_epoch_end` to a `GlobalPowerLimitOptimizer` (see `power_limit`). This module imports
transformers; `zeus_agent.integrations` imports it only on first access.
"""

from __future__ import annotations

import inspect
from typing import Any

from zeus_agent.integrations.power_limit import GlobalPowerLimitOptimizer

try:
    from transformers import TrainerCallback

    _TRANSFORMERS_ERROR: ImportError | None = None
except ImportError as _e:  # Keep the class importable; fail at construction instead.
    TrainerCallback = object  # type: ignore[misc,assignment]
    _TRANSFORMERS_ERROR = _e


class HFGlobalPowerLimitOptimizer(TrainerCallback):
    """Optimizer for the power limit knob, wrapped as a Hugging Face Trainer callback.

    See `GlobalPowerLimitOptimizer` for the arguments and behaviour.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Register the job and rank: the arguments are `GlobalPowerLimitOptimizer`'s.

        Raises:
            ImportError: transformers is not installed.
            ValueError: An argument is out of range or the selector is not supported.
        """
        if _TRANSFORMERS_ERROR is not None:
            raise ImportError(
                "HFGlobalPowerLimitOptimizer needs the transformers package: "
                "pip install 'zeus-bus[transformers]'"
            ) from _TRANSFORMERS_ERROR
        self.optimizer = GlobalPowerLimitOptimizer(*args, **kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mark the end of a training epoch."""
        self.optimizer.on_epoch_end()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mark the beginning of a training step."""
        self.optimizer.on_step_begin()


# One signature, Zeus's, defined once: introspection and help() show the optimizer's arguments.
HFGlobalPowerLimitOptimizer.__init__.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    GlobalPowerLimitOptimizer.__init__
)
