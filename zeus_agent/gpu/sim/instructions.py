"""Simulated pipeline instructions calibrated on the real Perseus stage profiles.

Pieces:

* `STAGE_PROFILES`, `load_stage_profile`: the four real stage profiles of `data/perseus/`
  (GPT-3 175B and Bloom on A40 and A100 SXM, bf16, 8 pipeline stages): one row per stage,
  instruction (forward/backward) and locked SM clock with the mean time and energy of ONE
  instruction (one microbatch).
* `preset_for`: the `PRESETS` key of a profile's GPU ("A40" or "A100-SXM").
* `stage_workloads`: per pipeline stage, the forward and backward instruction as
  `WorkloadParams` (``floor_s = 0``): ``SimGPU.run_work(wl)`` on a device of `preset_for(profile)`
  with the SM clock locked to ``f`` reproduces the profile's row at ``f`` (within the errors of
  `instruction_error_report`).
* `instruction_cost`: the noiseless (time, energy) of one instruction at a locked clock, under
  the GPU's default power limit (which throttles below the locked clock when the instruction
  draws more: the A40 profiles flatten above ~1450 MHz at 300 W).
* `instruction_error_report`: median and 90th percentile of the relative time and energy
  errors over all rows, per profile and overall.
* `fit_instructions`, `render_blocks`, `main`: ``python -m zeus_agent.gpu.sim.instructions --fit``
  refits, prints the GENERATED blocks and the error report; ``--write`` also rewrites the blocks
  (here and the PIPELINE FIT block of `presets.py`). Without ``--fit`` it reports the shipped
  numbers.

Model of one instruction (docs/simulator.md, "Pipeline instructions"): time
``t(f) = compute_s * f_max / f + memory_s`` and power ``P(f) = P_static + a * P_dyn * d(f / f_max)``
at the clock the GPU actually runs (the locked clock, or lower when the power limit throttles).
The fit tunes three numbers per instruction (``compute_s``, ``memory_s``, ``activity``) and,
for the A100 SXM, the GPU's static power, voltage floor and voltage exponent (shared by both
models on that GPU). The A40's curve stays the one fitted to the power-limit reference profiles
(`presets.FITTED_HARDWARE`), so one A40 preset serves both data sets.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from zeus_agent.gpu.sim import presets
from zeus_agent.gpu.sim.physics import HardwareParams, WorkloadParams, operating_point

__all__ = [
    "DEFAULT_STAGE_PROFILE_DIR",
    "FITTED_INSTRUCTIONS",
    "INSTRUCTIONS",
    "NUM_STAGES",
    "STAGE_PROFILES",
    "fit_instructions",
    "instruction_cost",
    "instruction_error_report",
    "load_stage_profile",
    "main",
    "preset_for",
    "render_blocks",
    "render_report",
    "stage_workloads",
]

DEFAULT_STAGE_PROFILE_DIR = (
    Path(__file__).resolve().parents[3] / "data" / "perseus" / "stage_profiles"
)
"""`data/perseus/stage_profiles/` of the repository."""

STAGE_PROFILES: tuple[str, ...] = (
    "gpt3-175b+a40",
    "gpt3-175b+a100_sxm",
    "bloom+a40",
    "bloom+a100_sxm",
)
"""The real stage profiles, "{model}+{gpu}" (files ``{profile}_bf16.csv``)."""

INSTRUCTIONS: tuple[str, ...] = ("forward", "backward")
"""Instruction types of a profile."""

NUM_STAGES = 8
"""Pipeline stages of the real profiles (0-6 identical, 7 the real last stage)."""

_GPU_PRESETS = {"a40": "A40", "a100_sxm": "A100-SXM"}
_HW_FIT_KEYS = ("static_power_w", "voltage_floor_clock_mhz", "voltage_exponent")
_HW_FIT_BOUNDS = {
    "static_power_w": (10.0, 150.0),
    "voltage_floor_clock_mhz": (500.0, 1400.0),
    "voltage_exponent": (2.0, 4.0),
}
_HW_FIT_STARTS = (
    {"static_power_w": 80.0, "voltage_floor_clock_mhz": 1000.0, "voltage_exponent": 2.5},
    {"static_power_w": 60.0, "voltage_floor_clock_mhz": 1100.0, "voltage_exponent": 2.8},
)
_FREE_HARDWARE = ("A100-SXM",)  # the A40 keeps the curve of the power-limit calibration

# BEGIN GENERATED (python -m zeus_agent.gpu.sim.instructions --fit --write)
# (profile, stage, instruction): (compute_s, memory_s, activity)
FITTED_INSTRUCTIONS: dict[tuple[str, int, str], tuple[float, float, float]] = {
    ("gpt3-175b+a40", 0, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 0, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 1, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 1, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 2, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 2, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 3, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 3, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 4, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 4, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 5, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 5, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 6, "forward"): (0.0550519, 0.0484038, 1.38182),
    ("gpt3-175b+a40", 6, "backward"): (0.0793733, 0.183822, 1.31453),
    ("gpt3-175b+a40", 7, "forward"): (0.0585982, 0.0491204, 1.36469),
    ("gpt3-175b+a40", 7, "backward"): (0.0799078, 0.191502, 1.31616),
    ("gpt3-175b+a100_sxm", 0, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 0, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 1, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 1, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 2, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 2, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 3, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 3, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 4, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 4, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 5, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 5, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 6, "forward"): (0.0443393, 0.0042152, 1.02077),
    ("gpt3-175b+a100_sxm", 6, "backward"): (0.0785265, 0.0108927, 1.03875),
    ("gpt3-175b+a100_sxm", 7, "forward"): (0.0476044, 0.00489011, 0.979065),
    ("gpt3-175b+a100_sxm", 7, "backward"): (0.0833822, 0.0120307, 1.00705),
    ("bloom+a40", 0, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 0, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 1, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 1, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 2, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 2, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 3, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 3, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 4, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 4, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 5, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 5, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 6, "forward"): (0.0394107, 0.0881939, 1.37891),
    ("bloom+a40", 6, "backward"): (0.11743, 0.109375, 1.32174),
    ("bloom+a40", 7, "forward"): (0.0385497, 0.073382, 1.37531),
    ("bloom+a40", 7, "backward"): (0.102805, 0.105621, 1.32622),
    ("bloom+a100_sxm", 0, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 0, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 1, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 1, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 2, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 2, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 3, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 3, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 4, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 4, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 5, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 5, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 6, "forward"): (0.0429616, 0.0069259, 0.951759),
    ("bloom+a100_sxm", 6, "backward"): (0.0794856, 0.0155005, 0.989343),
    ("bloom+a100_sxm", 7, "forward"): (0.0376986, 0.00616018, 0.97454),
    ("bloom+a100_sxm", 7, "backward"): (0.0719908, 0.0137048, 0.995711),
}
# END GENERATED

Row = tuple[int, str, int, float, float]
"""One profile row: (stage, instruction, clock MHz, time s, energy J)."""


def _check_profile(profile: str) -> None:
    if profile not in STAGE_PROFILES:
        raise ValueError(f"unknown stage profile {profile!r}; choose one of {list(STAGE_PROFILES)}")


def preset_for(profile: str) -> str:
    """Return the `PRESETS` key of the GPU a stage profile was measured on.

    Args:
        profile: One of `STAGE_PROFILES`.

    Returns:
        "A40" or "A100-SXM".

    Raises:
        ValueError: When the profile is unknown.
    """
    _check_profile(profile)
    return _GPU_PRESETS[profile.split("+", 1)[1]]


@functools.lru_cache(maxsize=8)
def _load(profile: str, directory: str) -> tuple[Row, ...]:
    path = Path(directory) / f"{profile}_bf16.csv"
    with path.open(newline="") as fh:
        return tuple(
            (
                int(r["stage"]),
                r["instruction"],
                int(r["frequency"]),
                float(r["time"]),
                float(r["energy"]),
            )
            for r in csv.DictReader(fh)
        )


def load_stage_profile(
    profile: str, directory: str | Path = DEFAULT_STAGE_PROFILE_DIR
) -> list[Row]:
    """Return the rows of a real stage profile.

    Args:
        profile: One of `STAGE_PROFILES`.
        directory: Directory of the ``{profile}_bf16.csv`` files.

    Returns:
        (stage, instruction, clock MHz, time s, energy J) per row, in file order.

    Raises:
        ValueError: When the profile is unknown.
    """
    _check_profile(profile)
    return list(_load(profile, str(directory)))


def instruction_cost(
    hw: HardwareParams, wl: WorkloadParams, clock_mhz: int, *, power_limit_w: float | None = None
) -> tuple[float, float]:
    """Return the noiseless time and energy of one instruction at a locked SM clock.

    The same operating point `SimGPU.run_work` uses with both clock locks at `clock_mhz` on a
    device without noise: the power limit (default: the GPU's default limit) still throttles
    below the locked clock when the instruction would draw more.

    Args:
        hw: The GPU model.
        wl: The instruction.
        clock_mhz: The locked SM clock (MHz).
        power_limit_w: The power limit in force, or None for the GPU's default (W).

    Returns:
        (time s, energy J).
    """
    limit = hw.default_power_limit_w if power_limit_w is None else power_limit_w
    point = operating_point(hw, wl, limit, max_sm_clock_mhz=clock_mhz, min_sm_clock_mhz=clock_mhz)
    return point.step_time_s, point.energy_j


def _workload(profile: str, stage: int, instruction: str) -> WorkloadParams:
    try:
        compute_s, memory_s, activity = FITTED_INSTRUCTIONS[(profile, stage, instruction)]
    except KeyError:
        raise ValueError(
            f"no fitted instruction for {profile} stage {stage} {instruction}; run "
            f"python -m zeus_agent.gpu.sim.instructions --fit --write"
        ) from None
    return WorkloadParams(
        compute_s=compute_s,
        memory_s=memory_s,
        floor_s=0.0,
        activity=activity,
        description=(
            f"{instruction} of stage {stage}, fitted to "
            f"data/perseus/stage_profiles/{profile}_bf16.csv"
        ),
    )


def stage_workloads(profile: str, num_stages: int = NUM_STAGES) -> list[dict[str, WorkloadParams]]:
    """Return the forward and backward instruction of every pipeline stage.

    With 8 stages, stage ``i`` is the profile's stage ``i``. With fewer, stages
    ``0..num_stages-2`` are the profile's stage 0 and the last is its stage 7 (the real last
    stage, heavier for GPT-3 and lighter for Bloom), so a shorter pipeline keeps that
    imbalance. The instructions' durations stay those of the 8-stage job.

    Args:
        profile: One of `STAGE_PROFILES`.
        num_stages: Pipeline stages, 1-8.

    Returns:
        Per stage, ``{"forward": wl, "backward": wl}``.

    Raises:
        ValueError: When the profile is unknown or `num_stages` is outside 1-8.
    """
    _check_profile(profile)
    if not 1 <= num_stages <= NUM_STAGES:
        raise ValueError(f"num_stages must be within 1-{NUM_STAGES}, got {num_stages!r}")
    if num_stages == NUM_STAGES:
        sources = list(range(NUM_STAGES))
    else:
        sources = [0] * (num_stages - 1) + [NUM_STAGES - 1]
    return [{ins: _workload(profile, src, ins) for ins in INSTRUCTIONS} for src in sources]


# Evaluation.
def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _summary(time_err: Sequence[float], energy_err: Sequence[float]) -> dict[str, float]:
    return {
        "rows": len(time_err),
        "time_median": _percentile(time_err, 50),
        "time_p90": _percentile(time_err, 90),
        "time_max": max(time_err),
        "energy_median": _percentile(energy_err, 50),
        "energy_p90": _percentile(energy_err, 90),
        "energy_max": max(energy_err),
    }


def instruction_error_report(
    hardware: Mapping[str, HardwareParams] | None = None,
    instructions: Mapping[tuple[str, int, str], tuple[float, float, float]] | None = None,
) -> dict[str, Any]:
    """Compare the simulated instructions with every row of the four real profiles.

    Errors are absolute relative errors ``|model / measured - 1|`` of the time and of the
    energy of one instruction, the model evaluated like the simulator (`instruction_cost`,
    supported clocks, default power limit).

    Args:
        hardware: GPU models by `PRESETS` key (default: `PRESETS`).
        instructions: Fitted instructions (default: the shipped `FITTED_INSTRUCTIONS`).

    Returns:
        ``{"overall": summary, "profiles": {profile: summary}}``, a summary holding ``rows``,
        ``time_median``, ``time_p90``, ``time_max``, ``energy_median``, ``energy_p90`` and
        ``energy_max`` (fractions, e.g. 0.012 for 1.2%).
    """
    hw_by_key: Mapping[str, HardwareParams] = hardware or presets.PRESETS
    table = FITTED_INSTRUCTIONS if instructions is None else instructions
    per_profile: dict[str, dict[str, float]] = {}
    all_t: list[float] = []
    all_e: list[float] = []
    for profile in STAGE_PROFILES:
        hw = hw_by_key[preset_for(profile)]
        t_err: list[float] = []
        e_err: list[float] = []
        for stage, ins, clock, time_s, energy_j in load_stage_profile(profile):
            compute_s, memory_s, activity = table[(profile, stage, ins)]
            wl = WorkloadParams(compute_s=compute_s, memory_s=memory_s, activity=activity)
            t, e = instruction_cost(hw, wl, clock)
            t_err.append(abs(t / time_s - 1.0))
            e_err.append(abs(e / energy_j - 1.0))
        per_profile[profile] = _summary(t_err, e_err)
        all_t += t_err
        all_e += e_err
    return {"overall": _summary(all_t, all_e), "profiles": per_profile}


# Fit.
def _np_model(
    hw: Mapping[str, float], f_max: float, limit: float, params: np.ndarray, clock: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `instruction_cost` with continuous throttled clocks (smooth for the fit).

    `params` holds per row (compute_s, memory_s, activity) as columns.
    """
    compute_s, memory_s, activity = params[:, 0], params[:, 1], params[:, 2]
    static, dyn = hw["static_power_w"], hw["dynamic_power_w"]
    x_v = hw["voltage_floor_clock_mhz"] / f_max
    k = hw["voltage_exponent"] - 1.0
    budget = np.maximum((limit - static) / (activity * dyn), 1e-9)
    x_cap = np.where(budget <= x_v ** (1.0 + k), budget / x_v**k, budget ** (1.0 / (1.0 + k)))
    x = np.minimum(clock / f_max, np.maximum(x_cap, hw["throttle_floor_clock_mhz"] / f_max))
    time_s = compute_s / x + memory_s
    power = static + activity * dyn * x * np.maximum(x, x_v) ** k
    return time_s, power * time_s


