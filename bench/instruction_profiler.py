"""InstructionProfiler against a simulated 1F1B pipeline with NVML's coarse energy counter.

A deterministic, pure simulation (no NATS, no sleeping): S stages (default 4), each on its own
simulated GPU, run a synchronous 1F1B pipeline of M microbatches (per stage: min(S-s-1, M)
warm-up forwards, then alternating forward/backward, then the remaining backwards; a forward of
stage s waits for the same microbatch's forward on s-1, a backward for its backward on s+1; the
iteration ends when the last stage finishes, and the next one starts then). A GPU draws its
instruction's power while running it and its idle power while waiting. Its energy counter, as
NVML's, advances only every `--energy-update-ms` (100 ms): counter(t) = the true energy at the
last update before t (each GPU's updates at its own seeded phase).

Per-instruction ground truth is the simulator's instruction model
(`zeus_agent.gpu.sim.instructions`: `stage_workloads` and `instruction_cost` on the profile's
hardware preset); before that module exists, hand-made workloads through
`zeus_agent.gpu.sim.physics.point_at_clock`. Times and energies are scaled so an iteration at the
highest clocks takes `--iteration-s`. Each instruction's time and power get a seeded 1% jitter.

The real `InstructionProfiler` is driven through `next_schedule()` / `observe()` with
`ProfilingResult`s built as the coordinator builds them: every `--profiling-iterations`
iterations, per rank, iteration time (step begin to step end), iteration energy and every
instruction's energy as the agent measures them (its reads are phase-locked, at most one per
counter update, each value filed at its update's instant; an edge is interpolated between the
two updates that bracket it), and every instruction's exact duration. `--counter-at-events`:
the counter as read at each event instead (the agent before phase-locked reads).

Printed: per profile and overall, the median and p90 relative energy error and the median
relative time error over all (stage, instruction, clock) rows of the result against the ground
truth, the profiling time in training seconds and iterations, and the number of settings; then
one JSON line with every figure, the machine and the date.

    .venv/bin/python bench/instruction_profiler.py [--quick]
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import math
import os
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_path = os.path.dirname(os.path.abspath(__file__))
if _path not in sys.path:
    sys.path.insert(0, _path)
_root = os.path.dirname(_path)
if _root not in sys.path:
    sys.path.insert(0, _root)

from _common import machine, now  # noqa: E402

from coordinator.pipeline.schedulers.instruction_profiler import InstructionProfiler  # noqa: E402
from zeus_agent.gpu.sim.physics import HardwareParams, WorkloadParams, point_at_clock  # noqa: E402
from zeus_agent.gpu.sim.presets import PRESETS  # noqa: E402
from zeus_agent.models import (  # noqa: E402
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    ProfilingResult,
    RankInfo,
)
from zeus_agent.pipeline_order import one_f_one_b  # noqa: E402

PROFILES = ("gpt3-175b+a40", "gpt3-175b+a100_sxm", "bloom+a40", "bloom+a100_sxm")
GOAL = {"energy_median": 0.05, "energy_p90": 0.10, "time_median": 0.02, "profile_s": 120.0}

Cost = Callable[[float], tuple[float, float]]
"""Clock (MHz) -> (time s, energy J) of one instruction, noise-free."""


# --------------------------------------------------------------------------- instruction model


def _instructions_module() -> Any | None:
    try:
        return importlib.import_module("zeus_agent.gpu.sim.instructions")
    except ModuleNotFoundError as e:
        if e.name != "zeus_agent.gpu.sim.instructions":
            raise
        return None


def _point_cost(hw: HardwareParams, wl: WorkloadParams) -> Cost:
    def cost(clock: float) -> tuple[float, float]:
        point = point_at_clock(hw, wl, clock)
        return point.step_time_s, point.energy_j

    return cost


def _module_cost(mod: Any, hw: HardwareParams, wl: Any) -> Cost:
    def cost(clock: float) -> tuple[float, float]:
        time_s, energy_j = mod.instruction_cost(hw, wl, clock)
        return float(time_s), float(energy_j)

    return cost


def _scaled_cost(cost: Cost, scale: float) -> Cost:
    def scaled(clock: float) -> tuple[float, float]:
        time_s, energy_j = cost(clock)
        return time_s * scale, energy_j * scale

    return scaled


def _fallback_model(profile: str, num_stages: int) -> tuple[HardwareParams, list[dict[str, Cost]]]:
    """Hand-made workloads (before the simulator's instruction model exists)."""
    model, device = profile.split("+")
    hw = PRESETS["A40" if device == "a40" else "A100"]
    last = 1.2 if model.startswith("gpt3") else 0.8
    stages = []
    for s in range(num_stages):
        k = last if s == num_stages - 1 else 1.0
        fwd = WorkloadParams(compute_s=0.09 * k, memory_s=0.012 * k, activity=0.92)
        bwd = WorkloadParams(compute_s=0.19 * k, memory_s=0.02 * k, activity=0.97)
        stages.append({"forward": _point_cost(hw, fwd), "backward": _point_cost(hw, bwd)})
    return hw, stages


def load_model(profile: str, num_stages: int) -> tuple[HardwareParams, list[dict[str, Cost]], str]:
    """The profile's hardware and per-stage instruction costs (unscaled), and their source."""
    mod = _instructions_module()
    if mod is None:
        hw, stages = _fallback_model(profile, num_stages)
        return hw, stages, "fallback: hand-made WorkloadParams via physics.point_at_clock"
    hw = PRESETS[mod.preset_for(profile)]
    workloads = mod.stage_workloads(profile, num_stages)
    stages = [
        {name: _module_cost(mod, hw, wl) for name, wl in per_stage.items()}
        for per_stage in workloads
    ]
    return hw, stages, "zeus_agent.gpu.sim.instructions"


# --------------------------------------------------------------------------- the pipeline


class _Gpu:
    """One GPU's power timeline and its coarse energy counter."""

    def __init__(self, idle_w: float, update_s: float, phase_s: float) -> None:
        self.idle_w = idle_w
        self.update_s = update_s
        self.phase_s = phase_s
        self.times = [-10.0]
        self.energy = [0.0]
        self.power = [idle_w]  # power from times[i] on

    def run(self, start: float, end: float, power_w: float) -> None:
        """Idle until `start`, then `power_w` until `end` (calls in time order)."""
        self.energy.append(self.energy[-1] + self.power[-1] * (start - self.times[-1]))
        self.times.append(start)
        self.power.append(power_w)
        self.energy.append(self.energy[-1] + power_w * (end - start))
        self.times.append(end)
        self.power.append(self.idle_w)

    def true_energy(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        return self.energy[i] + self.power[i] * (t - self.times[i])

    def counter(self, t: float) -> float:
        tick = self.phase_s + math.floor((t - self.phase_s) / self.update_s) * self.update_s
        return self.true_energy(tick)

    def measured(self, t: float) -> float:
        """The energy at `t` as the agent has it: its reads are phase-locked (at most one per
        update), each value filed at its update's instant, and `t` interpolated between the two
        updates that bracket it (`EnergyRing`), once a read after `t` has come."""
        tick = self.phase_s + math.floor((t - self.phase_s) / self.update_s) * self.update_s
        e0, e1 = self.true_energy(tick), self.true_energy(tick + self.update_s)
        return e0 + (e1 - e0) * (t - tick) / self.update_s


@dataclass
class Sim:
    """A running pipeline: schedules in, `ProfilingResult`s out."""

    hw: HardwareParams
    costs: list[dict[str, Cost]]
    """Per stage, scaled noise-free costs."""
    microbatches: int
    update_s: float
    jitter: float
    seed: int
    counter_at_events: bool = False
    """True: the counter as read at each event (the agent before phase-locked reads); False:
    the agent's series, one value per update at its instant, interpolated."""

    def __post_init__(self) -> None:
        self.num_stages = len(self.costs)
        self.rng = random.Random(self.seed)
        self.gpus = [_Gpu(self.hw.idle_power_w, self.update_s, self.rng.uniform(0, self.update_s))
                     for _ in range(self.num_stages)]
        self.orders = [one_f_one_b(s, self.num_stages, self.microbatches)
                       for s in range(self.num_stages)]
        self.clock_s = 0.0
        self.iterations = 0
        self._cache: dict[tuple[int, str, int], tuple[float, float]] = {}

    def instructions(self, stage: int) -> list[str]:
        return [kind for kind, _ in self.orders[stage]]

    def cost(self, stage: int, kind: str, clock: int) -> tuple[float, float]:
        key = (stage, kind, clock)
        if key not in self._cache:
            self._cache[key] = self.costs[stage][kind](clock)
        return self._cache[key]

    def _noise(self) -> float:
        return 1.0 + self.jitter * max(-3.0, min(3.0, self.rng.gauss(0.0, 1.0)))

    def iteration(self, schedules: Sequence[FrequencySchedule]) -> list[dict[str, Any]]:
        """Run one iteration; per stage: begin, end, and (kind, start, end) of instructions."""
        begin = self.clock_s
        s_count = self.num_stages
        done: dict[tuple[str, int, int], float] = {}
        free = [begin] * s_count
        ptr = [0] * s_count
        spans: list[list[tuple[str, float, float]]] = [[] for _ in range(s_count)]
        remaining = sum(len(o) for o in self.orders)
        while remaining:
            progressed = False
            for s in range(s_count):
                while ptr[s] < len(self.orders[s]):
                    kind, mb = self.orders[s][ptr[s]]
                    if kind == "forward":
                        dep = ("forward", s - 1, mb) if s > 0 else None
                    else:
                        dep = ("backward", s + 1, mb) if s < s_count - 1 else None
                    if dep is not None and dep not in done:
                        break
                    ready = max(free[s], done[dep] if dep else begin)
                    name, clock = schedules[s].frequencies[ptr[s]]
                    assert name == kind, (name, kind)
                    t0, e0 = self.cost(s, kind, clock)
                    t = t0 * self._noise()
                    power = e0 / t0 * self._noise()
                    end = ready + t
                    self.gpus[s].run(ready, end, power)
                    spans[s].append((kind, ready, end))
                    done[(kind, s, mb)] = end
                    free[s] = end
                    ptr[s] += 1
                    remaining -= 1
                    progressed = True
            assert progressed, "1F1B deadlock"
        end = max(free)
        self.clock_s = end
        self.iterations += 1
        return [{"begin": begin, "end": end, "spans": spans[s]} for s in range(s_count)]

    def window(self, schedules: Sequence[FrequencySchedule], n: int) -> list[ProfilingResult]:
        """Run n iterations; one `ProfilingResult` per stage, as the coordinator builds it."""
        its = [self.iteration(schedules) for _ in range(n)]
        read = _Gpu.counter if self.counter_at_events else _Gpu.measured
        results = []
        for s in range(self.num_stages):
            gpu = self.gpus[s]
            tb: dict[str, list[list[float]]] = {"forward": [], "backward": []}
            eb: dict[str, list[list[float]]] = {"forward": [], "backward": []}
            for it in its:
                rec = it[s]
                for kind in tb:
                    tb[kind].append([e - b for k, b, e in rec["spans"] if k == kind])
                    eb[kind].append([read(gpu, e) - read(gpu, b)
                                     for k, b, e in rec["spans"] if k == kind])
            results.append(ProfilingResult(
                rank=s,
                iter_time=[it[s]["end"] - it[s]["begin"] for it in its],
                iter_energy=[read(gpu, it[s]["end"]) - read(gpu, it[s]["begin"])
                             for it in its],
                time_breakdown=tb,
                energy_breakdown=eb,
            ))
        return results


def build_sim(profile: str, *, num_stages: int = 4, microbatches: int = 8,
              iteration_s: float = 1.0, update_ms: float = 100.0, jitter: float = 0.01,
              seed: int = 0, counter_at_events: bool = False) -> tuple[Sim, str]:
    """A pipeline of the profile whose iteration at the highest clocks takes `iteration_s`."""
    hw, raw, source = load_model(profile, num_stages)
    probe = Sim(hw, raw, microbatches, update_ms / 1000.0, 0.0, seed)
    top = hw.max_sm_clock_mhz
    scheds = [FrequencySchedule(rank=s, frequencies=[(k, top) for k in probe.instructions(s)])
              for s in range(num_stages)]
    it = probe.iteration(scheds)
    scale = iteration_s / (it[0]["end"] - it[0]["begin"])
    scaled = [
        {kind: _scaled_cost(f, scale) for kind, f in stage.items()}
        for stage in raw
    ]
    return Sim(hw, scaled, microbatches, update_ms / 1000.0, jitter, seed,
               counter_at_events), source


# --------------------------------------------------------------------------- the run


def errors(result: InstructionProfilingResult, sim: Sim) -> dict[str, list[float]]:
    """Relative errors of every (stage, instruction, clock) row against the ground truth."""
    out: dict[str, list[float]] = {"energy": [], "time": []}
    for entry in result.root:
        for kind in ("forward", "backward"):
            times = getattr(entry, f"{kind}_time")
            energies = getattr(entry, f"{kind}_energy")
            for clock in times:
                t, e = sim.cost(entry.pp_rank, kind, clock)
                out["time"].append(abs(times[clock] / t - 1.0))
                out["energy"].append(abs(energies[clock] / e - 1.0))
    return out


def run_profile(profile: str, *, num_stages: int = 4, microbatches: int = 8,
                iteration_s: float = 1.0, update_ms: float = 100.0, jitter: float = 0.01,
                profiling_iterations: int = 5, seed: int = 0, max_rounds: int = 200,
                counter_at_events: bool = False, **profiler_args: Any) -> dict[str, Any]:
    """Profile one pipeline with the real InstructionProfiler; figures against ground truth."""
    sim, source = build_sim(profile, num_stages=num_stages, microbatches=microbatches,
                            iteration_s=iteration_s, update_ms=update_ms, jitter=jitter,
                            seed=seed, counter_at_events=counter_at_events)
    clocks = list(sim.hw.supported_sm_clocks_mhz)
    infos = [RankInfo(rank=s, dp_rank=0, pp_rank=s, tp_rank=0, available_frequencies=clocks,
                      instructions=sim.instructions(s)) for s in range(num_stages)]
    job = JobInfo(pp_degree=num_stages, dp_degree=1, tp_degree=1, world_size=num_stages)
    profiler = InstructionProfiler(job, infos, {"profiling_iterations": profiling_iterations},
                                   **profiler_args)
    settings: set[tuple[tuple[str, int], ...]] = set()
    rounds = 0
    while not profiler.finished and rounds < max_rounds:
        schedules = profiler.next_schedule()
        settings.add(tuple(p for s in schedules for p in s.frequencies))
        profiler.observe(sim.window(schedules, profiling_iterations))
        rounds += 1
    training_s = sim.clock_s
    assert profiler.result is not None, "profiling did not finish"
    errs = errors(profiler.result, sim)
    lowest = {e.pp_rank: min(e.forward_time) for e in profiler.result.root}
    return {
        "profile": profile,
        "model_source": source,
        "rows": len(errs["energy"]),
        "energy_median": statistics.median(errs["energy"]),
        "energy_p90": _quantile(errs["energy"], 0.9),
        "energy_max": max(errs["energy"]),
        "time_median": statistics.median(errs["time"]),
        "time_max": max(errs["time"]),
        "profile_s": training_s,
        "iterations": sim.iterations,
        "rounds": rounds,
        "settings": len(settings),
        "lowest_clock_by_stage": lowest,
        "_errors": errs,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    energy = [e for r in runs for e in r["_errors"]["energy"]]
    time = [e for r in runs for e in r["_errors"]["time"]]
    return {
        "rows": len(energy),
        "energy_median": statistics.median(energy),
        "energy_p90": _quantile(energy, 0.9),
        "time_median": statistics.median(time),
        "profile_s_max": max(r["profile_s"] for r in runs),
        "iterations_max": max(r["iterations"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed per profile")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per profile")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iteration-s", type=float, default=1.0)
    parser.add_argument("--energy-update-ms", type=float, default=100.0)
    parser.add_argument("--jitter", type=float, default=0.01)
    parser.add_argument("--profiling-iterations", type=int, default=5)
    parser.add_argument(
        "--counter-at-events", action="store_true",
        help="measure with the counter as read at each event (the agent before phase-locked "
        "reads) instead of the agent's series (one read per update, interpolated)")
    args = parser.parse_args(argv)
    seeds = 1 if args.quick else args.seeds
    runs = []
    for profile in PROFILES:
        for seed in range(seeds):
            run = run_profile(profile, num_stages=args.stages, microbatches=args.microbatches,
                              iteration_s=args.iteration_s, update_ms=args.energy_update_ms,
                              jitter=args.jitter,
                              profiling_iterations=args.profiling_iterations, seed=seed,
                              counter_at_events=args.counter_at_events)
            runs.append(run)
            print(f"{profile:20s} seed {seed}: energy median {run['energy_median']:.2%} "
                  f"p90 {run['energy_p90']:.2%} max {run['energy_max']:.2%} | time median "
                  f"{run['time_median']:.2%} | {run['profile_s']:.0f} s, {run['iterations']} "
                  f"iterations, {run['settings']} settings | lowest clocks "
                  f"{list(run['lowest_clock_by_stage'].values())}")
    per_profile = {}
    for profile in PROFILES:
        per_profile[profile] = summarize([r for r in runs if r["profile"] == profile])
    overall = summarize(runs)
    met = {
        "energy_median": overall["energy_median"] <= GOAL["energy_median"],
        "energy_p90": overall["energy_p90"] <= GOAL["energy_p90"],
        "time_median": overall["time_median"] <= GOAL["time_median"],
        "profile_s": overall["profile_s_max"] <= GOAL["profile_s"] * args.iteration_s,
    }
    print(f"overall: energy median {overall['energy_median']:.2%} p90 "
          f"{overall['energy_p90']:.2%} | time median {overall['time_median']:.2%} | "
          f"longest profile {overall['profile_s_max']:.0f} s | goal met: {met}")
    print(f"model: {runs[0]['model_source']}; machine: {machine()}; date: {now()}")
    print(json.dumps({
        "bench": "instruction_profiler",
        "machine": machine(),
        "date": now(),
        "args": vars(args),
        "model_source": runs[0]["model_source"],
        "goal": GOAL,
        "met": met,
        "overall": overall,
        "per_profile": per_profile,
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
