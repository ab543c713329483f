"""Refit the simulated GPU to its real measurements (offline: the simulator only reads the result).

    python tools/fit_sim.py power-limit [--write]    # the GPU curves and workloads of presets.py
    python tools/fit_sim.py instructions [--write]   # the pipeline instructions of instructions.py
    python tools/fit_sim.py power-limit --shipped    # (either) only report the shipped numbers

Two fits, each printing what it found and the model's error against the measurements:

* `power-limit`: robust least squares on log step time and log energy of the 12 reference
  power-limit profiles (`data/reference-profiles/`, read by `zeus_agent.gpu.sim.calibration`):
  the hardware curve per GPU type (shared by that type's profiles) and one `WorkloadParams` per
  profile, with continuous clocks (about 10 s). `--write` rewrites the GENERATED block of
  `zeus_agent/gpu/sim/presets.py`.
* `instructions`: three numbers per pipeline instruction (``compute_s``, ``memory_s``,
  ``activity``) and the A100 SXM's curve, on the four Perseus stage profiles
  (`data/perseus/stage_profiles/`, read by `zeus_agent.gpu.sim.instructions`; about 2 s).
  `--write` rewrites the GENERATED block of `instructions.py` and the PIPELINE FIT block of
  `presets.py`.

The agents, the demo and the tests never fit: they read the shipped numbers, and
`tests/core/test_sim_calibration.py` and `tests/core/test_sim_instructions.py` hold those numbers
to their error targets. Fixed starting points (never the shipped numbers), so a refit
reproduces itself. Needs scipy.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from scipy.sparse import lil_matrix

from zeus_agent.gpu.sim import calibration, instructions, presets
from zeus_agent.gpu.sim.calibration import STEPS_PER_WINDOW, Profile
from zeus_agent.gpu.sim.instructions import (
    DEFAULT_STAGE_PROFILE_DIR,
    INSTRUCTIONS,
    STAGE_PROFILES,
    load_stage_profile,
    preset_for,
)
from zeus_agent.gpu.sim.physics import HardwareParams, WorkloadParams, operating_point

# ---------------------------------------------------------------- the power-limit profiles
_HW_KEYS = (
    "static_power_w",
    "voltage_floor_clock_mhz",
    "voltage_exponent",
    "throttle_floor_clock_mhz",
)
_WL_KEYS = ("compute_s", "memory_s", "floor_s", "overlap_exponent", "activity", "wait_activity")


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


def fit_reference_profiles(
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


def _fmt_preset(value: float) -> str:
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
            lines.append(f"        {json.dumps(key)}: {_fmt_preset(getattr(hw, key))},")
        lines.append("    },")
    lines.append("}")
    lines.append("FITTED_WORKLOADS: dict[str, dict[str, float]] = {")
    for name, wl in sorted(workloads.items()):
        lines.append(f"    {json.dumps(name)}: {{")
        for key in _WL_KEYS:
            lines.append(f"        {json.dumps(key)}: {_fmt_preset(getattr(wl, key))},")
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


# ---------------------------------------------------------------- the pipeline instructions
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
    """The curve parameters of `hw` by name."""
    return {
        "static_power_w": hw.static_power_w,
        "dynamic_power_w": hw.dynamic_power_w,
        "voltage_floor_clock_mhz": hw.voltage_floor_clock_mhz,
        "voltage_exponent": hw.voltage_exponent,
        "throttle_floor_clock_mhz": hw.throttle_floor_clock_mhz,
    }


_Curve = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One instruction's measured (SM clock, time, energy) points."""


def _distinct_curves(
    profiles: Sequence[str], directory: str | Path
) -> tuple[list[_Curve], list[float], list[list[tuple[str, int, str]]]]:
    """Distinct curves (identical stages fitted once, weighted by their multiplicity).

    Returns the curves, their weights and, for each, the (profile, stage, instruction) it fits.
    """
    curves: list[_Curve] = []
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
    return curves, weights, members


def _sparsity(owner: np.ndarray, n_hw: int, n_x: int) -> Any:
    """The Jacobian's pattern: each point's residuals depend on the hardware and its curve."""
    sparsity = lil_matrix((2 * len(owner), n_x), dtype=int)
    for row, i in enumerate(owner):
        for col in list(range(n_hw)) + [n_hw + 3 * int(i) + j for j in range(3)]:
            sparsity[row, col] = 1
            sparsity[len(owner) + row, col] = 1
    return sparsity


def _fit_gpu(
    preset: str, profiles: Sequence[str], directory: str | Path
) -> tuple[HardwareParams, dict[tuple[str, int, str], tuple[float, float, float]]]:
    """Fit one GPU's instructions (and its curve when free) by robust least squares."""
    base = presets.PRESETS[preset]
    f_max = float(base.max_sm_clock_mhz)
    limit = float(base.default_power_limit_w)
    free_hw = _HW_FIT_KEYS if preset in _FREE_HARDWARE else ()
    curves, weights, members = _distinct_curves(profiles, directory)
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
    sparsity = _sparsity(owner, n_hw, len(x0))
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


