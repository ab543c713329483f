"""CPU cost of a node agent: 8 simulated GPUs sampled at 10 Hz (budget: <= 2% of one core).

Starts an embedded nats-server and `zeus-agent run --backend sim --sim-count 8 --sample-hz 10`
as a separate process, lets it settle, then reads the agent's user+system CPU time from
/proc/<pid>/stat over a measurement window. No trainer is attached: this is the idle cost of
sampling, publishing samples, heartbeats and lease bookkeeping. Prints a line, then one JSON
object as the last line.

    python bench/agent_cpu.py [--seconds 20] [--gpus 8] [--hz 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, now

from zeus_agent.broker import EmbeddedNats

BUDGET_PCT = 2.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def main() -> None:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window (s)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hz", type=float, default=10.0)
    args = parser.parse_args()
    agent_bin = Path(sys.executable).with_name("zeus-agent")
    with EmbeddedNats() as server, tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [str(agent_bin), "run", "--nats-url", server.url, "--backend", "sim",
             "--sim-count", str(args.gpus), "--sample-hz", str(args.hz),
             "--sim-state-dir", f"{tmp}/sim", "--socket-path", f"{tmp}/agent.sock",
             "--node", "bench-cpu", "--log-level", "WARNING"],
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not Path(f"{tmp}/agent.sock").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the agent did not start")
                time.sleep(0.05)
            time.sleep(3.0)  # settle: imports and start-up are not the steady state
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.seconds)
            c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
    pct = 100.0 * (c1 - c0) / (t1 - t0)
    print(f"agent CPU with {args.gpus} simulated GPUs at {args.hz:g} Hz: {pct:.2f}% of one core "
          f"over {t1 - t0:.1f} s (budget {BUDGET_PCT}%)")
    print(json.dumps({
        "bench": "agent_cpu", "gpus": args.gpus, "sample_hz": args.hz,
        "cpu_pct_of_one_core": round(pct, 3), "window_s": round(t1 - t0, 1),
        "budget_pct": BUDGET_PCT, "ok": pct <= BUDGET_PCT,
        "machine": machine(),
        "date": now(),
    }))


if __name__ == "__main__":
    main()
