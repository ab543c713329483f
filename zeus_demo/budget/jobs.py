"""The jobs of a simulated grid event: one per reference profile, placed on the cluster's nodes.

* `REFERENCE_JOBS`: the 12 workloads fitted to `data/reference-profiles/` (A40 and V100) with
  the GPU count each gets on a 16 x 8 cluster (124 of 128 GPUs busy: a cut of a quarter of a
  mostly idle cluster's draw would be under its floor, every GPU at its minimum limit).
* `plan(gpus_per_node, counts)`: the nodes (one GPU model each) and every job's placement.
* `job_options(...)`: a job's trainer options: its steps last about `step_s` whatever its
  workload (`scale`), profiled briefly at every 25 W limit.
* `python -m zeus_demo.budget.jobs SPEC_JSON`: runs one job (the simulated data-parallel
  trainer, one process per rank) until it is stopped; SIGTERM kills its ranks at once.
* `perseus_job(...)` / `perseus_argv(...)`: a Perseus pipeline job on a node of its own
  (GPT-3 175B stages on A40s, the simulated pipeline trainer), planned and served by the
  coordinator's Perseus3D scheduler (`PERSEUS_ARGS`).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from zeus_agent import PowerLimitOptions
from zeus_agent.gpu.sim.physics import operating_point
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS

REFERENCE_JOBS: dict[str, int] = {
    "A40+bert-base-uncased+gpu0": 16,
    "A40+resnet18+gpu0": 16,
    "A40+resnet18+gpu0,1,2,3": 8,
    "A40+resnet50+gpu0": 16,
    "A40+resnet50+gpu0,1,2,3": 8,
    "A40+shufflenetv2+gpu0": 12,
    "V100+bert-base-uncased+gpu0": 8,
    "V100+resnet18+gpu0": 8,
    "V100+resnet18+gpu0,1": 4,
    "V100+resnet50+gpu0": 12,
    "V100+resnet50+gpu0,1": 8,
    "V100+shufflenetv2+gpu0": 8,
}
"""Workload -> GPUs on a 16 x 8 cluster (10 A40 nodes, 6 V100 nodes)."""


@dataclass(frozen=True, slots=True)
class Node:
    """A node: its name, GPU model and GPU count (one agent process)."""

    name: str
    preset: str
    gpus: int


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job: its tag (the end of its id), workload, GPU model and GPUs (node, index)."""

    tag: str
    workload: str
    preset: str
    gpus: tuple[tuple[str, int], ...]


PERSEUS_PROFILE = "gpt3-175b+a40"
PERSEUS_TAG = "bjps"
PERSEUS_TIME_SCALE = 0.1
"""The pipeline trainer's factor on every instruction's duration and energy."""
PERSEUS_ARGS = ["--scheduler", "Perseus3D", "--scheduler-args",
                json.dumps({"profiler_args": {"clocks": 3, "warmup_iterations": 1,
                                              "min_profile_iterations": 2}}),
                "--profiling-iterations", "3"]
"""The coordinator's flags for the Perseus job: a short profile (3 clocks)."""


@dataclass(frozen=True, slots=True)
class PerseusSpec:
    """The Perseus job: its stages, pipelines and GPUs (one node)."""

    tag: str
    stages: int
    dp: int
    microbatches: int
    gpus: tuple[tuple[str, int], ...]


def perseus_job(nodes: list[Node], gpus_per_node: int) -> tuple[Node, PerseusSpec]:
    """An A40 node of its own after `nodes`, and a pipeline job on every GPU of it."""
    node = Node(f"n{len(nodes):02d}", "A40", gpus_per_node)
    stages = min(4, gpus_per_node)
    dp = gpus_per_node // stages
    gpus = tuple((node.name, g) for g in range(stages * dp))
    return node, PerseusSpec(PERSEUS_TAG, stages, dp, 2 * stages, gpus)


