"""A node's measurement messages: how many, how full, and how late, per `--measurement-flush-s`.

For each value of `--flush-s`: an embedded nats-server and `zeus-agent run --backend sim
--sim-count 8` (the `h200` call-cost model, each GPU's energy counter updated every 100 ms as on
real GPUs: `--sim-energy-update-ms 100`) with `--measurement-flush-s` set to it, and one trainer
process that says HELLO for all 8 GPUs (one job, rank = GPU) and steps `--step-hz` times a
second (step_begin, then step_end half a step later: both are marked on every GPU). This
process follows `<p>.job.*.meas.<node>` for `--seconds` and counts the node's messages, their
parts and marks; a mark's lateness is its arrival here minus its event's stamp (the trainer's
`time.monotonic_ns()`: one host, one clock), so it holds the wait for the counter read that
brackets it (what `flush-s` 0 leaves alone) plus the node's flush delay.

Before node batches an agent published a batch per GPU at each of its counter reads: `flush-s`
0 is that cadence (a GPU's hand-over goes at the next turn of the event loop, with whatever the
other GPUs handed over in the same turn).

Prints a line per value, then one JSON object as the last line.

    python bench/node_batches.py [--flush-s 0,0.05,0.1] [--seconds 20] [--step-hz 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import load, machine, now, pct

from zeus_agent import children
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.wire import subjects
from zeus_agent.wire.node_columns import as_rows, decode_measurements
from zeus_demo.cluster import Processes, wait_for

NODE = "bench-node"
GPUS = 8
SETTLE_S = 4.0
"""Start-up and the counters' grids learnt before counting."""

TRAINER = """
import os, socket, sys, time
from zeus_agent.wire import trainer as dg
path, gpus, hz = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(""); s.connect(path); s.settimeout(10)
for gpu in range(gpus):  # one process for every GPU: its events reach them all
    hello = {"job_id": "bench-nodes", "rank": gpu, "gpu_index": gpu}
    s.send(dg.encode_request(dg.Kind.HELLO, os.getpid(), gpu + 1, hello))
    reply = dg.decode_datagram(s.recv(65536))
    if not reply.reply.ok:
        sys.exit(f"HELLO refused: {reply.reply.error}")
print("bound", flush=True)
step, half = 0, 0.5 / hz
while True:
    s.send(dg.encode_event(dg.Kind.STEP_BEGIN, os.getpid(), time.monotonic_ns(), step, 0, ""))
    time.sleep(half)
    s.send(dg.encode_event(dg.Kind.STEP_END, os.getpid(), time.monotonic_ns(), step, 0, ""))
    time.sleep(half)
    step += 1
"""


class Counted:
    """What arrived on the node's measurement subject while counting."""

    def __init__(self) -> None:
        self.counting = False
        self.messages = 0
        self.parts = 0
        self.marks = 0
        self.measurements = 0
        self.late_ms: list[float] = []

    async def on_batch(self, msg: Any) -> None:
        arrived = time.monotonic_ns()
        if not self.counting:
            return
        batch = as_rows(decode_measurements(msg.data))
        self.messages += 1
        self.parts += len(batch.gpus)
        for part in batch.gpus:
            self.marks += len(part.marks)
            self.measurements += len(part.measurements)
            self.late_ms += [(arrived - m.t_ns) / 1e6 for m in part.marks]


async def one(url: str, tmp: Path, flush_s: float, args: argparse.Namespace) -> dict[str, Any]:
    """One agent with `--measurement-flush-s flush_s`, counted for `args.seconds`."""
    agent_bin = Path(sys.executable).with_name("zeus-agent")
    sock = str(tmp / f"agent-{flush_s:g}.sock")
    procs = Processes(tmp / f"run-{flush_s:g}")
    agent = procs.spawn("agent", [
        str(agent_bin), "run", "--nats-url", url, "--backend", "sim",
        "--sim-count", str(GPUS), "--sim-energy-update-ms", "100",
        "--sim-state-dir", str(tmp / f"sim-{flush_s:g}"), "--socket-path", sock,
        "--node", NODE, "--measurement-flush-s", f"{flush_s:g}", "--log-level", "WARNING"])
    nc = await connect(url, "bench-node-batches")
    counted = Counted()
    try:
        await nc.subscribe(subjects.all_node_measurements(NODE), cb=counted.on_batch)
        await confirm_subscriptions(nc)
        wait_for(lambda: Path(sock).exists() or not procs.alive("agent"), 30)
        if not procs.alive("agent"):
            raise SystemExit("the agent did not start:\n" + procs.log("agent", 2000))
        trainer = procs.spawn("trainer", [sys.executable, "-c", TRAINER, sock, str(GPUS),
                                          str(args.step_hz)], stdout=subprocess.PIPE)
        assert trainer.stdout is not None
        if trainer.stdout.readline().strip() != b"bound":
            raise SystemExit("the trainer could not bind the GPUs:\n" + procs.log("trainer"))
        await asyncio.sleep(SETTLE_S)
        cpu0, t0 = cpu_s(agent.pid), time.monotonic()
        counted.counting = True
        await asyncio.sleep(args.seconds)
        counted.counting = False
        cpu1, span = cpu_s(agent.pid), time.monotonic() - t0
    finally:
        await nc.close()
        procs.kill("trainer")
        procs.stop("agent", 15)
        procs.close()
    late = sorted(counted.late_ms)
    return {
        "flush_s": flush_s,
        "messages_per_s": round(counted.messages / span, 2),
        "parts_per_message": round(counted.parts / max(1, counted.messages), 2),
        "marks_per_s": round(counted.marks / span, 1),
        "measurements_per_s": round(counted.measurements / span, 1),
        "mark_late_ms": {q: round(pct(late, p), 1) for q, p in
                         (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))} | {
                             "max": round(late[-1], 1) if late else None},
        "agent_cpu_pct": round(100 * (cpu1 - cpu0) / span, 2),
        "load": load(),
    }


def cpu_s(pid: int) -> float:
    """User + system CPU time of a process (s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    runs = []
    with EmbeddedNats() as server, tempfile.TemporaryDirectory(prefix="zeus-nb-") as tmp:
        for flush_s in args.flush_s:
            r = await one(server.url, Path(tmp), flush_s, args)
            runs.append(r)
            print(f"--measurement-flush-s {flush_s:g}: {r['messages_per_s']} messages/s from "
                  f"the node ({r['parts_per_message']} GPU parts each), {r['marks_per_s']} "
                  f"marks/s; a mark arrives {r['mark_late_ms']} ms after its event; agent CPU "
                  f"{r['agent_cpu_pct']}% of a core; load {r['load']}", flush=True)
    return {"bench": "node_batches", "gpus": GPUS, "step_hz": args.step_hz,
            "seconds": args.seconds, "runs": runs, "machine": machine(),
            "load_before": load_before, "load": load(), "date": now()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flush-s", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.0, 0.05, 0.1],
                        help="values of the agent's --measurement-flush-s, comma-separated "
                        "(default 0,0.05,0.1)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="seconds counted per value (default 20)")
    parser.add_argument("--step-hz", type=float, default=10.0,
                        help="the trainer's steps per second (default 10)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args))))


if __name__ == "__main__":
    with children.sigterm_as_sigint():
        main()
