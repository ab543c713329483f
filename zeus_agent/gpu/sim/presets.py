"""Hardware presets and workloads of the simulated GPU, calibrated on real measurements.

Pieces:

* `PRESETS`: `HardwareParams` for "A40", "V100", "A100", "H100" and "A100-SXM". The A40 and
  V100 curve parameters are fitted to the reference profiles (`data/reference-profiles/`); A100
  (SXM4 40GB) and H100 (SXM) are extrapolated from the fitted Ampere/Volta shapes
  (docs/simulator.md). "A100-SXM" (SXM4 80GB, 855-1410 MHz) is fitted to the Perseus pipeline
  stage profiles (`data/perseus/stage_profiles/`) by `tools/fit_sim.py instructions`.
* `WORKLOADS`: `WorkloadParams` fitted to each of the 12 reference profiles, keyed by the CSV
  stem (e.g. "A40+resnet50+gpu0,1,2,3"), plus generic "compute-bound", "memory-bound" and
  "input-bound" workloads for tests and demos.
* `sm_clock_table`: builds an NVML-like SM clock table.

The numbers between the GENERATED markers are written by
``python tools/fit_sim.py power-limit --write``, those between the PIPELINE FIT markers by
``python tools/fit_sim.py instructions --write``; do not edit them by hand.
"""

from __future__ import annotations

from zeus_agent.gpu.sim.physics import HardwareParams, WorkloadParams

__all__ = [
    "FITTED_HARDWARE",
    "FITTED_PIPELINE_HARDWARE",
    "FITTED_WORKLOADS",
    "PRESETS",
    "WORKLOADS",
    "sm_clock_table",
]


def sm_clock_table(min_mhz: int, max_mhz: int, step_mhz: float) -> tuple[int, ...]:
    """Return SM clocks from `max_mhz` down to `min_mhz`, NVML-style (fractional steps floored).

    Args:
        min_mhz: Lowest clock (MHz).
        max_mhz: Highest clock (MHz); must be reachable from `min_mhz` in whole steps.
        step_mhz: Step between clocks, e.g. 15 or 7.5 (MHz).

    Returns:
        The clocks, highest first (MHz).
    """
    count = round((max_mhz - min_mhz) / step_mhz)
    return tuple(int(min_mhz + i * step_mhz) for i in range(count, -1, -1))


# BEGIN GENERATED (python tools/fit_sim.py power-limit --write)
FITTED_HARDWARE: dict[str, dict[str, float]] = {
    "A40": {
        "static_power_w": 75.5475,
        "voltage_floor_clock_mhz": 1158.19,
        "voltage_exponent": 2.0,
        "throttle_floor_clock_mhz": 408.668,
        "dynamic_power_w": 224.453,
    },
    "V100": {
        "static_power_w": 34.1277,
        "voltage_floor_clock_mhz": 1049.46,
        "voltage_exponent": 2.0,
        "throttle_floor_clock_mhz": 538.197,
        "dynamic_power_w": 215.872,
    },
}
FITTED_WORKLOADS: dict[str, dict[str, float]] = {
    "A40+bert-base-uncased+gpu0": {
        "compute_s": 0.256836,
        "memory_s": 0.0,
        "floor_s": 0.241169,
        "overlap_exponent": 12.0875,
        "activity": 0.841504,
        "wait_activity": 1.0,
    },
    "A40+resnet18+gpu0": {
        "compute_s": 0.157258,
        "memory_s": 0.00884603,
        "floor_s": 0.230797,
        "overlap_exponent": 40.0,
        "activity": 0.810498,
        "wait_activity": 0.467895,
    },
    "A40+resnet18+gpu0,1,2,3": {
        "compute_s": 0.474798,
        "memory_s": 0.0,
        "floor_s": 0.910189,
        "overlap_exponent": 40.0,
        "activity": 0.319283,
        "wait_activity": 0.440161,
    },
    "A40+resnet50+gpu0": {
        "compute_s": 0.409899,
        "memory_s": 0.0,
        "floor_s": 0.597605,
        "overlap_exponent": 10.0081,
        "activity": 1.12484,
        "wait_activity": 0.650482,
    },
    "A40+resnet50+gpu0,1,2,3": {
        "compute_s": 0.0764585,
        "memory_s": 0.00348365,
        "floor_s": 0.204355,
        "overlap_exponent": 40.0,
        "activity": 0.438811,
        "wait_activity": 0.510198,
    },
    "A40+shufflenetv2+gpu0": {
        "compute_s": 0.03108,
        "memory_s": 0.0041722,
        "floor_s": 0.0423648,
        "overlap_exponent": 16.809,
        "activity": 0.558658,
        "wait_activity": 0.793482,
    },
    "V100+bert-base-uncased+gpu0": {
        "compute_s": 0.297736,
        "memory_s": 2.00262e-05,
        "floor_s": 0.30824,
        "overlap_exponent": 4.71062,
        "activity": 0.884191,
        "wait_activity": 0.711357,
    },
    "V100+resnet18+gpu0": {
        "compute_s": 0.142978,
        "memory_s": 0.039107,
        "floor_s": 0.256464,
        "overlap_exponent": 30.3243,
        "activity": 0.9754,
        "wait_activity": 0.0729764,
    },
    "V100+resnet18+gpu0,1": {
        "compute_s": 0.0720758,
        "memory_s": 0.0298935,
        "floor_s": 0.263586,
        "overlap_exponent": 22.8463,
        "activity": 0.947342,
        "wait_activity": 0.181531,
    },
    "V100+resnet50+gpu0": {
        "compute_s": 0.510922,
        "memory_s": 0.0897982,
        "floor_s": 0.631714,
        "overlap_exponent": 8.85101,
        "activity": 0.982128,
        "wait_activity": 0.164119,
    },
    "V100+resnet50+gpu0,1": {
        "compute_s": 0.231921,
        "memory_s": 0.102362,
        "floor_s": 0.334611,
        "overlap_exponent": 5.15729,
        "activity": 0.980748,
        "wait_activity": 0.00546941,
    },
    "V100+shufflenetv2+gpu0": {
        "compute_s": 0.0114698,
        "memory_s": 0.0299331,
        "floor_s": 0.0372554,
        "overlap_exponent": 5.8462,
        "activity": 0.666329,
        "wait_activity": 0.0930427,
    },
}
# END GENERATED

