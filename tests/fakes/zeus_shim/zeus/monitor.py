"""`zeus.monitor.ZeusMonitor`'s signature and logging, measuring nothing (see the package)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from zeus import get_logger

logger = get_logger(__name__)


@dataclass
class Measurement:
    """As Zeus's: seconds, and J per CUDA index."""

    time: float
    gpu_energy: dict[int, float]


class ZeusMonitor:
    """Zeus's constructor arguments; windows of 0 J."""

    def __init__(self, gpu_indices: list[int] | None = None,
                 cpu_indices: list[int] | None = None,
                 approx_instant_energy: bool = False) -> None:
        self.gpu_indices = gpu_indices or [0]
        self._begun: dict[str, float] = {}
        logger.info("Monitoring GPU indices %s.", self.gpu_indices)
        logger.info("Monitoring CPU indices %s", cpu_indices)

    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        self._begun[key] = time.time()

    def end_window(self, key: str, sync_execution: bool = True) -> Measurement:
        elapsed = time.time() - self._begun.pop(key)
        logger.info("Measurement window '%s' ended.", key)
        return Measurement(time=elapsed, gpu_energy=dict.fromkeys(self.gpu_indices, 0.0))
