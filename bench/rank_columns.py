"""A node's rank registrations, per rank: rows (`RegisterRanks`) against columns, and what follows.

For `--nodes` requests of `--gpus-per-node` described ranks each (as `register_ranks.py` sends
them: one job, each rank with its GPU's description), the CPU time per rank (best of `--repeat`
rounds over every request, process time, so other work on the host counts less) of:

* rows_us: `decode_registration` of the rows, as the coordinator decodes an older agent's batch;
* columns_us: `decode_registration` of the same ranks in columns (`RegisterRankColumns`), its
  parts: columns_validate_us (unpack and validation) and columns_models_us (`requests()`: the
  rows' models, built without validation);
* node_entry_encode_us: encoding the ranks' values and their node entry (`records.encode_rank`,
  `records.encode_node`), once per rank by the replica that records it;
* node_entry_decode_us: decoding that entry (`records.decode`), as the other replicas' watch does.

Prints a human line, then LAST one JSON object.
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
from register_ranks import _FakeAgents, _requests

from coordinator.jobs import RankRecord
from coordinator.state import records
from zeus_agent.wire import codec
from zeus_agent.wire.messages import RegisterRank
from zeus_agent.wire.rank_columns import RegisterRankColumns, decode_registration

JOB = "2026-12-07-23-00-00+dp16384+pp1+tp1+PowerLimitOptimizer"


def per_rank_us(work: Callable[[Any], Any], items: list[Any], ranks: int, repeat: int) -> float:
    """Best process-CPU microseconds per rank of `work` over every item, `repeat` rounds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        for item in items:
            work(item)
        best = min(best, time.process_time() - t)
    return round(best / ranks * 1e6, 2)


def _entry(requests: list[RegisterRank]) -> bytes:
    values = [records.encode_rank(JOB, RankRecord(info=r.rank_info, gpu=r.gpu),
                                  (r.gpu_info.min_power_limit_w, r.gpu_info.max_power_limit_w),
                                  r.gpu_info.energy_period_ms)
              for r in requests if r.gpu_info is not None]
    return records.encode_node(JOB, values)


def measure(nodes: int, gpus: int, repeat: int) -> dict[str, Any]:
    """The costs per rank (see the module)."""
    agents = _FakeAgents(nodes, gpus)
    rows = [p for _, p in _requests(JOB, "t" * 43, agents, nodes, gpus, False, False, rows=True)]
    columns = [p for _, p in _requests(JOB, "t" * 43, agents, nodes, gpus, False, False)]
    decoded = [decode_registration(p) for p in rows]
    batches = [d for d in decoded if isinstance(d, list)]
    assert len(batches) == nodes and all(decode_registration(c) == d
                                         for c, d in zip(columns, batches, strict=True))
    validated = [codec.decode(p, RegisterRankColumns) for p in columns]
    entries = [(records.node_key(JOB, b[0].rank_info.rank), _entry(b)) for b in batches]
    ranks = nodes * gpus
    return {
        "nodes": nodes, "gpus_per_node": gpus,
        "rows_us": per_rank_us(decode_registration, rows, ranks, repeat),
        "columns_us": per_rank_us(decode_registration, columns, ranks, repeat),
        "columns_validate_us": per_rank_us(lambda p: codec.decode(p, RegisterRankColumns),
                                           columns, ranks, repeat),
        "columns_models_us": per_rank_us(lambda c: c.requests(), validated, ranks, repeat),
        "node_entry_encode_us": per_rank_us(_entry, batches, ranks, repeat),
        "node_entry_decode_us": per_rank_us(lambda e: records.decode(e[0], e[1], False, 0.0),
                                            entries, ranks, repeat),
        "bytes_rows": len(rows[0]), "bytes_columns": len(columns[0]),
        "bytes_node_entry": len(entries[0][1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=128, help="requests (default 128)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks a request (default 8)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    args = parser.parse_args()
    before = load()
    r = measure(args.nodes, args.gpus_per_node, args.repeat)
    print(f"per rank: rows {r['rows_us']} us, columns {r['columns_us']} us (validation "
          f"{r['columns_validate_us']}, models {r['columns_models_us']}); node entry: encode "
          f"{r['node_entry_encode_us']}, decode {r['node_entry_decode_us']} us; "
          f"{r['bytes_rows']} -> {r['bytes_columns']} bytes a request")
    print(f"load {before} -> {load()} on {os.cpu_count()} cpu", file=sys.stderr)
    print(json.dumps({"bench": "rank_columns", "when": now(), "machine": machine(),
                      "load_before": before, "load": load(), **r}))


if __name__ == "__main__":
    main()