def _hardware_dict(hw: HardwareParams) -> dict[str, float]:
    return {
        "static_power_w": hw.static_power_w,
        "dynamic_power_w": hw.dynamic_power_w,
        "voltage_floor_clock_mhz": hw.voltage_floor_clock_mhz,
        "voltage_exponent": hw.voltage_exponent,
        "throttle_floor_clock_mhz": hw.throttle_floor_clock_mhz,
    }


def _fit_gpu(
    preset: str, profiles: Sequence[str], directory: str | Path
) -> tuple[HardwareParams, dict[tuple[str, int, str], tuple[float, float, float]]]:
    """Fit one GPU's instructions (and its curve when free) by robust least squares."""
    from scipy.optimize import least_squares
    from scipy.sparse import lil_matrix

    base = presets.PRESETS[preset]
    f_max = float(base.max_sm_clock_mhz)
    limit = float(base.default_power_limit_w)
    free_hw = _HW_FIT_KEYS if preset in _FREE_HARDWARE else ()
    # Distinct curves (identical stages fitted once, weighted by their multiplicity).
    curves: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    weights: list[float] = []
    members: list[list[tuple[str, int, str]]] = []
    seen: dict[tuple[Any, ...], int] = {}
    for profile in profiles:
        rows = load_stage_profile(profile, directory)
        for stage in sorted({r[0] for r in rows}):
            for ins in INSTRUCTIONS:
                sel = sorted((r for r in rows if r[0] == stage and r[1] == ins), key=lambda r: r[2])
                key = (profile, ins, tuple((r[2], r[3], r[4]) for r in sel))
                if key in seen:
                    weights[seen[key]] += 1.0
                    members[seen[key]].append((profile, stage, ins))
                    continue
                seen[key] = len(curves)
                curves.append(
                    (
                        np.array([r[2] for r in sel], dtype=float),
                        np.array([r[3] for r in sel]),
                        np.array([r[4] for r in sel]),
                    )
                )
                weights.append(1.0)
                members.append([(profile, stage, ins)])
    clock = np.concatenate([c[0] for c in curves])
    time_m = np.concatenate([c[1] for c in curves])
    energy_m = np.concatenate([c[2] for c in curves])
    w = np.concatenate(
        [np.full(len(c[0]), math.sqrt(wt)) for c, wt in zip(curves, weights, strict=True)]
    )
    owner = np.concatenate([np.full(len(c[0]), i) for i, c in enumerate(curves)])
    n_hw = len(free_hw)

    def hardware_of(v: np.ndarray) -> dict[str, float]:
        hw = _hardware_dict(base)
        for name, value in zip(free_hw, v[:n_hw], strict=True):
            hw[name] = float(value)
        if free_hw:
            hw["dynamic_power_w"] = base.max_power_limit_w - hw["static_power_w"]
        return hw

    def residuals(v: np.ndarray) -> np.ndarray:
        params = v[n_hw:].reshape(-1, 3)[owner]
        t, e = _np_model(hardware_of(v), f_max, limit, params, clock)
        return np.concatenate([w * np.log(t / time_m), w * np.log(e / energy_m)])

    # Fixed starting points (not the shipped numbers), so a refit reproduces itself.
    x0: list[float] = [_HW_FIT_STARTS[0][k] for k in free_hw]
    lower: list[float] = [_HW_FIT_BOUNDS[k][0] for k in free_hw]
    upper: list[float] = [_HW_FIT_BOUNDS[k][1] for k in free_hw]
    for c in curves:
        t_fast = float(c[1][-1])
        x0 += [0.8 * t_fast, 0.2 * t_fast, 1.0]
        lower += [1e-6, 0.0, 0.05]
        upper += [10.0, 10.0, 5.0]
    sparsity = lil_matrix((2 * len(clock), len(x0)), dtype=int)
    for row, i in enumerate(owner):
        for col in list(range(n_hw)) + [n_hw + 3 * int(i) + j for j in range(3)]:
            sparsity[row, col] = 1
            sparsity[len(clock) + row, col] = 1
    starts = [x0]
    for alt_start in _HW_FIT_STARTS[1:] if free_hw else ():
        starts.append([alt_start[k] for k in free_hw] + x0[n_hw:])
    best = None
    for start in starts:
        result = least_squares(
            residuals,
            np.clip(np.array(start), lower, upper),
            bounds=(lower, upper),
            loss="soft_l1",
            f_scale=0.02,
            jac_sparsity=sparsity,
            x_scale="jac",
            max_nfev=2000,
        )
        if best is None or result.cost < best.cost:
            best = result
    assert best is not None
    hw_values = hardware_of(best.x)
    hw = replace(
        base,
        static_power_w=hw_values["static_power_w"],
        dynamic_power_w=hw_values["dynamic_power_w"],
        voltage_floor_clock_mhz=hw_values["voltage_floor_clock_mhz"],
        voltage_exponent=hw_values["voltage_exponent"],
    )
    fitted: dict[tuple[str, int, str], tuple[float, float, float]] = {}
    for i, keys in enumerate(members):
        compute_s, memory_s, activity = (float(v) for v in best.x[n_hw + 3 * i : n_hw + 3 * i + 3])
        for name in keys:
            fitted[name] = (compute_s, memory_s, activity)
    return hw, fitted


