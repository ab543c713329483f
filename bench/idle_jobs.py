"""Many idle jobs on 2 coordinator replicas: do they keep their owners, and go when idle?

A 3-server NATS cluster (`zeus_demo.cluster.NatsCluster`), 2 replicas (`zeus-coordinator run`,
state buckets with 3 JetStream replicas, `--max-job-idle-time --idle-s`), and `--jobs` jobs
registered (64 requests in flight, through 500 node subjects), no rank, no traffic: only the
replicas' own work (ownership leases, idle collection). Measured: the registration time, the
jobs that changed owner (`taken_over` statuses), and when the last job was removed (both
replicas' `/healthz` say 0 jobs) after its idle limit, with what is left at `--timeout-s`.

The targeted reproduction of `cluster_scale.py`'s "jobs not removed after their trainers
stopped": before the ownership leases were renewed side by side, 6,000 jobs changed owner
37,476 times and 684 were still registered 360 s after their idle limit. Prints a line per
change of the replicas' job counts, then LAST one JSON object.

Starving the replicas (the flapping of `cluster_scale.py` at 100,000 GPUs, issue 39 item 4):
`--pin-cpu 0` pins both replicas to one core; `--stall-s 8 --stall-every-s 20` freezes r1
(SIGSTOP, then SIGCONT) that long that often, an event loop that stops renewing and announcing
for a while but comes back; `--ownership-lease-s` shortens the leases; `--log-dir` keeps the
replicas' logs (INFO: every takeover and handover with its reason).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import Replicas, load, machine, now

from zeus_agent import children
from zeus_agent.broker import connect
from zeus_agent.models import JobInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus, PowerLimitOptions, RegisterJob, Reply
from zeus_demo.cluster import NatsCluster

NODES = 500
"""Node subjects the jobs are registered through (a node may register at most 256)."""


async def register(nc: Any, jobs: int) -> dict[str, int]:
    """Register `jobs` jobs, 64 at a time, retrying `unavailable`; the retries by reply."""
    gate = asyncio.Semaphore(64)
    request = codec.encode(RegisterJob(
        job=JobInfo(dp_degree=8, pp_degree=1, tp_degree=1, world_size=8),
        power_limit=PowerLimitOptions()))
    retries: Counter[str] = Counter()

    async def one(i: int) -> None:
        for _ in range(10):
            async with gate:
                msg = await nc.request(subjects.coord_register_job(f"node-{i % NODES}"),
                                       request, timeout=60)
            reply = codec.decode(msg.data, Reply)
            if reply.ok:
                return
            retries[re.sub(r"job \d{4}-\S+ ", "job <id> ", f"{reply.code}: {reply.error}")] += 1
            await asyncio.sleep(0.2)
        raise RuntimeError(f"job not registered: {reply.code}: {reply.error}")

    await asyncio.gather(*(one(i) for i in range(jobs)))
    return dict(retries)


async def until_removed(reps: Replicas, deadline_s: float) -> dict[str, Any]:
    """Until both replicas hold 0 jobs (or the deadline): when, and what was left."""
    t0, last = time.monotonic(), None
    while True:
        held = {n: (reps.health(n) or {}).get("jobs") for n in reps.names}
        if held != last:
            print(f"  {time.monotonic() - t0:.1f} s: jobs {held}", file=sys.stderr, flush=True)
            last = held
        if all(v == 0 for v in held.values()) or time.monotonic() - t0 > deadline_s:
            return {"after_s": round(time.monotonic() - t0, 1), "left": held}
        await asyncio.sleep(1.0)


async def stall(reps: Replicas, name: str, stall_s: float, every_s: float,
                stalls: list[float]) -> None:
    """Freeze replica `name` for `stall_s` every `every_s` (SIGSTOP, SIGCONT), until cancelled."""
    while True:
        await asyncio.sleep(every_s - stall_s)
        os.kill(reps.pid(name), signal.SIGSTOP)
        try:
            await asyncio.sleep(stall_s)
        finally:
            os.kill(reps.pid(name), signal.SIGCONT)
        stalls.append(stall_s)


def replica_args(args: argparse.Namespace) -> list[str]:
    """The replicas' flags."""
    out = ["--state-replicas", "3", "--max-job-idle-time", str(args.idle_s),
           "--max-jobs", str(2 * args.jobs)]
    if args.ownership_lease_s:
        out += ["--ownership-lease-s", str(args.ownership_lease_s)]
    return out


