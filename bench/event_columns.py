"""Decoding a rank's trainer-event batch: rows (`TrainerEventBatch`) against columns.

For a rank's batch of `--steps` steps (per step a step_end and a step_begin event, as
`coordinator_ingest.py` publishes them: 4 steps is one 10 Hz flush at 40 steps/s), the CPU
time (best of `--repeat` rounds of `--n` decodes, process time, so other work on the host
counts less) of:

* rows: `decode_events` of the rows (a model and a map per event) and `event_rows`, as the
  coordinator decodes an older agent's batch;
* columns: `decode_events` of the same batch in columns (`TrainerEventColumns`);
* columns_rows: that and `event_rows` (the `EventRow` tuples the coordinator feeds its cores).

Prints a human line per size, then LAST one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from _common import load, machine, now
from _fleet import step_batches
from node_columns import cpu_us

from zeus_agent.wire.event_columns import decode_events, event_rows


def one(steps: int, n: int, repeat: int) -> dict[str, Any]:
    """Decode costs of a rank's batch of `steps` steps."""
    first = 1  # (From step 1: every step has its step_end and step_begin.)
    batches = [step_batches("job-1", 3, "node00000", 3, "0" * 64, first, first + steps - 1,
                            0.025, 10**12, 250.0, columns)[0] for columns in (False, True)]
    rows, columns = batches
    return {"steps": steps, "events": 2 * steps, "bytes_rows": len(rows),
            "bytes_columns": len(columns),
            "rows_us": cpu_us(lambda: event_rows(decode_events(rows)), n, repeat),
            "columns_us": cpu_us(lambda: decode_events(columns), n, repeat),
            "columns_rows_us": cpu_us(lambda: event_rows(decode_events(columns)), n, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 6, 16, 100], help="steps per batch, comma-separated "
                        "(default 1,2,4,6,16,100)")
    parser.add_argument("--n", type=int, default=500, help="decodes per round (default 500)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args()
    before = load()
    sizes = [one(s, args.n, args.repeat) for s in args.steps]
    for r in sizes:
        print(f"{r['steps']} steps ({r['events']} events): rows {r['rows_us']} us, columns "
              f"{r['columns_us']} us, with rows {r['columns_rows_us']} us; "
              f"{r['bytes_rows']} -> {r['bytes_columns']} bytes")
    print(f"load {before} -> {load()} on {os.cpu_count()} cpu", file=sys.stderr)
    print(json.dumps({"when": now(), "machine": machine(), "load_before": before,
                      "load": load(), "sizes": sizes}))


if __name__ == "__main__":
    main()
