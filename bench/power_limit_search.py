"""Benchmark: adaptive vs exhaustive power-limit search, replayed through the state machine.

Every reference profile (data/reference-profiles/*.csv) under every selector of the reference test
grid (ZeusCost eta in {0, 0.25, 0.5, 0.75, 1} with world_size = the profile's GPU count, Energy,
Time: 12 x 7 = 84 cases) is replayed like a trainer would drive `PowerLimitStateMachine`:
`start()`, then `on_step_begin()` per step, executing the effects; each closed window is recorded
with the replayed row of the current limit, scaled to the window's length and perturbed by seeded
Gaussian noise (sigma per 40-step window, sqrt(40/steps) larger for shorter windows, independent
for time and energy), so a strategy cannot profit from a noise-free replay. A strategy sees only
what it recorded.

Figures, per noise level, over several seeds:
* within_1pct: share of (case, seed) whose pick costs at most 1% more than the exhaustive pick on
  the noise-free reference data (cost = the selector's own cost on the reference rows);
* worst_regret: largest such excess cost;
* time_ratio: training time spent in warm-up + profiling, adaptive / exhaustive, summed over cases
  (mean_case_time_ratio: the per-case mean).
The noisy exhaustive search is scored the same way for reference.

If `zeus_agent.gpu.sim.physics` exists, the same runs on simulated workloads (every preset GPU x
workload: fitted ones on their own GPU, generic ones on every GPU). The last line printed is one
JSON object with all figures.

Usage: python bench/power_limit_search.py [--seeds N] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import random
import sys
import time as wallclock
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator.power_limit import (  # noqa: E402
    Adaptive,
    BeginWindow,
    Done,
    EndWindow,
    Energy,
    OptimumSelector,
    PowerLimitMeasurement,
    PowerLimitStateMachine,
    Profiling,
    SearchStrategy,
    SetPowerLimit,
    Time,
    Warmup,
    ZeusCost,
)
from coordinator.power_limit.search import cost_function  # noqa: E402

PROFILE_DIR = ROOT / "data" / "reference-profiles"
REFERENCE_STEPS = 40  # Steps in one reference window.
WARMUP_STEPS = 10


@dataclass(frozen=True)
class Profile:
    """Time (s) and energy (J, all GPUs) of a 40-step window per power limit (W)."""

    name: str
    n_gpus: int
    limits: tuple[int, ...]  # Highest first.
    time: dict[int, float]
    energy: dict[int, float]

    def measurements(self) -> list[PowerLimitMeasurement]:
        return [
            PowerLimitMeasurement(power_limit=pl, energy=self.energy[pl], time=self.time[pl])
            for pl in self.limits
        ]


def load_reference_profiles(directory: Path = PROFILE_DIR) -> list[Profile]:
    profiles = []
    for path in sorted(directory.glob("*.csv")):
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        energy_cols = [k for k in rows[0] if k.endswith("_energy")]
        limits, times, energies = [], {}, {}
        for row in rows:
            pl = int(row["window_name"].rsplit("_", 1)[1])
            limits.append(pl)
            times[pl] = float(row["elapsed_time"])
            energies[pl] = sum(float(row[k]) for k in energy_cols)
        profiles.append(Profile(path.stem, len(energy_cols), tuple(limits), times, energies))
    return profiles


def selector_grid(n_gpus: int) -> list[tuple[str, OptimumSelector]]:
    grid: list[tuple[str, OptimumSelector]] = [
        (f"ZeusCost({eta})", ZeusCost(eta, world_size=n_gpus)) for eta in (0, 0.25, 0.5, 0.75, 1)
    ]
    return [*grid, ("Energy", Energy()), ("Time", Time())]


@dataclass(frozen=True)
class Replay:
    pick: int
    profiling_time_s: float
    windows: int
    profiled: tuple[int, ...]  # Limits with at least one recorded window, highest first.


def replay(
    profile: Profile,
    selector: OptimumSelector,
    search: str | SearchStrategy,
    *,
    rng: random.Random,
    sigma: float,
    epoch_steps: int | None = None,
    record_delay: int = 0,
    max_steps: int = 100_000,
) -> Replay:
    """Drive a state machine over a profile as a trainer would, and return its pick.

    Args:
        profile: The replayed profile.
        selector: The optimum selector.
        search: The search strategy.
        rng: Noise source.
        sigma: Relative noise (1 sigma) of a 40-step window's time and energy.
        epoch_steps: Call `on_epoch_end` every this many steps (None: one endless epoch).
        record_delay: Steps between a window's end and its record (0: at once).
        max_steps: Safety bound.

    Returns:
        The pick, the training time spent in warm-up and profiling, and the number of windows.
    """
    machine = PowerLimitStateMachine(
        min_power_limit=min(profile.limits),
        max_power_limit=max(profile.limits),
        optimum_selector=selector,
        world_size=profile.n_gpus,
        warmup_steps=WARMUP_STEPS,
        profile_steps=REFERENCE_STEPS,
        search=search,
    )
    current = max(profile.limits)
    open_windows: dict[str, list[int]] = {}  # name -> [limit, steps so far]
    to_record: list[tuple[int, str, float, float]] = []  # (due step, name, time, energy)
    spent = 0.0
    windows = 0

    def execute(effects: Sequence[object], step: int) -> None:
        nonlocal current, windows
        for effect in effects:
            if isinstance(effect, SetPowerLimit):
                current = effect.watts
            elif isinstance(effect, BeginWindow):
                open_windows[effect.name] = [current, 0]
            elif isinstance(effect, EndWindow):
                limit, steps = open_windows.pop(effect.name)
                if effect.cancel:
                    continue
                windows += 1
                scale = steps / REFERENCE_STEPS
                noise = sigma * math.sqrt(REFERENCE_STEPS / steps)
                t = profile.time[limit] * scale * (1 + rng.gauss(0, noise))
                e = profile.energy[limit] * scale * (1 + rng.gauss(0, noise))
                to_record.append((step + record_delay, effect.name, t, e))

    def flush(step: int) -> None:
        while to_record and to_record[0][0] <= step:
            _, name, t, e = to_record.pop(0)
            execute(machine.record(name, t, e), step)

    execute(machine.start(), 0)
    for step in range(1, max_steps + 1):
        execute(machine.on_step_begin(), step)
        flush(step)
        if isinstance(machine.state, Done):
            break
        # The training step runs now, at the current limit.
        for window in open_windows.values():
            window[1] += 1
        if isinstance(machine.state, Warmup | Profiling):
            spent += profile.time[current] / REFERENCE_STEPS
        if epoch_steps and step % epoch_steps == 0:
            execute(machine.on_epoch_end(), step)
    assert machine.optimal_power_limit is not None, "replay did not finish"
    profiled = tuple(sorted({r.power_limit for r in machine.window_results}, reverse=True))
    return Replay(machine.optimal_power_limit, spent, windows, profiled)


def evaluate(
    profiles: Sequence[Profile],
    search: str | SearchStrategy,
    seeds: Sequence[int],
    sigma: float,
) -> dict[str, float]:
    """Score a search strategy over profiles x selector grid x seeds (see module docstring)."""
    within = total = 0
    worst = 0.0
    regrets = []
    spent_new = spent_ref = 0.0
    case_ratios = []
    for profile in profiles:
        reference = profile.measurements()
        exhaustive_time = sum(
            profile.time[pl] * (WARMUP_STEPS + REFERENCE_STEPS) / REFERENCE_STEPS
            for pl in profile.limits
        )
        for label, selector in selector_grid(profile.n_gpus):
            cost_of = cost_function(selector)
            assert cost_of is not None
            costs = cost_of(reference)
            best = costs[selector.select(reference)]
            for seed in seeds:
                rng = random.Random(f"{profile.name}|{label}|{seed}|{sigma}")
                result = replay(profile, selector, search, rng=rng, sigma=sigma)
                regret = costs[result.pick] / best - 1
                regrets.append(regret)
                within += regret <= 0.01 + 1e-12
                total += 1
                worst = max(worst, regret)
                spent_new += result.profiling_time_s
                spent_ref += exhaustive_time
                case_ratios.append(result.profiling_time_s / exhaustive_time)
    return {
        "cases": total,
        "within_1pct": round(within / total, 4),
        "worst_regret": round(worst, 4),
        "mean_regret": round(sum(regrets) / len(regrets), 5),
        "time_ratio": round(spent_new / spent_ref, 4),
        "mean_case_time_ratio": round(sum(case_ratios) / len(case_ratios), 4),
    }


def simulated_profiles() -> list[Profile] | None:
    """Build profiles from the simulated GPU, or None if its module is not available."""
    if importlib.util.find_spec("zeus_agent.gpu.sim.physics") is None:
        return None
    try:
        from zeus_agent.gpu.sim.physics import operating_point
        from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
    except ImportError:
        return None
    profiles = []
    for wl_name, wl in WORKLOADS.items():
        if "+" in wl_name:  # Fitted to a reference profile: its own GPU and GPU count.
            gpu, _, gpus = wl_name.split("+")
            pairs = [(gpu, gpus.count(",") + 1)] if gpu in PRESETS else []
        else:
            pairs = [(gpu, 1) for gpu in PRESETS]
        for gpu, n_gpus in pairs:
            hw = PRESETS[gpu]
            limits = tuple(range(hw.max_power_limit_w, hw.min_power_limit_w - 1, -25))
            times, energies = {}, {}
            for pl in limits:
                point = operating_point(hw, wl, pl)
                times[pl] = point.step_time_s * REFERENCE_STEPS
                energies[pl] = point.energy_j * REFERENCE_STEPS * n_gpus
            profiles.append(Profile(f"sim:{gpu}+{wl_name}", n_gpus, limits, times, energies))
    return profiles


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="noise seeds per case")
    parser.add_argument("--quick", action="store_true", help="one noise level, fewer seeds")
    args = parser.parse_args(argv)
    started = wallclock.perf_counter()
    seeds = list(range(2 if args.quick else args.seeds))
    sigmas = (0.01,) if args.quick else (0.01, 0.02)
    adaptive = Adaptive()
    targets = {"within_1pct": 0.95, "worst_regret": 0.05, "time_ratio": 0.5}
    out: dict[str, object] = {
        "bench": "power_limit_search",
        "strategy": repr(adaptive),
        "seeds": len(seeds),
        "targets": targets,
    }
    profiles = load_reference_profiles()
    print(f"{len(profiles)} reference profiles x 7 selectors = {len(profiles) * 7} cases")
    for sigma in sigmas:
        key = f"reference_noise_{sigma:g}"
        runs = {
            "adaptive": evaluate(profiles, adaptive, seeds, sigma),
            "exhaustive": evaluate(profiles, "exhaustive", seeds, sigma),
        }
        a = runs["adaptive"]
        res: dict[str, object] = dict(runs)
        res["meets_targets"] = (
            a["within_1pct"] >= targets["within_1pct"]
            and a["worst_regret"] <= targets["worst_regret"]
            and a["time_ratio"] <= targets["time_ratio"]
        )
        out[key] = res
        for name in ("adaptive", "exhaustive"):
            r = runs[name]
            print(
                f"[reference, noise {sigma:.0%}] {name:10s} within 1%: {r['within_1pct']:.1%}"
                f"  worst regret: {r['worst_regret']:.1%}  time ratio: {r['time_ratio']:.1%}"
            )
    sim = simulated_profiles()
    if sim is None:
        print("simulated workloads: unavailable (zeus_agent.gpu.sim.physics not found)")
        out["simulated"] = "unavailable"
    else:
        sim_seeds = seeds[:3]
        sim_runs = {
            "adaptive": evaluate(sim, adaptive, sim_seeds, 0.01),
            "exhaustive": evaluate(sim, "exhaustive", sim_seeds, 0.01),
        }
        out["simulated_noise_0.01"] = {"profiles": len(sim), **sim_runs}
        for name in ("adaptive", "exhaustive"):
            r = sim_runs[name]
            print(
                f"[simulated {len(sim)} profiles, noise 1%] {name:10s} within 1%: "
                f"{r['within_1pct']:.1%}  worst regret: {r['worst_regret']:.1%}"
                f"  time ratio: {r['time_ratio']:.1%}"
            )
    out["elapsed_s"] = round(wallclock.perf_counter() - started, 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