# BEGIN PIPELINE FIT (python tools/fit_sim.py instructions --write)
FITTED_PIPELINE_HARDWARE: dict[str, dict[str, float]] = {
    "A100-SXM": {
        "static_power_w": 55.8844,
        "voltage_floor_clock_mhz": 1114.24,
        "voltage_exponent": 2.80964,
    },
}
# END PIPELINE FIT


def _fitted(gpu: str, key: str, fallback: float) -> float:
    """Return a fitted hardware parameter, or `fallback` before the first calibration."""
    return FITTED_HARDWARE.get(gpu, {}).get(key, fallback)


_A40_CLOCKS = sm_clock_table(210, 1740, 15)
_V100_CLOCKS = sm_clock_table(135, 1380, 7.5)
_A100_CLOCKS = sm_clock_table(210, 1410, 15)
_H100_CLOCKS = sm_clock_table(210, 1980, 15)
_A100_SXM_CLOCKS = sm_clock_table(855, 1410, 15)


def _a40() -> HardwareParams:
    static = _fitted("A40", "static_power_w", 70.0)
    return HardwareParams(
        name="NVIDIA A40",
        architecture="ampere",
        min_power_limit_w=100,
        max_power_limit_w=300,
        default_power_limit_w=300,
        idle_power_w=30.0,
        supported_sm_clocks_mhz=_A40_CLOCKS,
        supported_memory_clocks_mhz=(7251, 5001, 810, 405),
        static_power_w=static,
        dynamic_power_w=_fitted("A40", "dynamic_power_w", 300.0 - static),
        voltage_floor_clock_mhz=_fitted("A40", "voltage_floor_clock_mhz", 1000.0),
        voltage_exponent=_fitted("A40", "voltage_exponent", 2.2),
        throttle_floor_clock_mhz=_fitted("A40", "throttle_floor_clock_mhz", 400.0),
    )


def _v100() -> HardwareParams:
    static = _fitted("V100", "static_power_w", 60.0)
    return HardwareParams(
        name="Tesla V100-PCIE-32GB",
        architecture="volta",
        min_power_limit_w=100,
        max_power_limit_w=250,
        default_power_limit_w=250,
        idle_power_w=25.0,
        supported_sm_clocks_mhz=_V100_CLOCKS,
        supported_memory_clocks_mhz=(877,),
        static_power_w=static,
        dynamic_power_w=_fitted("V100", "dynamic_power_w", 250.0 - static),
        voltage_floor_clock_mhz=_fitted("V100", "voltage_floor_clock_mhz", 800.0),
        voltage_exponent=_fitted("V100", "voltage_exponent", 2.2),
        throttle_floor_clock_mhz=_fitted("V100", "throttle_floor_clock_mhz", 300.0),
    )


