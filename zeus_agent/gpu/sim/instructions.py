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
* `render_report`: that report as a table.

The fit that produced the shipped numbers (the GENERATED block here, the PIPELINE FIT block of
`presets.py`) runs offline: ``python tools/fit_sim.py instructions`` refits and prints the blocks
and the error report, ``--write`` rewrites the blocks; ``--shipped`` reports the shipped numbers.

Model of one instruction (docs/simulator.md, "Pipeline instructions"): time
``t(f) = compute_s * f_max / f + memory_s`` and power ``P(f) = P_static + a * P_dyn * d(f / f_max)``
at the clock the GPU actually runs (the locked clock, or lower when the power limit throttles).
The fit tunes three numbers per instruction (``compute_s``, ``memory_s``, ``activity``) and,
for the A100 SXM, the GPU's static power, voltage floor and voltage exponent (shared by both
models on that GPU). The A40's curve stays the one fitted to the power-limit reference profiles
(`presets.FITTED_HARDWARE`), so one A40 preset serves both data sets.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Mapping, Sequence
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
    "instruction_cost",
    "instruction_error_report",
    "load_stage_profile",
    "preset_for",
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
# BEGIN GENERATED (python tools/fit_sim.py instructions --write)
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
            f"python tools/fit_sim.py instructions --write"
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
