"""`HFGlobalPowerLimitOptimizer`: the power-limit optimizer as a Hugging Face `TrainerCallback`.

Pass it in `Trainer(..., callbacks=[plo])` (or `trl.SFTTrainer`); it forwards `on_step_begin`
and `on_epoch_end` to a `GlobalPowerLimitOptimizer` (see `power_limit`). This module imports
transformers; `zeus_agent.integrations` imports it only on first access.
"""

from __future__ import annotations

from pathlib import Path
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

    def __init__(
        self,
        monitor: Any,
        optimum_selector: Any = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | Path | None = None,
    ) -> None:
        """Register the job and rank (see `GlobalPowerLimitOptimizer.__init__`).

        Raises:
            ImportError: transformers is not installed.
            ValueError: An argument is out of range or the selector is not supported.
        """
        if _TRANSFORMERS_ERROR is not None:
            raise ImportError(
                "HFGlobalPowerLimitOptimizer needs the transformers package: "
                "pip install 'zeus-bus[transformers]'"
            ) from _TRANSFORMERS_ERROR
        self.optimizer = GlobalPowerLimitOptimizer(
            monitor=monitor,
            optimum_selector=optimum_selector,
            wait_steps=wait_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            pl_step=pl_step,
            profile_path=profile_path,
        )

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mark the end of a training epoch."""
        self.optimizer.on_epoch_end()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mark the beginning of a training step."""
        self.optimizer.on_step_begin()
