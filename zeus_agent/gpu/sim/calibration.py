"""Calibration of the simulated GPU against the reference power-limit profiles.

Pieces:

* `ProfileRow`, `Profile`, `load_profile`, `load_profiles`: read the reference CSVs
  (`data/reference-profiles/`, one row per power limit: a 40-step window's time and each GPU's
  energy).
* `fit`: fit the hardware curve per GPU type (shared by that type's profiles) and one
  `WorkloadParams` per profile, by robust least squares on log time and log energy.
* `evaluate`, `calibration_report`: compare the model with the measurements: relative errors
  per point, per profile and overall, and the regret of the model's energy-optimal limit.
* `render_report`, `render_presets_block`, `main`: ``python -m zeus_agent.gpu.sim.calibration``
  refits and prints the error table; ``--write`` also rewrites the GENERATED block of
  `presets.py`. Tests and the simulator only evaluate the shipped numbers.

Compared quantities: the step time (window time / 40) and the mean energy per GPU of the
window (the window energy summed over GPUs divided by their number, so relative errors equal
those of the summed energy). The fit uses continuous clocks; the report uses supported clocks,
as the simulator does.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

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
    "fit",
    "load_profile",
    "load_profiles",
    "main",
    "render_presets_block",
    "render_report",
]

STEPS_PER_WINDOW = 40
"""Training steps in one profiling window of the reference CSVs."""

DEFAULT_PROFILE_DIR = Path(__file__).resolve().parents[3] / "data" / "reference-profiles"
"""`data/reference-profiles/` of the repository."""

_HW_KEYS = (
    "static_power_w",
    "voltage_floor_clock_mhz",
    "voltage_exponent",
    "throttle_floor_clock_mhz",
)
_WL_KEYS = ("compute_s", "memory_s", "floor_s", "overlap_exponent", "activity", "wait_activity")


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


def _hardware_from(base: HardwareParams, values: Sequence[float]) -> HardwareParams:
    """Return `base` with the fitted curve parameters (dynamic power fills the TDP)."""
    static, x_v, alpha, x_tf = values
    f_max = base.max_sm_clock_mhz
    return HardwareParams(
        name=base.name,
        architecture=base.architecture,
        min_power_limit_w=base.min_power_limit_w,
        max_power_limit_w=base.max_power_limit_w,
        default_power_limit_w=base.default_power_limit_w,
        idle_power_w=base.idle_power_w,
        supported_sm_clocks_mhz=base.supported_sm_clocks_mhz,
        supported_memory_clocks_mhz=base.supported_memory_clocks_mhz,
        static_power_w=static,
        dynamic_power_w=base.max_power_limit_w - static,
        voltage_floor_clock_mhz=x_v * f_max,
        voltage_exponent=alpha,
        throttle_floor_clock_mhz=x_tf * f_max,
    )


def _workload_from(values: Sequence[float], name: str) -> WorkloadParams:
    """Build a workload from a parameter vector (order of `_WL_KEYS`)."""
    compute, memory, floor, p, act, wait = values
    return WorkloadParams(
        compute_s=compute,
        memory_s=memory,
        floor_s=floor,
        overlap_exponent=p,
        activity=act,
        wait_activity=wait,
        description=f"fitted to data/reference-profiles/{name}.csv",
    )


def _residuals(
    hw: HardwareParams, wl: WorkloadParams, profile: Profile, *, quantize: bool
) -> list[float]:
    """Return log(model / measured) for time and energy of every row."""
    out: list[float] = []
    for row in profile.rows:
        op = operating_point(hw, wl, row.power_limit_w, quantize=quantize)
        out.append(math.log(op.step_time_s / row.step_time_s))
        out.append(math.log(op.energy_j * STEPS_PER_WINDOW / row.mean_energy_j))
    return out


def _initial_workload(profile: Profile, static_w: float, dynamic_w: float) -> list[float]:
    """Return a starting point for one profile's workload parameters."""
    top = profile.rows[0]
    power = top.mean_energy_j / (top.step_time_s * STEPS_PER_WINDOW)
    act = min(max((power - static_w) / dynamic_w, 0.1), 1.5)
    t0 = top.step_time_s
    return [0.6 * t0, 0.2 * t0, 0.7 * t0, 4.0, act, 0.3]


