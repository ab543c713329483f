"""The simulated GPU against the reference power-limit profiles: the check of the shipped numbers.

Pieces:

* `ProfileRow`, `Profile`, `load_profile`, `load_profiles`: read the reference CSVs
  (`data/reference-profiles/`, one row per power limit: a 40-step window's time and each GPU's
  energy).
* `evaluate`, `calibration_report`: compare the model with the measurements: relative errors
  per point, per profile and overall, and the regret of the model's energy-optimal limit.
* `render_report`: the error table.

The fit that produced the shipped numbers (`presets.py`'s GENERATED block) runs offline:
``python tools/fit_sim.py power-limit`` refits and prints this table, ``--write`` rewrites the
block. Tests and the simulator only evaluate the shipped numbers.

Compared quantities: the step time (window time / 40) and the mean energy per GPU of the
window (the window energy summed over GPUs divided by their number, so relative errors equal
those of the summed energy). The fit uses continuous clocks; the report uses supported clocks,
as the simulator does.
"""

from __future__ import annotations

import csv
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zeus_agent.gpu.sim import presets
from zeus_agent.gpu.sim.physics import (
    HardwareParams,
    WorkloadParams,
    operating_point,
)

__all__ = [
    "DEFAULT_PROFILE_DIR",
    "STEPS_PER_WINDOW",
    "Profile",
    "ProfileRow",
    "calibration_report",
    "evaluate",
    "load_profile",
    "load_profiles",
    "render_report",
]

STEPS_PER_WINDOW = 40
"""Training steps in one profiling window of the reference CSVs."""