def perseus_argv(job: PerseusSpec, root: str, seconds: float) -> list[str]:
    """The simulated pipeline trainer's command line for `job` (its node's agent in `root`)."""
    node = job.gpus[0][0]
    return [sys.executable, "-m", "zeus_agent.gpu.sim.trainers.pipeline", "--profile",
            PERSEUS_PROFILE, "--stages", str(job.stages), "--microbatches",
            str(job.microbatches), "--dp", str(job.dp), "--seconds", f"{seconds:g}",
            "--time-scale", f"{PERSEUS_TIME_SCALE:g}", "--job-metadata", job.tag,
            "--timeout", f"{seconds + 60:g}",
            "--node", f"{node}:{root}/{node}.sock:{root}/{node}:0-{len(job.gpus) - 1}"]


def plan(gpus_per_node: int, counts: Mapping[str, int]) -> tuple[list[Node], list[JobSpec]]:
    """Nodes per GPU model (as few as hold its jobs) and each job's GPUs, filled in order."""
    nodes: list[Node] = []
    jobs: list[JobSpec] = []
    presets = list(dict.fromkeys(w.split("+", 1)[0] for w in counts))
    for preset in presets:
        mine = {w: n for w, n in counts.items() if w.startswith(preset + "+")}
        first = len(nodes)
        need = math.ceil(sum(mine.values()) / gpus_per_node)
        nodes += [Node(f"n{first + i:02d}", preset, gpus_per_node) for i in range(need)]
        slots = [(n.name, g) for n in nodes[first:] for g in range(gpus_per_node)]
        for workload, n in mine.items():
            taken, slots = slots[:n], slots[n:]
            jobs.append(JobSpec(f"bj{len(jobs):02d}", workload, preset, tuple(taken)))
    return nodes, jobs


def step_scale(workload: str, preset: str, step_s: float) -> float:
    """The factor that makes a step at the maximum limit last `step_s`."""
    hw = PRESETS[preset]
    return step_s / operating_point(hw, WORKLOADS[workload], hw.max_power_limit_w).step_time_s


def power_limit_options(warmup_steps: int = 1, profile_steps: int = 3) -> PowerLimitOptions:
    """A short exhaustive profile: every 25 W limit, a few steps each."""
    return PowerLimitOptions(warmup_steps=warmup_steps, profile_steps=profile_steps,
                             wait_steps=1, pl_step_w=25, search="exhaustive")


def spec_json(job: JobSpec, root: str, step_s: float, seed: int,
              options: PowerLimitOptions | None = None) -> str:
    """What `python -m zeus_demo.budget.jobs` takes: the job, its files and options."""
    return json.dumps({"job": asdict(job), "root": root, "step_s": step_s, "seed": seed,
                       "power_limit": (options or power_limit_options()).model_dump()})


def _kill_ranks(*_: Any) -> None:
    for child in mp.active_children():
        child.kill()
    os._exit(143)


def main(argv: list[str]) -> int:
    """Run one job until it is stopped (SIGTERM: its ranks are killed at once)."""
    from zeus_agent.gpu.sim.trainers.data_parallel import (
        RankPlacement,
        TrainerOptions,
        run_data_parallel,
    )

    spec: dict[str, Any] = json.loads(argv[0])
    job = spec["job"]
    signal.signal(signal.SIGTERM, _kill_ranks)
    signal.signal(signal.SIGINT, _kill_ranks)
    root = spec["root"]
    placements = [RankPlacement(node, f"{root}/{node}.sock", f"{root}/{node}", index)
                  for node, index in job["gpus"]]
    options = TrainerOptions(
        workload=job["workload"], epochs=1, steps_per_epoch=1_000_000,
        scale=step_scale(job["workload"], job["preset"], spec["step_s"]),
        power_limit=PowerLimitOptions.model_validate(spec["power_limit"]),
        job_metadata=job["tag"], seed=spec["seed"])
    run_data_parallel(placements, options, timeout_s=24 * 3600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
