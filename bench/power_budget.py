"""Benchmark: power budgets on a simulated cluster (a grid event), and the allocator alone.

The event (`--quick`: a small cluster): a NATS server, coordinator replicas (`bench._common.
Replicas`), one sim agent process per node (`zeus-agent run --backend sim`; 16 nodes x 8 GPUs,
10 of A40s and 6 of V100s) and 12 jobs, one per reference profile (`zeus_demo.budget.jobs`: the
sim data-parallel trainer, one process per rank, steps of about `--step-s` whatever the
workload), 124 of the 128 GPUs busy. Every job profiles every 25 W limit and pins its optimum;
then a cut of 25 % of the group's measured draw (a cluster budget set over the bus, as
`zeus-coordinator budget set --cut 25` does), held `--hold-s`, then lifted. Then the same event
with the replica applying the budgets killed (SIGKILL) once the group is under the cap, the
other replica taking over. Judged by `zeus_demo.budget.analysis` from the agents' samples
(energy counters: the group's power in 0.5 s bins): seconds to the cap, energy over it, the
throughput loss of the limits applied against the uniform cut and the offline optimum on the
simulator's true curves, seconds until every job is back at its optimum.

The allocator alone: each job one of the reference profiles (data/reference-profiles/*.csv),
clusters up to 3,000+ GPUs, cuts of 10, 25 and 40 %; `allocate` timed (best of a few runs)
against the uniform cut (key `allocator` of the JSON line).

Usage: python bench/power_budget.py [--quick] [--allocator-only]. The last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import load, machine, now  # noqa: E402
from coordinator.budget.allocator import (  # noqa: E402
    Group,
    Option,
    ProfiledJob,
    allocate,
    uniform_cut,
)
from zeus_demo.budget.demo import SMALL_COUNTS  # noqa: E402
from zeus_demo.budget.event import EventConfig, run_event  # noqa: E402

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


QUICK_COUNTS = SMALL_COUNTS
"""--quick: the demo's 6 jobs on 1 GPU each, 3 nodes x 2 GPUs."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a small cluster (3 nodes x 2 GPUs, 6 jobs) and fewer allocator cases")
    parser.add_argument("--allocator-only", action="store_true", help="no simulated cluster")
    parser.add_argument("--no-takeover", action="store_true", help="no second event")
    parser.add_argument("--step-s", type=float, default=1.0,
                        help="every job's step time at its maximum limit (s)")
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long the cut holds (s)")
    args = parser.parse_args()
    sizes = [12, 400] if args.quick else [12, 48, 200, 400]
    result: dict[str, Any] = {"bench": "power_budget", "machine": machine(), "when": now(),
                              "load_before": load()}
    result["allocator"] = run(sizes, [0.10, 0.25, 0.40], repeats=1 if args.quick else 3)
    if not args.allocator_only:
        config = EventConfig(step_s=args.step_s, hold_s=args.hold_s,
                             takeover=not args.no_takeover)
        if args.quick:
            config.gpus_per_node, config.counts = 2, dict(QUICK_COUNTS)
        t0 = time.monotonic()
        cluster = asyncio.run(run_event(config))
        result["config"] = {k: v for k, v in asdict(config).items() if k != "counts"}
        result["cluster"] = cluster
        result["seconds"] = round(time.monotonic() - t0, 1)
        event, takeover = cluster["event"], cluster.get("takeover", {})
        for key in ("seconds_to_cap", "over_cap_joules", "loss_vs_uniform",
                    "gap_to_optimal_pct", "seconds_to_restore"):
            result[key] = event.get(key)
        result["over_cap_joules_during_takeover"] = takeover.get(
            "over_cap_joules_during_takeover")
        result["goals"] = {"seconds_to_cap": 5.0, "loss_vs_uniform": 0.7,
                           "gap_to_optimal_pct": 2.0}
    result["load_after"] = load()
    print(json.dumps(result))


if __name__ == "__main__":
    from zeus_agent import children

    with children.sigterm_as_sigint():  # SIGTERM cleans up (temp dirs, children) as Ctrl-C does
        main()