DEFAULT_PROFILE_DIR = Path(__file__).resolve().parents[3] / "data" / "reference-profiles"
"""`data/reference-profiles/` of the repository."""


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One profiled power limit.

    Attributes:
        power_limit_w: The power limit of the window (W).
        step_time_s: Window time divided by the steps in it (s).
        energies_j: Each GPU's energy over the window (J).
    """

    power_limit_w: int
    step_time_s: float
    energies_j: tuple[float, ...]

    @property
    def mean_energy_j(self) -> float:
        """Mean energy per GPU over the window (J)."""
        return sum(self.energies_j) / len(self.energies_j)

    @property
    def total_energy_j(self) -> float:
        """Energy summed over GPUs over the window (J)."""
        return sum(self.energies_j)


@dataclass(frozen=True, slots=True)
class Profile:
    """One reference profile (one CSV).

    Attributes:
        name: The CSV stem, e.g. "A40+resnet50+gpu0,1,2,3".
        gpu_type: The GPU preset name, e.g. "A40".
        model: The trained model, e.g. "resnet50".
        rows: The power limits, highest first.
    """

    name: str
    gpu_type: str
    model: str
    rows: tuple[ProfileRow, ...]

    @property
    def num_gpus(self) -> int:
        """GPUs the job ran on."""
        return len(self.rows[0].energies_j)


def load_profile(path: str | Path) -> Profile:
    """Read one reference CSV.

    Args:
        path: The CSV file; its stem is "<GPU>+<model>+gpu<ids>".

    Returns:
        The profile.

    Raises:
        ValueError: When the name or a row does not have the expected shape.
    """
    path = Path(path)
    parts = path.stem.split("+")
    if len(parts) != 3:
        raise ValueError(f"{path.name}: expected '<GPU>+<model>+gpu<ids>.csv'")
    rows: list[ProfileRow] = []
    with path.open(newline="") as fh:
        for rec in csv.DictReader(fh):
            match = re.search(r"(\d+)$", rec["window_name"])
            if match is None:
                raise ValueError(f"{path.name}: window {rec['window_name']!r} lacks a limit")
            energies = tuple(
                float(v) for k, v in rec.items() if k.startswith("gpu") and k.endswith("_energy")
            )
            rows.append(
                ProfileRow(
                    power_limit_w=int(match.group(1)),
                    step_time_s=float(rec["elapsed_time"]) / STEPS_PER_WINDOW,
                    energies_j=energies,
                )
            )
    if not rows:
        raise ValueError(f"{path.name}: no rows")
    rows.sort(key=lambda r: -r.power_limit_w)
    return Profile(name=path.stem, gpu_type=parts[0], model=parts[1], rows=tuple(rows))


def load_profiles(directory: str | Path = DEFAULT_PROFILE_DIR) -> list[Profile]:
    """Read every reference CSV of a directory, sorted by name.

    Args:
        directory: Where the CSVs are (default: the repository's `data/reference-profiles/`).

    Returns:
        The profiles.
    """
    return [load_profile(p) for p in sorted(Path(directory).glob("*.csv"))]


def evaluate(hw: HardwareParams, wl: WorkloadParams, profile: Profile) -> dict[str, Any]:
    """Compare the model with one profile, using supported clocks as the simulator does.

    Args:
        hw: The GPU model.
        wl: The profile's workload.
        profile: The measurements.

    Returns:
        A dict with ``points`` (per limit: measured and model time and energy, relative errors,
        model clock), ``time_err_median``, ``time_err_max``, ``energy_err_median``,
        ``energy_err_max`` (absolute relative errors), ``measured_best_w``, ``model_best_w``
        and ``regret`` (measured energy at the model's pick over the measured minimum, minus 1).
    """
    points: list[dict[str, float]] = []
    for row in profile.rows:
        op = operating_point(hw, wl, row.power_limit_w)
        energy = op.energy_j * STEPS_PER_WINDOW * profile.num_gpus
        points.append(
            {
                "power_limit_w": row.power_limit_w,
                "sm_clock_mhz": op.sm_clock_mhz,
                "step_time_s": row.step_time_s,
                "model_step_time_s": op.step_time_s,
                "energy_j": row.total_energy_j,
                "model_energy_j": energy,
                "time_err": op.step_time_s / row.step_time_s - 1.0,
                "energy_err": energy / row.total_energy_j - 1.0,
            }
        )
    measured_best = min(points, key=lambda p: p["energy_j"])
    model_best = min(points, key=lambda p: p["model_energy_j"])
    t_abs = [abs(p["time_err"]) for p in points]
    e_abs = [abs(p["energy_err"]) for p in points]
    return {
        "profile": profile.name,
        "points": points,
        "time_err_median": statistics.median(t_abs),
        "time_err_max": max(t_abs),
        "energy_err_median": statistics.median(e_abs),
        "energy_err_max": max(e_abs),
        "measured_best_w": int(measured_best["power_limit_w"]),
        "model_best_w": int(model_best["power_limit_w"]),
        "regret": model_best["energy_j"] / measured_best["energy_j"] - 1.0,
    }


def _percentile(values: Sequence[float], q: float) -> float:
    """Return the q-th percentile (linear interpolation, as numpy's default)."""
    return float(np.percentile(np.asarray(values), q))


def calibration_report(
    profiles: Sequence[Profile] | None = None,
    hardware: Mapping[str, HardwareParams] | None = None,
    workloads: Mapping[str, WorkloadParams] | None = None,
    *,
    regret_tolerance: float = 0.02,
) -> dict[str, Any]:
    """Evaluate parameters (default: the shipped presets) against the reference profiles.

    Args:
        profiles: The measurements (default: `load_profiles()`).
        hardware: Hardware by GPU type (default: `presets.PRESETS`).
        workloads: Workloads by profile name (default: `presets.WORKLOADS`).
        regret_tolerance: Regret up to which a profile's pick counts as good (fraction).

    Returns:
        ``{"profiles": [evaluate(...) per profile], "overall": {...}}`` where overall holds
        ``points``, ``time_err_median``, ``time_err_p90``, ``time_err_max``,
        ``energy_err_median``, ``energy_err_p90``, ``energy_err_max``, ``regret_within`` (count
        of profiles with regret <= tolerance), ``num_profiles`` and ``regret_tolerance``.

    Raises:
        KeyError: When a profile has no workload or GPU type in the parameters.
    """
    profiles = load_profiles() if profiles is None else profiles
    hardware = presets.PRESETS if hardware is None else hardware
    workloads = presets.WORKLOADS if workloads is None else workloads
    per_profile = [evaluate(hardware[p.gpu_type], workloads[p.name], p) for p in profiles]
    t_abs = [abs(pt["time_err"]) for r in per_profile for pt in r["points"]]
    e_abs = [abs(pt["energy_err"]) for r in per_profile for pt in r["points"]]
    return {
        "profiles": per_profile,
        "overall": {
            "points": len(t_abs),
            "time_err_median": statistics.median(t_abs),
            "time_err_p90": _percentile(t_abs, 90),
            "time_err_max": max(t_abs),
            "energy_err_median": statistics.median(e_abs),
            "energy_err_p90": _percentile(e_abs, 90),
            "energy_err_max": max(e_abs),
            "regret_within": sum(r["regret"] <= regret_tolerance + 1e-12 for r in per_profile),
            "num_profiles": len(per_profile),
            "regret_tolerance": regret_tolerance,
        },
    }


def render_report(report: Mapping[str, Any]) -> str:
    """Render a `calibration_report` as a Markdown table.

    Args:
        report: The report.

    Returns:
        The table, one row per profile and an overall row.
    """
    lines = [
        "| profile | time err median | time err max | energy err median | energy err max "
        "| measured best (W) | model best (W) | regret |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["profiles"]:
        lines.append(
            f"| {r['profile']} | {r['time_err_median']:.1%} | {r['time_err_max']:.1%} "
            f"| {r['energy_err_median']:.1%} | {r['energy_err_max']:.1%} "
            f"| {r['measured_best_w']} | {r['model_best_w']} | {r['regret']:.1%} |"
        )
    o = report["overall"]
    lines += [
        "",
        f"Overall over {o['points']} points: time error median {o['time_err_median']:.2%}, "
        f"p90 {o['time_err_p90']:.2%}, max {o['time_err_max']:.2%}; energy error median "
        f"{o['energy_err_median']:.2%}, p90 {o['energy_err_p90']:.2%}, max "
        f"{o['energy_err_max']:.2%}; regret <= {o['regret_tolerance']:.0%} on "
        f"{o['regret_within']} of {o['num_profiles']} profiles.",
    ]
    return "\n".join(lines)

