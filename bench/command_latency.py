"""Command round trip: request -> agent -> reply for a power-limit command (docs/benchmarks.md).

Starts a loopback nats-server and `zeus-agent run --backend sim` as its own process (as in
production), then times `set_power_limit` requests from this process with
`time.perf_counter_ns()`: encode, NATS request, the agent decodes, validates against the GPU,
sets the limit (alternating two values, so every command changes the simulated GPU's state
file), leases it, and replies; this side decodes the reply. Budget: p99 <= 2 ms.

The simulated GPU charges NVML's costs (`--nvml-timing h200`, the agent's default since the
timing model: a power-limit set costs `--set-latency-ms`, 1 ms by default, and waits behind an
energy-counter read (~3 ms, once per 100 ms update) when it meets one); `--nvml-timing none` is
the untimed simulator the budget was first met on. The JSON line says which (`nvml_timing`).

Prints a short table, then one JSON object as the last line.

    python bench/command_latency.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import SHM_ROOT, machine, now, pct

from zeus_agent import children
from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, Reply, SetPowerLimitCmd
from zeus_demo.cluster import Processes

BUDGET_P99_US = 2000.0
NODE = "bench"


async def run(requests: int, warmup: int, timing: str = "h200",
              set_latency_ms: float = 1.0) -> dict:
    """Start the broker and the agent, time the commands, stop everything."""
    # The simulated GPU's state file lives in memory, as a real GPU's registers do.
    tmp = Path(tempfile.mkdtemp(prefix="zab-", dir=SHM_ROOT))
    procs = Processes(tmp)  # the agent's log: tmp/logs (printed if the run fails)
    async with EmbeddedNats() as server:
        nc = await connect(server.url, "bench-client")
        hello = await nc.subscribe(subjects.agent_hello(NODE))
        procs.spawn("agent", [
            sys.executable, "-m", "zeus_agent.cli", "run", "--nats-url", server.url,
            "--backend", "sim", "--node", NODE, "--sim-state-dir", str(tmp / "sim"),
            "--socket-path", str(tmp / "agent.sock"), "--log-level", "WARNING",
            "--sim-nvml-timing", timing, "--sim-set-latency-ms", str(set_latency_ms),
        ])  # fmt: skip
        try:
            await hello.next_msg(timeout=20)
            subject = subjects.gpu_command(NODE, 0)
            payloads = [
                codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=w, holder="b")))
                for w in (200, 250)
            ]
            samples: list[float] = []
            for i in range(warmup + requests):
                t0 = time.perf_counter_ns()
                msg = await nc.request(subject, payloads[i % 2], timeout=2)
                reply = codec.decode(msg.data, Reply)
                t1 = time.perf_counter_ns()
                if not reply.ok:
                    raise RuntimeError(f"command failed: {reply.code}: {reply.error}")
                if i >= warmup:
                    samples.append((t1 - t0) / 1000)
        except BaseException:
            print(procs.log("agent"), file=sys.stderr)
            raise
        finally:
            await asyncio.to_thread(procs.stop, "agent", 10)  # SIGTERM, SIGKILL past 10 s
            await asyncio.to_thread(procs.close)
            await nc.close()
            shutil.rmtree(tmp, ignore_errors=True)
    samples.sort()
    return {"samples": samples}


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--nvml-timing", choices=["h200", "none"], default="h200",
                        help="what the simulated GPU's NVML calls cost (default: %(default)s)")
    parser.add_argument("--set-latency-ms", type=float, default=1.0,
                        help="cost of a power-limit set under h200 (ms; default: %(default)s)")
    args = parser.parse_args()
    samples = asyncio.run(run(args.requests, args.warmup, args.nvml_timing,
                              args.set_latency_ms))["samples"]
    p50, p90, p99 = (pct(samples, q) for q in (0.5, 0.9, 0.99))
    head = ("set_power_limit round trip (us)", "p50", "p90", "p99", "max")
    print("{:34s} {:>8s} {:>8s} {:>8s} {:>8s}".format(*head))
    row = ("loopback NATS, sim GPU, agent proc", p50, p90, p99, samples[-1])
    print("{:34s} {:8.0f} {:8.0f} {:8.0f} {:8.0f}".format(*row))
    print(f"({len(samples)} requests after {args.warmup} warm-up; ", end="")
    print(f"budget p99 <= {BUDGET_P99_US:.0f} us)")
    result = {
        "bench": "command_latency",
        "nvml_timing": args.nvml_timing,
        "set_latency_ms": args.set_latency_ms if args.nvml_timing == "h200" else 0.0,
        "p50_us": round(p50, 1),
        "p99_us": round(p99, 1),
        "max_us": round(samples[-1], 1),
        "requests": len(samples),
        "budget_p99_us": BUDGET_P99_US,
        "ok": p99 <= BUDGET_P99_US,
        "machine": machine(),
        "date": now(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
