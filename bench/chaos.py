"""Chaos soak: `python bench/chaos.py --minutes N --seed S` (root: network namespaces).

A power-limit job and a Perseus job run while a seeded schedule of every fault class is applied
(`zeus_demo.chaos.soak`): a replica cut from the majority, an agent's node cut off, one-way
loss, random loss, a slow link, a NATS server killed, an owner paused, a server's power lost.
Prints the faults, the checker's violations (goal 0), takeover time p50/p99, time to heal per
fault class and lost acknowledged records (goal 0); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeus_demo.chaos.soak import CLASSES, run  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    try:
        report = run(args.minutes * 60, args.seed, list(CLASSES), lambda s: print(s, flush=True))
    except KeyboardInterrupt:  # (SIGTERM too: `run` removed its namespaces and processes.)
        print("stopped before the end: namespaces and processes removed", file=sys.stderr)
        return 130
    print(f"faults {report['faults']} ({', '.join(report['fault_classes'])}); violations "
          f"{report['violations']}; lost acknowledged {report['lost_acknowledged']}; takeover "
          f"p50 {report['takeover_s_p50']} s p99 {report['takeover_s_p99']} s; heal "
          f"{report['heal_s']}")
    print(json.dumps(report), flush=True)
    return 0 if report["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
