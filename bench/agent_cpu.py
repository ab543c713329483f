"""CPU cost of a node agent: 8 simulated GPUs sampled at 10 Hz (budget: <= 2% of one core).

Starts an embedded nats-server and `zeus-agent run --backend sim --sim-count 8 --sample-hz 10`
(the `h200` call-cost model, the default) as a separate process, lets it settle, then reads the
agent's user+system CPU time from /proc/<pid>/stat over a measurement window, and each thread's
from /proc/<pid>/task/*/stat: the event loop (the main thread), the counter readers (one
`gpuN-counter` thread per GPU) and the others (the GPUs' call threads, the status server). The
energy-counter and power-limit reads per second come from the agent's /metrics.

Idle (the budget's figure): no trainer is attached, so each GPU's counter is read ~once a second
(sampling, publishing samples, heartbeats and lease bookkeeping go on at their rates). With
`--bound` a second phase follows: one tiny trainer process per GPU says HELLO and steps slowly
(a step a second, half of it busy), so every counter update is read; only the agent's CPU is
counted. Prints lines, then one JSON object as the last line (with the load average before and
after: the VM's other work shows in the figures).

    python bench/agent_cpu.py [--seconds 20] [--gpus 8] [--hz 10] [--bound]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import free_port, machine, now

from zeus_agent import children
from zeus_agent.broker import EmbeddedNats
from zeus_demo.cluster import Processes, wait_for

BUDGET_PCT = 2.0
SETTLE_S = 6.0
"""Start-up, then learning the counters' grids (~2 s) and 20 locked reads before idle reads."""

TRAINER = """
import os, socket, sys, time
from zeus_agent.wire import trainer as dg
path, gpu = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(""); s.connect(path); s.settimeout(10)
hello = {"job_id": "bench-cpu", "rank": gpu, "gpu_index": gpu}
s.send(dg.encode_request(dg.Kind.HELLO, os.getpid(), 1, hello))
reply = dg.decode_datagram(s.recv(65536))
if not reply.reply.ok:
    sys.exit(f"HELLO refused: {reply.reply.error}")
print("bound", flush=True)
step = 0
while True:
    s.send(dg.encode_event(dg.Kind.STEP_BEGIN, os.getpid(), time.monotonic_ns(), step, 0, ""))
    time.sleep(0.5)
    s.send(dg.encode_event(dg.Kind.STEP_END, os.getpid(), time.monotonic_ns(), step, 0, ""))
    time.sleep(0.5)
    step += 1
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (s)."""
    return _ticks(Path(f"/proc/{pid}/stat")) / os.sysconf("SC_CLK_TCK")


def _ticks(stat: Path) -> int:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Each live thread's (name, user + system CPU ticks)."""
    out: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = ((task / "comm").read_text().strip(), _ticks(task / "stat"))
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return out


def split(pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
          seconds: float) -> dict[str, float]:
    """Per-thread-group CPU (% of one core) between two `thread_ticks` (threads that ended
    meanwhile are missed: the process total is the reference)."""
    groups = {"event_loop": 0, "counter_readers": 0, "other": 0}
    for tid, (name, ticks) in after.items():
        used = ticks - before.get(tid, (name, 0))[1]
        if tid == pid:
            groups["event_loop"] += used
        elif re.fullmatch(r"gpu\d+-counter", name):
            groups["counter_readers"] += used
        else:
            groups["other"] += used
    hz = os.sysconf("SC_CLK_TCK")
    return {k: round(100.0 * v / hz / seconds, 3) for k, v in groups.items()}


def scrape(port: int) -> dict[str, float]:
    """Totals over the GPUs of the agent's read counters (from its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        page = response.read().decode()
    totals = {"counter_reads": 0.0, "power_limit_reads": 0.0, "idle_gpus": 0.0}
    for line in page.splitlines():
        for key, metric in (("counter_reads", "zeus_gpu_counter_reads_total{"),
                            ("power_limit_reads", "zeus_gpu_power_limit_reads_total{"),
                            ("idle_gpus", "zeus_gpu_counter_reads_idle{")):  # fmt: skip
            if line.startswith(metric):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def measure(pid: int, port: int, seconds: float) -> dict[str, object]:
    """The agent's CPU over `seconds`: total, per thread group, reads per second."""
    m0, th0 = scrape(port), thread_ticks(pid)
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    th1, m1 = thread_ticks(pid), scrape(port)
    span = t1 - t0
    return {
        "cpu_pct": round(100.0 * (c1 - c0) / span, 3),
        "threads_pct": split(pid, th0, th1, span),
        "counter_reads_per_s": round((m1["counter_reads"] - m0["counter_reads"]) / span, 2),
        "power_limit_reads_per_s": round(
            (m1["power_limit_reads"] - m0["power_limit_reads"]) / span, 2),
        "idle_gpus": int(m1["idle_gpus"]),
        "window_s": round(span, 1),
    }


