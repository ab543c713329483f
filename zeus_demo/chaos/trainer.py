"""The soak's two jobs, each run in a process of its own: `python -m zeus_demo.chaos.trainer`.

`dp SPEC`: the simulated data-parallel job with the power-limit optimiser; `pipeline SPEC`: the
simulated 4-stage pipeline under Perseus. Each prints `progress <wall-clock s>` per step (rank
0) or iteration as it happens, so the soak knows when a job moved even if it is killed, and
writes its result (job id, error) as JSON to the spec's `out`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from zeus_agent.fileio import atomic_write

__all__ = ["main"]


def _progress(*_: Any) -> None:
    print(f"progress {time.time():.6f}", flush=True)


def _dp(spec: dict[str, Any]) -> dict[str, Any]:
    from zeus_agent import PowerLimitOptions
    from zeus_agent.gpu.sim.trainers.data_parallel import (
        RankPlacement,
        TrainerOptions,
        run_data_parallel,
    )

    opts = dict(spec["options"])
    opts["power_limit"] = PowerLimitOptions(**opts["power_limit"])
    result = run_data_parallel([RankPlacement(**p) for p in spec["placements"]],
                               TrainerOptions(**opts), _progress, spec["timeout_s"])
    errors = [r.error for r in result.ranks if r.error]
    return {"job_id": result.job_id, "error": "; ".join(errors) or None}


def _pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    from zeus_agent.gpu.sim.trainers.pipeline.job import (
        NodeSpec,
        PipelineOptions,
        place_ranks,
        run_pipeline,
    )

    nodes = [NodeSpec(n["name"], n["socket_path"], n["sim_dir"], tuple(n["gpus"]))
             for n in spec["nodes"]]
    options = PipelineOptions(**spec["options"])
    placements = place_ranks(nodes, options.stages, options.dp)
    result = run_pipeline(placements, options, _progress, spec["timeout_s"])
    return {"job_id": result.job_id, "iterations": result.iterations, "error": None}


def main(argv: list[str]) -> int:
    """Run the job `argv[0]` ("dp" or "pipeline") from the JSON spec `argv[1]`."""
    if len(argv) != 2 or argv[0] not in ("dp", "pipeline"):
        print("usage: python -m zeus_demo.chaos.trainer dp|pipeline SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    try:
        data = (_dp if argv[0] == "dp" else _pipeline)(spec)
    except Exception as e:  # noqa: BLE001 - reported to the soak
        data = {"error": f"{type(e).__name__}: {e}"}
    atomic_write(spec["out"], json.dumps(data))
    return 0 if not data.get("error") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
