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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
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


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    cluster = NatsCluster(3, ready_timeout_s=60)
    with tempfile.TemporaryDirectory(prefix="zeus-idle-") as tmp:
        reps = Replicas(",".join(cluster.urls), Path(tmp), ["r1", "r2"], [
            "--state-replicas", "3", "--max-job-idle-time", str(args.idle_s),
            "--max-jobs", str(2 * args.jobs)])
        states: Counter[str] = Counter()
        try:
            await asyncio.to_thread(cluster.start)
            reps.start_all()
            await asyncio.to_thread(reps.wait_healthy, 120)
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
            reps.close()
            await asyncio.to_thread(cluster.close)
    return {
        "bench": "idle_jobs", "jobs": args.jobs, "idle_s": args.idle_s,
        "register_s": round(register_s, 1), "register_retries": retries,
        "takeovers": states["taken_over"], "removed_statuses": states["removed"],
        "all_removed": all(v == 0 for v in removed["left"].values()),
        "last_removed_after_registration_s": removed["after_s"],
        "last_removed_after_idle_limit_s": round(removed["after_s"] - args.idle_s, 1),
        "left_per_replica": removed["left"], "replicas": 2, "nats_servers": 3,
        "state_replicas": 3, "machine": machine(), "load_before": load_before,
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
    args = p.parse_args()
    if args.quick:
        args.jobs, args.idle_s = 2000, 20
    result = asyncio.run(bench(args))
    print(f"load {result['load_before']} -> {result['load']}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
