"""Benchmark: the power-budget allocator on clusters built from the real profiles.

Each job is one of the reference profiles (data/reference-profiles/*.csv: time and energy of a
window at each power limit, A40 and V100), given a GPU count and a priority weight; its options
are its measured limits (time per window, average power per GPU = energy / time / GPUs), its
optimum the fastest limit. For several cluster sizes (up to 3,000+ GPUs, hundreds of jobs) and
cuts of the group's optimum draw (10, 25, 40 %), it times `allocate` (best of a few runs) and
reports the group's weighted slowdown against the uniform cut (every GPU one limit).

Not yet here (issue 37, item 4): the simulated 16 x 8 cluster with agents and coordinators, a
25 % cut signalled over the bus, time to cap, energy over the cap, restore and takeover.

Usage: python bench/power_budget.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.budget.allocator import (  # noqa: E402
    Group,
    Option,
    ProfiledJob,
    allocate,
    uniform_cut,
)

PROFILES = ROOT / "data" / "reference-profiles"


def load_profiles() -> list[tuple[str, list[Option]]]:
    """(name, options per GPU) for every reference profile."""
    out = []
    for path in sorted(PROFILES.glob("*.csv")):
        gpus = len(path.stem.split("+gpu")[1].split(","))
        options = []
        with path.open() as f:
            for row in csv.DictReader(f):
                limit = int(row["window_name"].rsplit("_", 1)[1])
                elapsed = float(row["elapsed_time"])
                energy = sum(float(v) for k, v in row.items() if k.endswith("_energy"))
                options.append(Option(limit, elapsed, energy / elapsed / gpus, limit))
        out.append((path.stem, options))
    return out


def cluster(profiles: list[tuple[str, list[Option]]], jobs: int, seed: int) -> list[ProfiledJob]:
    rng = random.Random(seed)
    out = []
    for i in range(jobs):
        name, options = profiles[rng.randrange(len(profiles))]
        fastest = min(options, key=lambda o: o.time_s)
        gpus = rng.choice([1, 2, 4, 8, 8, 16])
        weight = rng.choice([1.0, 1.0, 1.0, 2.0, 0.5])
        low = min(o.limit_w for o in options)
        out.append(ProfiledJob(f"{name}#{i}", gpus, tuple(options), fastest.key, low, weight))
    return out


def optimum_draw(jobs: list[ProfiledJob]) -> float:
    return sum(j.gpus * next(o.power_w for o in j.options if o.key == j.optimum) for j in jobs)


def run(sizes: list[int], cuts: list[float], repeats: int) -> dict[str, object]:
    profiles = load_profiles()
    cases = []
    for n_jobs in sizes:
        jobs = cluster(profiles, n_jobs, seed=n_jobs)
        gpus = sum(j.gpus for j in jobs)
        top = optimum_draw(jobs)
        for cut in cuts:
            group = Group(cap_w=top * (1 - cut), jobs=tuple(jobs))
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                alloc = allocate(group)
                seconds.append(time.perf_counter() - t0)
            uniform = uniform_cut(group)
            cases.append(
                {
                    "jobs": n_jobs,
                    "gpus": gpus,
                    "cut": cut,
                    "cap_w": round(group.cap_w, 1),
                    "seconds": round(min(seconds), 4),
                    "resolution_w": round(alloc.resolution_w, 3),
                    "expected_w": round(alloc.expected_w, 1),
                    "weighted_slowdown": round(alloc.cost, 4),
                    "uniform_weighted_slowdown": round(uniform.cost, 4),
                    "uniform_fits": uniform.expected_w <= group.cap_w,
                }
            )
            print(json.dumps(cases[-1]))
    largest = max(cases, key=lambda c: (c["gpus"], c["seconds"]))
    return {
        "bench": "power_budget_allocator",
        "cases": cases,
        "largest_gpus": largest["gpus"],
        "largest_jobs": largest["jobs"],
        "largest_seconds": max(c["seconds"] for c in cases if c["gpus"] == largest["gpus"]),
        "goal_seconds": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small and one large cluster")
    args = parser.parse_args()
    sizes = [12, 400] if args.quick else [12, 48, 200, 400]
    result = run(sizes, [0.10, 0.25, 0.40], repeats=1 if args.quick else 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