def fit_instructions(
    directory: str | Path = DEFAULT_STAGE_PROFILE_DIR,
) -> tuple[dict[str, HardwareParams], dict[tuple[str, int, str], tuple[float, float, float]]]:
    """Fit every instruction of the four profiles (and the A100 SXM's curve).

    Args:
        directory: Directory of the stage profile CSVs.

    Returns:
        (hardware by `PRESETS` key, with the fitted GPUs replaced; fitted instructions keyed by
        (profile, stage, instruction) as (compute_s, memory_s, activity)).
    """
    hardware = dict(presets.PRESETS)
    fitted: dict[tuple[str, int, str], tuple[float, float, float]] = {}
    for preset in sorted({preset_for(p) for p in STAGE_PROFILES}):
        profiles = [p for p in STAGE_PROFILES if preset_for(p) == preset]
        hw, instr = _fit_gpu(preset, profiles, directory)
        hardware[preset] = hw
        fitted.update(instr)
    order = {p: i for i, p in enumerate(STAGE_PROFILES)}
    ins_order = {ins: i for i, ins in enumerate(INSTRUCTIONS)}
    ordered = sorted(
        fitted.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], ins_order[kv[0][2]])
    )
    return hardware, dict(ordered)


# Output.
def _fmt(value: float) -> str:
    return f"{value:.6g}"


