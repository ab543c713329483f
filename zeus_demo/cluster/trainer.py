"""The simulated data-parallel job of a `SimCluster`, as a process of its own.

`python -m zeus_demo.cluster.trainer SPEC_JSON` runs
`zeus_agent.gpu.sim.trainers.data_parallel.run_data_parallel` (its ranks are this process's
children) and writes its result as JSON where the spec says.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from zeus_agent.fileio import atomic_write


def main(spec_json: str) -> int:
    """Run `run_data_parallel` from a JSON spec and write its result as JSON.

    The result's "step_seen_at" has, for each step of rank 0, the `time.monotonic()` (the
    system's clock, the test's too) at which this process learnt it ended (polled every 50 ms).
    """
    from zeus_agent import PowerLimitOptions
    from zeus_agent.gpu.sim.trainers.data_parallel import (
        RankPlacement,
        TrainerOptions,
        run_data_parallel,
    )

    spec = json.loads(spec_json)
    out = Path(spec["out"])
    opts = dict(spec["options"])
    opts["power_limit"] = PowerLimitOptions(**opts["power_limit"])
    seen: list[float] = []
    try:
        result = run_data_parallel([RankPlacement(**p) for p in spec["placements"]],
                                   TrainerOptions(**opts), lambda _: seen.append(time.monotonic()),
                                   spec["timeout_s"])
        data: dict[str, Any] = {
            "job_id": result.job_id,
            "step_seen_at": seen,
            "ranks": [
                {"rank": r.rank, "step_time_s": r.step_time_s,
                 "step_power_limit_w": r.step_power_limit_w,
                 "dropped_events": r.dropped_events, "error": r.error}
                for r in result.ranks
            ],
        }
    except Exception as e:  # noqa: BLE001 - reported to the test
        data = {"error": f"{type(e).__name__}: {e}"}
    atomic_write(out, json.dumps(data))
    return 0 if "error" not in data else 1


if __name__ == "__main__":
    if len(sys.argv) == 2:
        sys.exit(main(sys.argv[1]))
    print("usage: python -m zeus_demo.cluster.trainer SPEC_JSON", file=sys.stderr)
    sys.exit(2)