def _a100_sxm() -> HardwareParams:
    """The A100 SXM4 80GB of the Perseus stage profiles (`data/perseus/`).

    Clocks 855-1410 MHz (the profiled range); 500 W limit (the profiles draw up to ~480 W and
    flatten at the top clocks); static power, voltage floor and exponent fitted to the profiles,
    dynamic power = 500 W - static (so activity ~1 reaches the limit at the highest clock).
    """
    fitted = FITTED_PIPELINE_HARDWARE.get("A100-SXM", {})
    static = fitted.get("static_power_w", 62.0)
    return HardwareParams(
        name="NVIDIA A100-SXM4-80GB",
        architecture="ampere",
        min_power_limit_w=100,
        max_power_limit_w=500,
        default_power_limit_w=500,
        idle_power_w=50.0,
        supported_sm_clocks_mhz=_A100_SXM_CLOCKS,
        supported_memory_clocks_mhz=(1593,),
        static_power_w=static,
        dynamic_power_w=500.0 - static,
        voltage_floor_clock_mhz=fitted.get("voltage_floor_clock_mhz", 1100.0),
        voltage_exponent=fitted.get("voltage_exponent", 2.8),
        throttle_floor_clock_mhz=float(_A100_SXM_CLOCKS[-1]),
    )


def _scaled(
    base: HardwareParams,
    *,
    name: str,
    min_w: int,
    max_w: int,
    idle_w: float,
    clocks: tuple[int, ...],
    memory_clocks: tuple[int, ...],
) -> HardwareParams:
    """Extrapolate a GPU from a fitted one of the same family.

    The static power scales with the TDP but stays at most 80% of the lowest limit (so the
    lowest limit is reachable at low clocks), the dynamic power fills the rest of the TDP, and
    the voltage floor and throttle floor stay at the same fraction of the highest clock.
    """
    ratio = max_w / base.max_power_limit_w
    static = min(base.static_power_w * ratio, 0.8 * min_w)
    clock_ratio = clocks[0] / base.max_sm_clock_mhz
    return HardwareParams(
        name=name,
        architecture=base.architecture if "H100" not in name else "hopper",
        min_power_limit_w=min_w,
        max_power_limit_w=max_w,
        default_power_limit_w=max_w,
        idle_power_w=idle_w,
        supported_sm_clocks_mhz=clocks,
        supported_memory_clocks_mhz=memory_clocks,
        static_power_w=static,
        dynamic_power_w=max_w - static,
        voltage_floor_clock_mhz=base.voltage_floor_clock_mhz * clock_ratio,
        voltage_exponent=base.voltage_exponent,
        throttle_floor_clock_mhz=base.throttle_floor_clock_mhz * clock_ratio,
    )


_A40 = _a40()

PRESETS: dict[str, HardwareParams] = {
    "A40": _A40,
    "V100": _v100(),
    "A100": _scaled(
        _A40,
        name="NVIDIA A100-SXM4-40GB",
        min_w=100,
        max_w=400,
        idle_w=55.0,
        clocks=_A100_CLOCKS,
        memory_clocks=(1215,),
    ),
    "H100": _scaled(
        _A40,
        name="NVIDIA H100 80GB HBM3",
        min_w=200,
        max_w=700,
        idle_w=70.0,
        clocks=_H100_CLOCKS,
        memory_clocks=(2619,),
    ),
    "A100-SXM": _a100_sxm(),
}
"""Hardware presets by short name."""

WORKLOADS: dict[str, WorkloadParams] = {
    name: WorkloadParams(
        compute_s=p["compute_s"],
        memory_s=p["memory_s"],
        floor_s=p["floor_s"],
        overlap_exponent=p["overlap_exponent"],
        activity=p["activity"],
        wait_activity=p["wait_activity"],
        description=f"fitted to data/reference-profiles/{name}.csv",
    )
    for name, p in FITTED_WORKLOADS.items()
}
"""Workloads by name: the 12 fitted profiles (CSV stems) and generic ones."""

WORKLOADS["compute-bound"] = WorkloadParams(
    compute_s=0.25,
    memory_s=0.03,
    floor_s=0.0,
    activity=0.95,
    wait_activity=0.3,
    description="generic: a step that is almost all SM-bound kernels",
)
WORKLOADS["memory-bound"] = WorkloadParams(
    compute_s=0.08,
    memory_s=0.17,
    floor_s=0.0,
    activity=0.6,
    wait_activity=0.3,
    description="generic: a step dominated by memory-bound kernels",
)
WORKLOADS["input-bound"] = WorkloadParams(
    compute_s=0.12,
    memory_s=0.03,
    floor_s=0.25,
    overlap_exponent=6.0,
    activity=0.8,
    wait_activity=0.25,
    description="generic: a step starved by its input pipeline (GPU work overlaps the floor)",
)
