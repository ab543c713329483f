"""The simulated GPU backend, calibrated on real A40 and V100 measurements.

Pieces:

* `physics`: the pure model (`HardwareParams`, `WorkloadParams`, `operating_point`,
  `NoiseModel`).
* `presets`: `PRESETS` (A40, V100, A100, H100) and `WORKLOADS` (the 12 fitted reference
  profiles and generic workloads).
* `device`: `SimGPU`, the `GPU` backend whose state lives in a shared file, `WorkResult` and
  `create_sim_gpus`.
* `calibration`: fits the model to `data/reference-profiles/` and reports its error
  (``python -m zeus_agent.gpu.sim.calibration``); imported on demand, as it needs scipy.
"""

from __future__ import annotations

from zeus_agent.gpu.sim.device import SimGPU, WorkResult, create_sim_gpus
from zeus_agent.gpu.sim.physics import (
    HardwareParams,
    NoiseModel,
    OperatingPoint,
    WorkloadParams,
    operating_point,
)
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "HardwareParams",
    "NoiseModel",
    "OperatingPoint",
    "SimGPU",
    "WorkResult",
    "WorkloadParams",
    "create_sim_gpus",
    "operating_point",
]