def render_blocks(
    hardware: Mapping[str, HardwareParams],
    instructions: Mapping[tuple[str, int, str], tuple[float, float, float]],
) -> tuple[str, str]:
    """Render the GENERATED block of this module and the PIPELINE FIT block of `presets.py`.

    Returns:
        (instructions block, presets block), each with its marker lines.
    """
    lines = [
        "# BEGIN GENERATED (python -m zeus_agent.gpu.sim.instructions --fit --write)",
        "# (profile, stage, instruction): (compute_s, memory_s, activity)",
        "FITTED_INSTRUCTIONS: dict[tuple[str, int, str], tuple[float, float, float]] = {",
    ]
    for (profile, stage, ins), values in instructions.items():
        nums = ", ".join(_fmt(v) for v in values)
        lines.append(f'    ("{profile}", {stage}, "{ins}"): ({nums}),')
    lines += ["}", "# END GENERATED"]
    hw_lines = [
        "# BEGIN PIPELINE FIT (python -m zeus_agent.gpu.sim.instructions --fit --write)",
        "FITTED_PIPELINE_HARDWARE: dict[str, dict[str, float]] = {",
    ]
    for preset in _FREE_HARDWARE:
        hw = hardware[preset]
        hw_lines.append(f'    "{preset}": {{')
        for key in _HW_FIT_KEYS:
            hw_lines.append(f'        "{key}": {_fmt(getattr(hw, key))},')
        hw_lines.append("    },")
    hw_lines += ["}", "# END PIPELINE FIT"]
    return "\n".join(lines) + "\n", "\n".join(hw_lines) + "\n"


