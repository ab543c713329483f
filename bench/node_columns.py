"""Decoding a node's measurement batch: rows (`NodeMeasurementBatch`) against columns.

For a node of `--gpus` GPUs each with `--steps` steps (per step a mark and a measurement, as
`coordinator_ingest.py` publishes them), the CPU time (best of `--repeat` rounds of `--n`
decodes, process time, so other work on the host counts less) of:

* rows: `decode_measurements` of the rows (a model and a map per item), as the coordinator
  decodes an older agent's batch;
* columns: `decode_measurements` of the same batch in columns (`NodeColumnBatch`);
* columns_parts: that and `parts()`, the rows (tuples) the coordinator feeds its cores.

Prints a human line per size, then LAST one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import load, machine, now
from _fleet import node_batch, step_batches

from zeus_agent.wire.node_columns import NodeColumnBatch, decode_measurements


def cpu_us(work: Callable[[], Any], n: int, repeat: int) -> float:
    """Best process-CPU microseconds per call of `work` over `repeat` rounds of `n` calls."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        for _ in range(n):
            work()
        best = min(best, (time.process_time() - t) / n)
    return round(best * 1e6, 1)


def one(gpus: int, steps: int, n: int, repeat: int) -> dict[str, Any]:
    """Decode costs of a node's batch of `gpus` parts of `steps` steps each."""
    first = 1  # (From step 1: every step has its mark and the previous step's measurement.)
    parts = [step_batches("job-1", g, "node00000", g, "0" * 64, first, first + steps - 1, 0.1,
                          10**12, 250.0)[1] for g in range(gpus)]
    rows, columns = node_batch("job-1", "node00000", parts), node_batch("job-1", "node00000",
                                                                        parts, True)

    def with_parts() -> None:
        batch = decode_measurements(columns)
        assert isinstance(batch, NodeColumnBatch)
        batch.parts()

    return {"gpus": gpus, "steps": steps, "items": 2 * gpus * steps,
            "bytes_rows": len(rows), "bytes_columns": len(columns),
            "rows_us": cpu_us(lambda: decode_measurements(rows), n, repeat),
            "columns_us": cpu_us(lambda: decode_measurements(columns), n, repeat),
            "columns_parts_us": cpu_us(with_parts, n, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node (default 8)")
    parser.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 16, 62], help="steps per GPU, comma-separated "
                        "(default 1,2,4,16,62: 62 is ~1,000 items, a full batch)")
    parser.add_argument("--n", type=int, default=300, help="decodes per round (default 300)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args()
    before = load()
    sizes = [one(args.gpus, s, args.n, args.repeat) for s in args.steps]
    for r in sizes:
        print(f"{r['gpus']} GPUs x {r['steps']} steps ({r['items']} items): rows "
              f"{r['rows_us']} us, columns {r['columns_us']} us, with parts "
              f"{r['columns_parts_us']} us; {r['bytes_rows']} -> {r['bytes_columns']} bytes")
    print(f"load {before} -> {load()} on {os.cpu_count()} cpu", file=sys.stderr)
    print(json.dumps({"when": now(), "machine": machine(), "load_before": before,
                      "load": load(), "sizes": sizes}))


if __name__ == "__main__":
    main()
