"""The simulated GPU backend, calibrated on real A40 and V100 measurements.

Pieces:

* `physics`: the pure model (`HardwareParams`, `WorkloadParams`, `operating_point`,
  `NoiseModel`).
* `presets`: `PRESETS` (A40, V100, A100, H100) and `WORKLOADS` (the 12 fitted reference
  profiles and generic workloads).
* `device`: `SimGPU`, the `GPU` backend whose state lives in a shared file, `WorkResult` and
  `create_sim_gpus`.
* `timing`: what NVML calls cost (`NvmlTiming`, `timing_preset`: "h200", the recorded H200;
  "none", free), charged by a `SimGPU` handle opened with ``timing=``.
* `calibration`, `instructions`: the model's error against `data/reference-profiles/` and the
  Perseus stage profiles; `instructions` also serves the fitted pipeline instructions. The fits
  themselves run offline (`tools/fit_sim.py`).
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
from zeus_agent.gpu.sim.timing import TIMING_PRESETS, CallKind, NvmlTiming, timing_preset

__all__ = [
    "PRESETS",
    "TIMING_PRESETS",
    "WORKLOADS",
    "CallKind",
    "HardwareParams",
    "NoiseModel",
    "NvmlTiming",
    "OperatingPoint",
    "SimGPU",
    "WorkResult",
    "WorkloadParams",
    "create_sim_gpus",
    "operating_point",
    "timing_preset",
]