def _replace_block(path: Path, begin: str, end: str, block: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"[^\n]*\n", re.DOTALL)
    if not pattern.search(text):
        raise RuntimeError(f"{path}: no block between {begin!r} and {end!r}")
    path.write_text(pattern.sub(lambda _m: block, text, count=1))


def render_report(report: Mapping[str, Any]) -> str:
    """Render `instruction_error_report` as a Markdown table."""
    lines = [
        "| profile | rows | time median | time p90 | time max | energy median | energy p90 | "
        "energy max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    items = [*report["profiles"].items(), ("overall", report["overall"])]
    for name, s in items:
        lines.append(
            f"| {name} | {s['rows']} | {s['time_median']:.2%} | {s['time_p90']:.2%} | "
            f"{s['time_max']:.2%} | {s['energy_median']:.2%} | {s['energy_p90']:.2%} | "
            f"{s['energy_max']:.2%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: report the shipped numbers, or refit (``--fit``) and optionally write."""
    parser = argparse.ArgumentParser(prog="python -m zeus_agent.gpu.sim.instructions")
    parser.add_argument("--fit", action="store_true", help="refit and print the blocks")
    parser.add_argument(
        "--write", action="store_true", help="with --fit: rewrite the GENERATED blocks"
    )
    args = parser.parse_args(argv)
    if args.write and not args.fit:
        parser.error("--write needs --fit")
    if args.fit:
        hardware, fitted = fit_instructions()
        block, hw_block = render_blocks(hardware, fitted)
        print("presets.py:\n" + hw_block)
        print("instructions.py:\n" + block)
        if args.write:
            _replace_block(Path(__file__), "# BEGIN GENERATED", "# END GENERATED", block)
            _replace_block(
                Path(presets.__file__), "# BEGIN PIPELINE FIT", "# END PIPELINE FIT", hw_block
            )
        report = instruction_error_report(hardware, fitted)
    else:
        report = instruction_error_report()
    print(render_report(report))
    o = report["overall"]
    print(
        f"\nOverall over {o['rows']} rows: time error median {o['time_median']:.2%}, "
        f"p90 {o['time_p90']:.2%}; energy error median {o['energy_median']:.2%}, "
        f"p90 {o['energy_p90']:.2%} (targets: median <= 3%, p90 <= 8%)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