def bind_trainers(procs: Processes, sock: str, gpus: int, trainers: list[str]) -> None:
    """Start a trainer per GPU (named in `trainers` as each starts) and wait until all are bound."""
    for gpu in range(gpus):
        trainers.append(f"trainer-{gpu}")
        procs.spawn(trainers[-1], [sys.executable, "-c", TRAINER, sock, str(gpu)],
                    stdout=subprocess.PIPE)
    for t in trainers:
        out = procs.procs[t].stdout
        assert out is not None
        if out.readline().strip() != b"bound":
            raise SystemExit("a trainer could not bind its GPU:\n" + procs.log(t))


def report(args: argparse.Namespace, idle: dict[str, object], bound: dict[str, object] | None,
           load_before: tuple[float, float, float], load_after: tuple[float, float, float]
           ) -> dict[str, object]:
    """Print the idle (and bound) lines; return the JSON line's figures."""
    pct = float(idle["cpu_pct"])  # type: ignore[arg-type]
    print(f"agent CPU with {args.gpus} simulated GPUs at {args.hz:g} Hz, no trainer: {pct:.2f}% "
          f"of one core over {idle['window_s']} s (budget {BUDGET_PCT}%); threads "
          f"{idle['threads_pct']}, {idle['counter_reads_per_s']} counter reads/s")
    if bound is not None:
        print(f"with a trainer bound to each GPU: {bound['cpu_pct']}% of one core; threads "
              f"{bound['threads_pct']}, {bound['counter_reads_per_s']} counter reads/s")
    result: dict[str, object] = {
        "bench": "agent_cpu", "gpus": args.gpus, "sample_hz": args.hz,
        "cpu_pct_of_one_core": pct, "window_s": idle["window_s"],
        "budget_pct": BUDGET_PCT, "ok": pct <= BUDGET_PCT,
        "threads_pct": idle["threads_pct"],
        "counter_reads_per_s": idle["counter_reads_per_s"],
        "power_limit_reads_per_s": idle["power_limit_reads_per_s"],
        "idle_gpus": idle["idle_gpus"],
    }  # fmt: skip
    if bound is not None:
        result.update({
            "bound_cpu_pct_of_one_core": bound["cpu_pct"],
            "bound_threads_pct": bound["threads_pct"],
            "bound_counter_reads_per_s": bound["counter_reads_per_s"],
            "bound_power_limit_reads_per_s": bound["power_limit_reads_per_s"],
            "bound_idle_gpus": bound["idle_gpus"],
        })  # fmt: skip
    result.update({
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
        "machine": machine(), "date": now(),
    })  # fmt: skip
    return result


def main() -> None:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window (s)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--bound", action="store_true",
                        help="then measure again with a trainer bound to each GPU")
    args = parser.parse_args()
    agent_bin = Path(sys.executable).with_name("zeus-agent")
    port = free_port()
    load_before = os.getloadavg()
    trainers: list[str] = []
    bound: dict[str, object] | None = None
    with EmbeddedNats() as server, tempfile.TemporaryDirectory() as tmp:
        sock = f"{tmp}/agent.sock"
        procs = Processes(Path(tmp))  # the agent's and trainers' logs: tmp/logs
        proc = procs.spawn("agent", [
            str(agent_bin), "run", "--nats-url", server.url, "--backend", "sim",
            "--sim-count", str(args.gpus), "--sample-hz", str(args.hz),
            "--sim-state-dir", f"{tmp}/sim", "--socket-path", sock,
            "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
            "--node", "bench-cpu", "--log-level", "WARNING"])  # fmt: skip

        def started() -> bool:
            if not procs.alive("agent"):
                raise SystemExit("the agent did not start:\n" + procs.log("agent", 2000))
            return Path(sock).exists()

        try:
            wait_for(started, 30, lambda: "the agent did not start:\n" + procs.log("agent", 2000))
            time.sleep(SETTLE_S)  # start-up and learning are not the steady state
            idle = measure(proc.pid, port, args.seconds)
            if args.bound:
                bind_trainers(procs, sock, args.gpus, trainers)
                time.sleep(3.0)  # every GPU back to reading every update
                bound = measure(proc.pid, port, args.seconds)
        finally:
            for t in trainers:
                procs.kill(t)
            procs.stop("agent", 15)  # SIGTERM: it restores its GPUs and stops
            procs.close()
    load_after = os.getloadavg()
    print(json.dumps(report(args, idle, bound, load_before, load_after)))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