def fit(
    profiles: Sequence[Profile],
    bases: Mapping[str, HardwareParams] | None = None,
    *,
    restarts: int = 3,
) -> tuple[dict[str, HardwareParams], dict[str, WorkloadParams]]:
    """Fit the hardware curve per GPU type and one workload per profile.

    Robust (soft L1) least squares on the log ratios of model to measured step time and
    energy, one joint problem per GPU type, with continuous clocks. Several starting points of
    the hardware curve are tried and the lowest cost kept.

    Args:
        profiles: The reference profiles.
        bases: Hardware presets supplying the fixed facts (limits, clocks, idle power); default
            `presets.PRESETS`.
        restarts: Starting points tried per GPU type.

    Returns:
        The fitted hardware by GPU type and the fitted workloads by profile name.
    """
    bases = presets.PRESETS if bases is None else bases
    hardware: dict[str, HardwareParams] = {}
    workloads: dict[str, WorkloadParams] = {}
    for gpu_type in sorted({p.gpu_type for p in profiles}):
        group = [p for p in profiles if p.gpu_type == gpu_type]
        base = bases[gpu_type]
        lo_hw = [20.0, 0.2, 2.0, 0.1]
        hi_hw = [0.8 * base.min_power_limit_w + 40, 0.95, 4.0, 0.6]
        lo_wl = [1e-4, 0.0, 0.0, 1.0, 0.05, 0.0]
        hi_wl = [20.0, 20.0, 20.0, 40.0, 2.0, 1.0]
        best: Any = None
        starts = [[70.0, 0.6, 2.2, 0.25], [50.0, 0.5, 2.5, 0.2], [80.0, 0.7, 2.0, 0.3]]
        for hw0 in starts[: max(1, restarts)]:
            x0 = list(hw0)
            for prof in group:
                x0 += _initial_workload(prof, hw0[0], base.max_power_limit_w - hw0[0])

            def residuals(
                x: np.ndarray, group: list[Profile] = group, base: HardwareParams = base
            ) -> np.ndarray:
                values = [float(v) for v in x]
                hw = _hardware_from(base, values[:4])
                res: list[float] = []
                for i, prof in enumerate(group):
                    vec = values[4 + 6 * i : 10 + 6 * i]
                    res += _residuals(hw, _workload_from(vec, prof.name), prof, quantize=False)
                return np.asarray(res)

            lower = lo_hw + lo_wl * len(group)
            upper = hi_hw + hi_wl * len(group)
            x0 = [
                min(max(v, lo + 1e-9), hi - 1e-9)
                for v, lo, hi in zip(x0, lower, upper, strict=True)
            ]
            sol = least_squares(
                residuals,
                np.asarray(x0),
                bounds=(lower, upper),
                loss="soft_l1",
                f_scale=0.02,
                x_scale="jac",
                max_nfev=4000,
            )
            if best is None or sol.cost < best.cost:
                best = sol
        x = [float(v) for v in best.x]
        hardware[gpu_type] = _hardware_from(base, x[:4])
        for i, prof in enumerate(group):
            workloads[prof.name] = _workload_from(x[4 + 6 * i : 10 + 6 * i], prof.name)
    return hardware, workloads


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


def _fmt(value: float) -> str:
    """Format a fitted number with 6 significant digits (below 1e-6 as 0)."""
    return repr(float(f"{value:.6g}") if abs(value) >= 1e-6 else 0.0)


def render_presets_block(
    hardware: Mapping[str, HardwareParams], workloads: Mapping[str, WorkloadParams]
) -> str:
    """Render the GENERATED block of `presets.py` for fitted parameters.

    Args:
        hardware: Fitted hardware by GPU type.
        workloads: Fitted workloads by profile name.

    Returns:
        Python source defining ``FITTED_HARDWARE`` and ``FITTED_WORKLOADS``.
    """
    lines = ["FITTED_HARDWARE: dict[str, dict[str, float]] = {"]
    for gpu, hw in sorted(hardware.items()):
        lines.append(f"    {json.dumps(gpu)}: {{")
        for key in (*_HW_KEYS, "dynamic_power_w"):
            lines.append(f"        {json.dumps(key)}: {_fmt(getattr(hw, key))},")
        lines.append("    },")
    lines.append("}")
    lines.append("FITTED_WORKLOADS: dict[str, dict[str, float]] = {")
    for name, wl in sorted(workloads.items()):
        lines.append(f"    {json.dumps(name)}: {{")
        for key in _WL_KEYS:
            lines.append(f"        {json.dumps(key)}: {_fmt(getattr(wl, key))},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _write_presets(block: str) -> Path:
    """Replace the GENERATED block of presets.py with `block` and return the file's path."""
    path = Path(presets.__file__)
    text = path.read_text()
    start = text.index("# BEGIN GENERATED")
    start = text.index("\n", start) + 1
    end = text.index("# END GENERATED")
    path.write_text(text[:start] + block + "\n" + text[end:])
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Refit the model to the reference profiles and print the error table.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit code (0).
    """
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--profiles", type=Path, default=DEFAULT_PROFILE_DIR)
    parser.add_argument("--write", action="store_true", help="rewrite presets.py's fitted block")
    parser.add_argument(
        "--shipped", action="store_true", help="only evaluate the shipped presets, no refit"
    )
    args = parser.parse_args(argv)
    profiles = load_profiles(args.profiles)
    if args.shipped:
        print(render_report(calibration_report(profiles)))
        return 0
    hardware, workloads = fit(profiles)
    for gpu, hw in sorted(hardware.items()):
        print(
            f"{gpu}: static {hw.static_power_w:.1f} W, dynamic {hw.dynamic_power_w:.1f} W, "
            f"voltage floor {hw.voltage_floor_clock_mhz:.0f} MHz, exponent "
            f"{hw.voltage_exponent:.2f}, throttle floor {hw.throttle_floor_clock_mhz:.0f} MHz"
        )
    print(render_report(calibration_report(profiles, hardware, workloads)))
    if args.write:
        print(f"wrote {_write_presets(render_presets_block(hardware, workloads))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