def counted(log: Path) -> dict[str, int]:
    """Takeovers and handovers a replica logged, by reason."""
    out: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if m := re.search(r"taken over by replica \S+ \((.*)\)$", line):
            out["taken over: " + re.sub(r"replica r\d", "replica <r>", m.group(1))] += 1
        elif "its lease taken back by replica" in line:
            out["own lease taken back"] += 1
        elif "lease on the job is lapsing" in line:
            out["lapsing"] += 1
    return dict(out)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    cluster = NatsCluster(3, ready_timeout_s=60)
    with tempfile.TemporaryDirectory(prefix="zeus-idle-") as tmp:
        reps = Replicas(",".join(cluster.urls), Path(tmp), ["r1", "r2"], replica_args(args),
                        log_level="INFO" if args.log_dir else "WARNING")
        states: Counter[str] = Counter()
        stalls: list[float] = []
        staller: asyncio.Task[None] | None = None
        logged: dict[str, dict[str, int]] = {}
        try:
            await asyncio.to_thread(cluster.start)
            reps.start_all()
            if args.pin_cpu is not None:
                for name in reps.names:
                    os.sched_setaffinity(reps.pid(name), {args.pin_cpu})
            await asyncio.to_thread(reps.wait_healthy, 120)
            if args.stall_s:
                staller = asyncio.create_task(
                    stall(reps, "r1", args.stall_s, args.stall_every_s, stalls))
            nc = await connect(cluster.url(0), "bench-harness")

            async def on_status(msg: Any) -> None:
                states[codec.decode(msg.data, JobStatus).state] += 1

            await nc.subscribe(subjects.all_job_status(), cb=on_status)
            t0 = time.monotonic()
            retries = await register(nc, args.jobs)
            register_s = time.monotonic() - t0
            print(f"{args.jobs} jobs registered in {register_s:.1f} s", file=sys.stderr)
            removed = await until_removed(reps, args.idle_s + args.timeout_s)
            await nc.close()
        finally:
            if staller is not None:
                staller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await staller
            reps.close()
            for name, paths in reps.procs.logs.items():
                logged[name] = counted(paths[-1])
                if args.log_dir:
                    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                    shutil.copy(paths[-1], Path(args.log_dir) / f"{name}.log")
            await asyncio.to_thread(cluster.close)
    return {
        "bench": "idle_jobs", "jobs": args.jobs, "idle_s": args.idle_s,
        "register_s": round(register_s, 1), "register_retries": retries,
        "takeovers": states["taken_over"], "removed_statuses": states["removed"],
        "all_removed": all(v == 0 for v in removed["left"].values()),
        "last_removed_after_registration_s": removed["after_s"],
        "last_removed_after_idle_limit_s": round(removed["after_s"] - args.idle_s, 1),
        "left_per_replica": removed["left"], "logged": logged, "stalls": len(stalls),
        "stall_s": args.stall_s, "stall_every_s": args.stall_every_s,
        "pin_cpu": args.pin_cpu, "ownership_lease_s": args.ownership_lease_s, "replicas": 2,
        "nats_servers": 3, "state_replicas": 3, "machine": machine(), "load_before": load_before,
        "load": load(), "date": now(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=6000, help="jobs registered")
    p.add_argument("--idle-s", type=int, default=60, help="the replicas' --max-job-idle-time")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long past the idle limit to wait for the last removal")
    p.add_argument("--quick", action="store_true", help="2,000 jobs, idle 20 s")
    p.add_argument("--pin-cpu", type=int, default=None, help="pin both replicas to this core")
    p.add_argument("--stall-s", type=float, default=0.0,
                   help="freeze replica r1 this long (SIGSTOP) every --stall-every-s")
    p.add_argument("--stall-every-s", type=float, default=20.0)
    p.add_argument("--ownership-lease-s", type=float, default=None,
                   help="the replicas' --ownership-lease-s (default theirs: 10 s)")
    p.add_argument("--log-dir", default=None,
                   help="keep the replicas' logs here (logged at INFO)")
    args = p.parse_args()
    if args.quick:
        args.jobs, args.idle_s = 2000, 20
    result = asyncio.run(bench(args))
    print(f"load {result['load_before']} -> {result['load']}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
