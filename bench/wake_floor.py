"""The machine's floor under `instruction_latency.py`: the agent's hops with no agent code.

A trainer-like child process stamps `time.monotonic_ns()` and sends an 8-byte datagram on an
AF_UNIX socket, then sleeps (or spins, holding its GIL) for the gap. Two receivers:

* one hop (the agent's path, `zeus_agent.agent.doorbell`): a thread of this process sleeping
  in `recv` takes the time;
* two hops (the path without a doorbell): a uvloop reader (as the agent's gateway) hands the
  stamp to a worker thread through a `ThreadPoolExecutor` (as the loop hands a clock change to
  the GPU's setters' thread), which takes the time.

No decoding, no schedule, no NVML: what is left is the kernel's and the interpreter's cost of
waking threads after `gap` of idleness. On a bare-metal host that is tens of microseconds a
hop; on a small VM whose vCPUs halt while idle it is 100-200 and it moves 2-3x between runs,
so `instruction_latency.py` measures the one-hop floor beside each of its own runs.

    python bench/wake_floor.py [--steps 200] [--gap-us 50000]

Prints one line per mode, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import SHM_ROOT, machine, now, pct

from zeus_agent import children

WAIT = textwrap.dedent(
    """
    def wait():
        if mode == "sleep":
            time.sleep(gap_ns / 1e9)
        else:
            end = time.perf_counter_ns() + gap_ns
            x = 0
            while time.perf_counter_ns() < end:
                x += sum(range(50))
    """
)
"""The gap between events, as the trainer of `instruction_latency.py` waits it (`mode`,
`gap_ns`): the floor means something only if both sleep or spin alike."""

SENDER = textwrap.dedent(
    """
    import socket, sys, time
    path, mode, steps, gap_ns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    """
) + WAIT + textwrap.dedent(
    """
    for _ in range(steps):
        s.sendto(time.monotonic_ns().to_bytes(8, "little"), path)
        wait()
    s.sendto(b"", path)
    """
)


async def measure(mode: str, steps: int, gap_us: int, hops: int = 1) -> list[float]:
    """Stamp -> receiving thread latencies (us, sorted) of `steps` datagrams `gap_us` apart.

    `hops`: 1, a thread sleeping in `recv`; 2, the event loop, then a worker thread.
    """
    if hops == 1:
        return await asyncio.to_thread(_one_hop, mode, steps, gap_us)
    tmp = Path(tempfile.mkdtemp(prefix="zfl-", dir=SHM_ROOT))
    path = str(tmp / "floor.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    latencies: list[int] = []
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floor")
    worker.submit(lambda: None).result()  # The thread exists before the first datagram.

    def took(stamp: int) -> None:
        latencies.append(time.monotonic_ns() - stamp)

    def readable() -> None:
        while True:
            try:
                data = sock.recv(64)
            except BlockingIOError:
                return
            if not data:
                if not done.done():
                    done.set_result(None)
                return
            worker.submit(took, int.from_bytes(data, "little"))

    loop.add_reader(sock.fileno(), readable)
    proc = await children.create_subprocess_exec(
        sys.executable, "-c", SENDER, path, mode, str(steps), str(gap_us * 1000),
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await asyncio.wait_for(done, timeout=30 + steps * gap_us / 1e6 * 2)
        await proc.wait()
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()
        worker.shutdown(wait=True)
        os.unlink(path)
        tmp.rmdir()
    return sorted(x / 1000 for x in latencies)


def _one_hop(mode: str, steps: int, gap_us: int) -> list[float]:
    tmp = Path(tempfile.mkdtemp(prefix="zfl-", dir=SHM_ROOT))
    path = str(tmp / "floor.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30 + steps * gap_us / 1e6 * 2)
    latencies: list[int] = []
    proc = children.popen(
        [sys.executable, "-c", SENDER, path, mode, str(steps), str(gap_us * 1000)],
        stdout=subprocess.DEVNULL)
    try:
        while data := sock.recv(64):
            latencies.append(time.monotonic_ns() - int.from_bytes(data, "little"))
        proc.wait(30)
    finally:
        proc.kill()
        sock.close()
        os.unlink(path)
        tmp.rmdir()
    return sorted(x / 1000 for x in latencies)


def main() -> None:
    """Measure both modes; print a line each and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="datagrams per mode")
    parser.add_argument("--gap-us", type=int, default=50_000,
                        help="time between datagrams (default: %(default)s, as "
                        "instruction_latency.py)")
    args = parser.parse_args()
    if args.steps < 1 or args.gap_us < 0:
        parser.error("--steps must be >= 1 and --gap-us >= 0")
    import uvloop

    result: dict[str, object] = {"bench": "wake_floor", "gap_us": args.gap_us}
    for mode in ("sleep", "busy"):
        for hops, prefix, path in ((1, "", "thread"), (2, "two_hop_", "loop -> worker thread")):
            values = uvloop.run(measure(mode, args.steps, args.gap_us, hops))
            p50, p99 = pct(values, 0.5), pct(values, 0.99)
            print(f"{mode} sender: datagram -> {path} p50 {p50:.0f} us, "
                  f"p99 {p99:.0f} us ({len(values)} datagrams)")
            result[f"{prefix}{mode}_p50_us"] = round(p50, 1)
            result[f"{prefix}{mode}_p99_us"] = round(p99, 1)
    result.update(loadavg=[round(x, 2) for x in os.getloadavg()], machine=machine(), date=now())
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