def _fmt_instruction(value: float) -> str:
    """Format a fitted number with 6 significant digits."""
    return f"{value:.6g}"


def render_blocks(
    hardware: Mapping[str, HardwareParams],
    instructions: Mapping[tuple[str, int, str], tuple[float, float, float]],
) -> tuple[str, str]:
    """Render the GENERATED block of `instructions.py` and the PIPELINE FIT block of `presets.py`.

    Returns:
        (instructions block, presets block), each with its marker lines.
    """
    lines = [
        "# BEGIN GENERATED (python tools/fit_sim.py instructions --write)",
        "# (profile, stage, instruction): (compute_s, memory_s, activity)",
        "FITTED_INSTRUCTIONS: dict[tuple[str, int, str], tuple[float, float, float]] = {",
    ]
    for (profile, stage, ins), values in instructions.items():
        nums = ", ".join(_fmt_instruction(v) for v in values)
        lines.append(f'    ("{profile}", {stage}, "{ins}"): ({nums}),')
    lines += ["}", "# END GENERATED"]
    hw_lines = [
        "# BEGIN PIPELINE FIT (python tools/fit_sim.py instructions --write)",
        "FITTED_PIPELINE_HARDWARE: dict[str, dict[str, float]] = {",
    ]
    for preset in _FREE_HARDWARE:
        hw = hardware[preset]
        hw_lines.append(f'    "{preset}": {{')
        for key in _HW_FIT_KEYS:
            hw_lines.append(f'        "{key}": {_fmt_instruction(getattr(hw, key))},')
        hw_lines.append("    },")
    hw_lines += ["}", "# END PIPELINE FIT"]
    return "\n".join(lines) + "\n", "\n".join(hw_lines) + "\n"


def _replace_block(path: Path, begin: str, end: str, block: str) -> None:
    """Replace the lines from `begin` to `end` (both included) of `path` with `block`."""
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"[^\n]*\n", re.DOTALL)
    if not pattern.search(text):
        raise RuntimeError(f"{path}: no block between {begin!r} and {end!r}")
    path.write_text(pattern.sub(lambda _m: block, text, count=1))


# ---------------------------------------------------------------- command line
def _power_limit(args: argparse.Namespace) -> None:
    """Refit (or report) the reference power-limit profiles."""
    profiles = calibration.load_profiles(args.profiles)
    if args.shipped:
        print(calibration.render_report(calibration.calibration_report(profiles)))
        return
    hardware, workloads = fit_reference_profiles(profiles)
    for gpu, hw in sorted(hardware.items()):
        print(
            f"{gpu}: static {hw.static_power_w:.1f} W, dynamic {hw.dynamic_power_w:.1f} W, "
            f"voltage floor {hw.voltage_floor_clock_mhz:.0f} MHz, exponent "
            f"{hw.voltage_exponent:.2f}, throttle floor {hw.throttle_floor_clock_mhz:.0f} MHz"
        )
    print(calibration.render_report(calibration.calibration_report(profiles, hardware, workloads)))
    if args.write:
        print(f"wrote {_write_presets(render_presets_block(hardware, workloads))}")


def _instructions(args: argparse.Namespace) -> None:
    """Refit (or report) the pipeline instructions."""
    if args.shipped:
        report = instructions.instruction_error_report()
    else:
        hardware, fitted = fit_instructions()
        block, hw_block = render_blocks(hardware, fitted)
        print("presets.py:\n" + hw_block)
        print("instructions.py:\n" + block)
        if args.write:
            _replace_block(
                Path(instructions.__file__), "# BEGIN GENERATED", "# END GENERATED", block
            )
            _replace_block(
                Path(presets.__file__), "# BEGIN PIPELINE FIT", "# END PIPELINE FIT", hw_block
            )
        report = instructions.instruction_error_report(hardware, fitted)
    print(instructions.render_report(report))
    o = report["overall"]
    print(
        f"\nOverall over {o['rows']} rows: time error median {o['time_median']:.2%}, "
        f"p90 {o['time_p90']:.2%}; energy error median {o['energy_median']:.2%}, "
        f"p90 {o['energy_p90']:.2%} (targets: median <= 3%, p90 <= 8%)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: refit one data set (or report its shipped numbers) and optionally write.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit code (0).
    """
    parser = argparse.ArgumentParser(
        prog="python tools/fit_sim.py",
        description="Refit the simulated GPU to its real measurements.",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    pl = sub.add_parser("power-limit", help="the reference power-limit profiles -> presets.py")
    pl.add_argument("--profiles", type=Path, default=calibration.DEFAULT_PROFILE_DIR,
                    help="directory of the reference CSVs")
    ins = sub.add_parser("instructions", help="the Perseus stage profiles -> instructions.py")
    for p in (pl, ins):
        group = p.add_mutually_exclusive_group()
        group.add_argument("--write", action="store_true",
                           help="rewrite the generated blocks with the fit")
        group.add_argument("--shipped", action="store_true",
                           help="only report the shipped numbers' error, no refit")
    args = parser.parse_args(argv)
    (_power_limit if args.what == "power-limit" else _instructions)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
