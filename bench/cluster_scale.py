"""A simulated cluster of 10,000 to 100,000 GPUs: the coordinator's and NATS's cost as it grows.

For each size of `--sizes` (GPUs, 8 per node), on fresh processes: a NATS cluster of 3
nats-servers with JetStream (`zeus_demo.cluster.NatsCluster`), 2 coordinator replicas
(`zeus-coordinator run`, state buckets with 3 JetStream replicas, `--max-job-idle-time
--idle-s`), and `--fleet-procs` fake fleet processes (`bench/_fleet.py`), each the agents and
trainers of a block of nodes: message load only, no GPU physics (each answers the commands of
its GPUs, publishes an `AgentHello` per node every `--hello-s`, a `SampleBatch` per GPU and a
`NodePower` per node every `--sample-s`, and for every rank of a job on its nodes one event
batch per step of `--step-s`, and one measurement batch per node of the job).

Then, in turn:

1. idle: the fleet alone for `--warm-s` (agents' heartbeats and samples, no job); the
   replicas' RSS "before jobs";
2. register: jobs of mixed sizes filling `--fill` of the nodes: one big job (16,384 GPUs at
   100,000, proportionally fewer for smaller sizes) and small ones of 8-64 GPUs (whole nodes),
   each registered (`RegisterJob`), then every rank through its own node's subject (each
   fleet process at most `--window` outstanding); `register_s`, and `first_limit_s` until
   every GPU of a job has had its first power limit;
3. run: `--minutes` of training steps; the power-limit optimiser profiles (warm-up 1 step,
   2 profiled steps per limit, 25 W apart); every `--every-s` the servers' `/varz` and
   `/connz`, and each process's CPU time and RSS are read: messages/s per server and per
   component (the NATS connections, by name), CPU cores per component, RSS peaks;
4. end: every trainer stops; the coordinator removes each job `--idle-s` after its last
   event (status `removed`), then the replicas' RSS "after every job ended" (item 5: memory
   per job bounded, and given back when jobs end).

Per size, per 1,000 GPUs: the replicas' CPU-s per minute of running and for the registration,
their RSS (total at the peak, and the growth over the idle fleet), and NATS's RSS. The fleet's
one connection per process stands in for thousands of agents' connections: what NATS would
send real agents is given as a derived figure (every agent subscribes to every lease renewal).

This machine may have 2 cores, shared: `cores` and the load average are in the record, and a
size whose fleet could not keep its pace says so (`fleet_behind`). Prints a human line per
phase, then LAST one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from _common import Replicas, cpu_seconds, load, machine, now
from _fleet import control_subject, node_name, rss_mb

from zeus_agent import children
from zeus_agent.broker import connect
from zeus_agent.models import JobInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobQuery, JobStatus, PowerLimitOptions, RegisterJob, Reply
from zeus_demo.cluster import NatsCluster, Processes, wait_for_async

BIG_JOB_AT_100K = 16_384
OPTIONS = PowerLimitOptions(warmup_steps=1, profile_steps=2, pl_step_w=25)
"""9 limits 100-300 W x (1 + 2) steps: the big job profiles for minutes at 10 s a step."""
EXPECTED_STATES = ("registered", "rank_registered", "discovering", "waiting", "profiling",
                   "done", "selecting", "removed", "taken_over", "resumed",
                   "reconciled")
FLEET = Path(__file__).resolve().parent / "_fleet.py"


def plan_jobs(gpus: int, gpn: int, fill: float, small: tuple[int, int],
              rng: random.Random) -> list[tuple[int, int]]:
    """Jobs as (first node, nodes): one big job first, then small ones up to `fill` of nodes."""
    nodes = gpus // gpn
    big = max(1, round(BIG_JOB_AT_100K * gpus / 100_000 / gpn))
    jobs = [(0, big)]
    used, limit = big, int(nodes * fill)
    lo, hi = max(1, small[0] // gpn), max(1, small[1] // gpn)
    while used < limit:
        n = min(rng.randint(lo, hi), limit - used)
        jobs.append((used, n))
        used += n
    return jobs


def http_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return dict(json.loads(r.read()))


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of process `pid` (its NATS connections among them)."""
    try:
        import psutil

        return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")}
    except Exception:  # noqa: BLE001 - gone, or no psutil: connections keep their names
        return set()


def snapshot(cluster: NatsCluster, pids: dict[str, int],
             replicas: list[str]) -> dict[str, Any]:
    """NATS counters (per server, per connection name), each process's CPU-s and RSS.

    The replicas' connections (all named `zeus-coordinator`) are told apart by their ports.
    """
    servers: dict[str, dict[str, Any]] = {}
    conns: dict[str, dict[str, int]] = {}
    ports = {n: local_ports(pids[n]) for n in replicas}
    for spec in cluster.servers:
        v = http_json(spec.http_port, "/varz")
        servers[spec.name] = {k: v.get(k, 0) for k in (
            "in_msgs", "out_msgs", "in_bytes", "out_bytes", "mem", "connections",
            "slow_consumers")}
        for c in http_json(spec.http_port, "/connz?limit=4096").get("connections", []):
            name = str(c.get("name") or "?")
            name = next((f"{name}:{n}" for n, p in ports.items() if c.get("port") in p), name)
            agg = conns.setdefault(name, {"in_msgs": 0, "out_msgs": 0})
            agg["in_msgs"] += int(c.get("in_msgs", 0))
            agg["out_msgs"] += int(c.get("out_msgs", 0))
    return {"t": time.monotonic(), "servers": servers, "conns": conns,
            "cpu": {k: cpu_seconds(p) for k, p in pids.items()},
            "rss": {k: rss_mb(p) for k, p in pids.items()}, "load": load()}


def rates(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Messages/s per server and per connection name, CPU cores per process, a -> b."""
    dt = max(1e-9, b["t"] - a["t"])

    def per_s(x: float, y: float) -> int:
        return round((y - x) / dt)

    servers = {n: {"in_msgs_per_s": per_s(a["servers"][n]["in_msgs"], s["in_msgs"]),
                   "out_msgs_per_s": per_s(a["servers"][n]["out_msgs"], s["out_msgs"])}
               for n, s in b["servers"].items()}
    # A connection's in_msgs are what it published, its out_msgs what the server sent it.
    conns = {n: {"published_per_s": per_s(a["conns"].get(n, {}).get("in_msgs", 0),
                                          c["in_msgs"]),
                 "received_per_s": per_s(a["conns"].get(n, {}).get("out_msgs", 0),
                                         c["out_msgs"])}
             for n, c in sorted(b["conns"].items())}
    cores = {k: round((b["cpu"][k] - a["cpu"][k]) / dt, 3) for k in b["cpu"]}
    return {"seconds": round(dt, 1), "servers": servers, "components": conns, "cores": cores}


class Size:
    """One size's processes and measurements."""

    def __init__(self, args: argparse.Namespace, gpus: int, root: Path) -> None:
        self.args = args
        self.gpus = gpus
        self.nodes = gpus // args.gpus_per_node
        self.root = root
        self.cluster = NatsCluster(3, ready_timeout_s=60)
        self.reps: Replicas | None = None
        self.fleet = Processes(root / "fleet")
        self.nc: Any = None
        self.pids: dict[str, int] = {}
        self.statuses: dict[str, str] = {}
        self.states: Counter[str] = Counter()
        """Every job status seen, by state; a few messages of the unexpected ones."""
        self.notes: list[str] = []
        self.snaps: list[dict[str, Any]] = []
        self.jobs: list[tuple[str, str, int, int]] = []  # id, token, first node, nodes

    async def start(self) -> None:
        a = self.args
        await asyncio.to_thread(self.cluster.start)
        urls = ",".join(self.cluster.urls)
        self.reps = Replicas(urls, self.root, ["r1", "r2"], [
            "--state-replicas", "3", "--max-job-idle-time", str(a.idle_s),
            "--command-timeout-s", "10", "--max-jobs", "100000"])
        self.reps.start_all()
        await asyncio.to_thread(self.reps.wait_healthy, 120)
        per = -(-self.nodes // a.fleet_procs)
        for i in range(a.fleet_procs):
            first = i * per
            count = min(per, self.nodes - first)
            if count <= 0:
                break
            self.fleet.spawn(f"fleet{i}", [
                sys.executable, str(FLEET), "--url", self.cluster.url(i % 3), "--index", str(i),
                "--first-node", str(first), "--nodes", str(count),
                "--gpus-per-node", str(a.gpus_per_node), "--hello-s", str(a.hello_s),
                "--sample-s", str(a.sample_s), "--step-s", str(a.step_s)])
        self.nc = await connect(self.cluster.url(0), "bench-harness")
        await self.nc.subscribe(subjects.all_job_status(), cb=self.on_status)
        for name in self.fleet.procs:
            await self.ctl(name, {"op": "ping"}, 120)
        self.pids = {**{n: self.reps.pid(n) for n in self.reps.names},
                     **{s.process: self.cluster.procs.procs[s.process].pid
                        for s in self.cluster.servers},
                     **{n: p.pid for n, p in self.fleet.procs.items()}}

    async def on_status(self, msg: Any) -> None:
        with contextlib.suppress(Exception):
            s = codec.decode(msg.data, JobStatus)
            if s.state == "removed" or s.job_id not in self.statuses:
                self.statuses[s.job_id] = s.state
            self.states[s.state] += 1
            if s.state not in EXPECTED_STATES and len(self.notes) < 5:
                self.notes.append(f"{s.job_id}: {s.state}: {s.message}"[:300])

    async def ctl(self, worker: str, req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """A request to fleet process `worker` (`fleetN`), retried until it answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = await self.nc.request(control_subject(int(worker[5:])),
                                            json.dumps(req).encode(), timeout=timeout_s)
                return dict(json.loads(msg.data))
            except Exception:
                if time.monotonic() > deadline or not self.fleet.alive(worker):
                    raise RuntimeError(f"{worker} did not answer {req['op']}:\n"
                                       + self.fleet.log(worker, 3000)) from None
                await asyncio.sleep(0.5)

    async def all_ctl(self, req: dict[str, Any], timeout_s: float = 30) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.ctl(n, req, timeout_s) for n in self.fleet.procs)))

    async def snap(self, label: str) -> dict[str, Any]:
        assert self.reps is not None
        s = await asyncio.to_thread(snapshot, self.cluster, self.pids, self.reps.names)
        s["label"] = label
        # The interpreter's allocated blocks (`/healthz`): what the jobs hold, where the RSS
        # also counts pages the allocator keeps after they are freed.
        reps = self.reps
        s["blocks"] = await asyncio.to_thread(
            lambda: {n: (reps.health(n) or {}).get("python_blocks") for n in reps.names})
        self.snaps.append(s)
        return s

    def replica_rss(self, s: dict[str, Any]) -> float:
        assert self.reps is not None
        return round(sum(s["rss"][n] for n in self.reps.names), 1)

    def replica_blocks(self, s: dict[str, Any]) -> int | None:
        """Both replicas' allocated Python blocks in snapshot `s` (None: not read)."""
        blocks = list(s.get("blocks", {}).values())
        return sum(blocks) if blocks and None not in blocks else None

    def nats_rss(self, s: dict[str, Any]) -> float:
        return round(sum(s["rss"][sp.process] for sp in self.cluster.servers), 1)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.all_ctl({"op": "quit"}, 5)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await asyncio.to_thread(self.fleet.close, 2.0)
        if self.reps is not None:
            await asyncio.to_thread(self.reps.close)
        await asyncio.to_thread(self.cluster.close)


async def register(size: Size, rng: random.Random, wave: int) -> dict[str, Any]:
    """Register every job, then every rank; until every GPU of a job has its first limit."""
    a = size.args
    plan = plan_jobs(size.gpus, a.gpus_per_node, a.fill, (a.small_min, a.small_max), rng)
    sem = asyncio.Semaphore(64)
    retries: dict[str, int] = {}

    async def job(first: int, nodes: int) -> tuple[str, str, int, int]:
        ranks = nodes * a.gpus_per_node
        info = JobInfo(dp_degree=ranks, pp_degree=1, tp_degree=1, world_size=ranks)
        request = codec.encode(RegisterJob(job=info, power_limit=OPTIONS))
        for _ in range(30):
            async with sem:
                raw = await size.nc.request(subjects.coord_register_job(node_name(first)),
                                            request, timeout=120)
            reply = codec.decode(raw.data, Reply)
            if reply.ok or reply.code not in ("unavailable", "internal"):
                break
            # The reply says retry (JetStream could not take the job now); an internal
            # error: a JetStream request timed out in the replica (see its log).
            why = re.sub(r"job \d{4}-\S+ ", "job <id> ", f"{reply.code}: {reply.error}")
            retries[why] = retries.get(why, 0) + 1
            await asyncio.sleep(rng.uniform(0.05, 0.5))
        if not reply.ok:
            raise RuntimeError(f"job not registered: {reply.code}: {reply.error}")
        return str(reply.result["job_id"]), str(reply.result["join_token"]), first, nodes

    t0 = time.monotonic()
    size.jobs = list(await asyncio.gather(*(job(f, n) for f, n in plan)))
    t_jobs = time.monotonic()
    cpu0 = await size.snap(f"w{wave} register start")
    results = await size.all_ctl({"op": "register", "jobs": size.jobs, "window": a.window},
                                 a.register_timeout_s)
    t_ranks = time.monotonic()
    job_gpus = sum(n for *_, n in size.jobs) * a.gpus_per_node
    print(f"  {size.gpus} GPUs, wave {wave}: ranks registered in {t_ranks - t0:.1f} s "
          f"({sum(r['failed'] for r in results)} failed)", file=sys.stderr, flush=True)
    limited, shown = 0, time.monotonic()

    async def every_gpu_limited() -> bool:
        nonlocal limited, shown
        limited = sum(s["gpus_limited"] for s in await size.all_ctl({"op": "stats"}))
        if limited >= job_gpus:
            return True
        if time.monotonic() - shown > 15:
            shown = time.monotonic()
            print(f"  {size.gpus} GPUs, wave {wave}: first limit on {limited} GPUs so far",
                  file=sys.stderr, flush=True)
        return False

    # Past the timeout the figures say how many GPUs had their limit (and which jobs not).
    await wait_for_async(every_gpu_limited, a.limit_timeout_s, interval_s=1.0, fail=False)
    t_limits = time.monotonic()
    without = {j: n for st in await size.all_ctl({"op": "stats"})
               for j, n in st["without_limit"].items()}
    for job_id, n in list(without.items())[:3]:
        print(f"  {size.gpus} GPUs, wave {wave}: job {job_id}: {n} GPU(s) without a limit; "
              f"the coordinator says {await job_progress(size, job_id, True)}", file=sys.stderr)
    cpu1 = await size.snap(f"w{wave} registered")
    failed = sum(r["failed"] for r in results)
    return {
        "jobs": len(size.jobs), "big_job_gpus": plan[0][1] * a.gpus_per_node,
        "small_jobs": len(plan) - 1, "job_gpus": job_gpus,
        "register_jobs_s": round(t_jobs - t0, 2), "register_s": round(t_ranks - t0, 2),
        "first_limit_s": round(t_limits - t0, 2), "gpus_with_first_limit": limited,
        "jobs_without_first_limit": without, "register_job_retries": retries,
        "register_rank_retries": {k: sum(r.get("retries", {}).get(k, 0) for r in results)
                                  for k in {k for r in results for k in r.get("retries", {})}},
        "rank_failures": failed, "first_failure": next((r["error"] for r in results
                                                        if r["error"]), None),
        "register_rates": rates(cpu0, cpu1),
    }


async def run(size: Size, wave: int) -> dict[str, Any]:
    """`--minutes` of training; rates over the whole span, RSS peaks, the big job's progress."""
    a = size.args
    stats0 = await size.all_ctl({"op": "stats"})
    first = await size.snap(f"w{wave} run start")
    end = time.monotonic() + a.minutes * 60
    while time.monotonic() < end:
        await asyncio.sleep(min(a.every_s, max(0.0, end - time.monotonic())))
        s = await size.snap(f"w{wave} running")
        print(f"  {size.gpus} GPUs, wave {wave}, running: replicas RSS "
              f"{size.replica_rss(s)} MB, NATS RSS {size.nats_rss(s)} MB, load {s['load']}",
              file=sys.stderr, flush=True)
    last = size.snaps[-1]
    stats1 = await size.all_ctl({"op": "stats"})
    published = {k: sum(s1["published"][k] - s0["published"][k]
                        for s0, s1 in zip(stats0, stats1, strict=True))
                 for k in stats1[0]["published"]}
    dt = last["t"] - first["t"]
    expected = {"hello": size.nodes / a.hello_s,
                "sample": size.gpus / a.sample_s if a.sample_s > 0 else 0,
                "power": size.nodes / a.sample_s if a.sample_s > 0 else 0,
                "events": sum(n for *_, n in size.jobs) * a.gpus_per_node / a.step_s}
    expected["meas"] = expected["events"] / a.gpus_per_node  # (Jobs are whole nodes.)
    pub_rates = {k: round(v / dt) for k, v in published.items()}
    # (The fleet follows each job's renewals once per node of it, as real agents do.)
    renewals = sum(s1["renewals"] - s0["renewals"] for s0, s1 in zip(stats0, stats1, strict=True))
    progress = await job_progress(size, size.jobs[0][0])
    return {
        "rates": rates(first, last),
        "fleet_published_per_s": pub_rates,
        "fleet_expected_per_s": {k: round(v) for k, v in expected.items()},
        "fleet_behind": any(pub_rates[k] < 0.9 * expected[k] for k in expected),
        "renewal_msgs_to_agents_per_s": round(renewals / dt),
        "big_job_power_limit": progress,
        "commands": {k: sum(s["commands"].get(k, 0) for s in stats1)
                     for k in {k for s in stats1 for k in s["commands"]}},
    }


async def job_progress(size: Size, job_id: str, detail: bool = False) -> dict[str, Any]:
    """The power-limit optimiser's progress on a job, as the coordinator answers a query.

    With `detail`: also whether the job is complete, its ranks, what it waits for, its
    quarantine (or the query's error).
    """
    with contextlib.suppress(Exception):
        msg = await size.nc.request(subjects.coord_job_query(),
                                    codec.encode(JobQuery(job_id=job_id)), timeout=30)
        reply = codec.decode(msg.data, Reply)
        if not reply.ok:
            return {"error": f"{reply.code}: {reply.error}"}
        result = reply.result or {}
        pl = result.get("power_limit") or {}
        out = {k: pl.get(k) for k in ("phase", "measured", "optimal_power_limit_w",
                                      "power_limit_w") if k in pl}
        if detail:
            out.update(complete=result.get("complete"), ranks=len(result.get("ranks") or {}),
                       waiting_for=str(result.get("waiting_for"))[:300],
                       quarantine=result.get("quarantine"), power_limit=str(pl)[:300])
        return out
    return {}


async def end(size: Size, wave: int) -> dict[str, Any]:
    """Every trainer stops; until the coordinator has removed every job, then the RSS."""
    a = size.args
    await size.all_ctl({"op": "end", "job_ids": [j[0] for j in size.jobs]})
    t0 = time.monotonic()
    ids = {j[0] for j in size.jobs}
    removed = 0

    def every_job_removed() -> bool:
        # The replicas' own count: a `removed` status may be lost to a slow subscriber.
        nonlocal removed
        removed = sum(1 for j in ids if size.statuses.get(j) == "removed")
        assert size.reps is not None
        return all((size.reps.health(n) or {}).get("jobs") == 0 for n in size.reps.names)

    # Past the timeout the figures say how many were removed.
    await wait_for_async(every_job_removed, a.idle_s + a.end_timeout_s, interval_s=1.0,
                         fail=False)
    t_removed = time.monotonic()
    await asyncio.sleep(a.settle_s)  # the replicas' garbage collection, JetStream's deletes
    after = await size.snap(f"w{wave} ended")
    assert size.reps is not None
    health = {n: (size.reps.health(n) or {}).get("jobs") for n in size.reps.names}
    return {"removed": removed if removed == len(ids) or any(health.values())
            else f"{removed} statuses seen, 0 jobs left", "removed_s": round(t_removed - t0, 1),
            "jobs_left_per_replica": health, "rss_after_mb": {
                n: round(after["rss"][n], 1) for n in size.reps.names}}


def memory(size: Size, waves: int) -> list[dict[str, Any]]:
    """The replicas' and NATS's RSS per wave: at its start, its peak, after its jobs ended."""
    out = []
    start = next(s for s in size.snaps if s["label"] == "before jobs")
    for w in range(1, waves + 1):
        during = [s for s in size.snaps if s["label"] in (f"w{w} registered", f"w{w} running")]
        ended = next(s for s in size.snaps if s["label"] == f"w{w} ended")
        out.append({"wave": w, "replicas_start_mb": size.replica_rss(start),
                    "replicas_peak_mb": max(size.replica_rss(s) for s in during),
                    "replicas_after_mb": size.replica_rss(ended),
                    "nats_start_mb": size.nats_rss(start),
                    "nats_peak_mb": max(size.nats_rss(s) for s in during),
                    "nats_after_mb": size.nats_rss(ended),
                    **blocks_released(size, start, during, ended)})
        start = ended
    return out


def blocks_released(size: Size, start: dict[str, Any], during: list[dict[str, Any]],
                    ended: dict[str, Any]) -> dict[str, Any]:
    """The replicas' allocated Python blocks at a wave's start, peak and end, and the share of
    what the wave added that its end gave back (1.0: all of it)."""
    before, after = size.replica_blocks(start), size.replica_blocks(ended)
    peaks = [b for b in (size.replica_blocks(s) for s in during) if b is not None]
    if before is None or after is None or not peaks:
        return {}
    peak = max(peaks)
    added = peak - before
    return {"replicas_blocks_start": before, "replicas_blocks_peak": peak,
            "replicas_blocks_after": after,
            "blocks_released_share": round((peak - after) / added, 3) if added > 0 else None}


def per_msg_us(r: dict[str, Any], names: list[str]) -> dict[str, float | None]:
    """Each replica's CPU per message NATS sent it, while running (us)."""
    out: dict[str, float | None] = {}
    for n in names:
        got = r["components"].get(f"zeus-coordinator:{n}", {}).get("received_per_s", 0)
        out[n] = round(r["cores"][n] / got * 1e6, 1) if got else None
    return out


def summary(size: Size, waves: list[dict[str, Any]]) -> dict[str, Any]:
    """The size's record: per 1,000 GPUs and per job (the first wave's), and the raw rates."""
    assert size.reps is not None
    names = size.reps.names
    k = size.gpus / 1000
    reg, ran = waves[0]["reg"], waves[0]["ran"]
    mem = memory(size, len(waves))
    first, last = mem[0], mem[-1]
    peak, before = first["replicas_peak_mb"], first["replicas_start_mb"]
    cores = ran["rates"]["cores"]
    reg_r = reg["register_rates"]
    reg_cpu = sum(reg_r["cores"][n] for n in names) * reg_r["seconds"]
    run_cores = sum(cores[n] for n in names)
    return {
        "gpus": size.gpus, "nodes": size.nodes, **{x: reg[x] for x in (
            "jobs", "big_job_gpus", "small_jobs", "job_gpus", "register_s", "first_limit_s",
            "gpus_with_first_limit", "jobs_without_first_limit", "register_job_retries",
            "register_rank_retries",
            "rank_failures",
            "first_failure")},
        **{f"{x}_by_wave": [w["reg"][x] for w in waves] for x in (
            "register_job_retries", "register_rank_retries", "rank_failures")},
        "coordinator_cpu_s_per_1k_gpus": round(run_cores * 60 / k, 3),
        "coordinator_cpu_s_per_1k_gpus_is": "CPU-s per minute of running, both replicas",
        "coordinator_cores": round(run_cores, 3),
        "coordinator_register_cpu_s_per_1k_gpus": round(reg_cpu / k, 3),
        "coordinator_rss_mb_per_1k_gpus": round(peak / k, 2),
        "coordinator_rss_growth_mb_per_1k_gpus": round((peak - before) / k, 2),
        "memory_per_job_mb": round((peak - before) / reg["jobs"] / len(names), 3),
        "memory_by_wave": mem,
        "memory_after_last_wave_over_first_peak_mb": round(
            last["replicas_after_mb"] - peak, 1),
        "memory_peak_growth_over_waves_mb": round(last["replicas_peak_mb"] - peak, 1),
        "jobs_removed": [w["ended"]["removed"] for w in waves],
        "jobs_removed_s": [w["ended"]["removed_s"] for w in waves],
        "jobs_left_per_replica": waves[-1]["ended"]["jobs_left_per_replica"],
        "nats_rss_mb_peak": first["nats_peak_mb"],
        "nats_rss_mb_per_1k_gpus": round(first["nats_peak_mb"] / k, 2),
        "nats_msgs_per_s": ran["rates"]["servers"],
        "nats_slow_consumers": {n: v.get("slow_consumers", 0)
                                for n, v in size.snaps[-1]["servers"].items()},
        "nats_msgs_per_s_total": {
            d: sum(v[f"{d}_msgs_per_s"] for v in ran["rates"]["servers"].values())
            for d in ("in", "out")},
        "components_msgs_per_s": ran["rates"]["components"],
        "replica_cpu_us_per_msg_received": per_msg_us(ran["rates"], names),
        "cores_by_process": cores,
        "running_s": ran["rates"]["seconds"],
        **{x: ran[x] for x in ("fleet_published_per_s", "fleet_expected_per_s", "fleet_behind",
                               "renewal_msgs_to_agents_per_s",
                               "big_job_power_limit", "commands")},
        "register_msgs_per_s": reg_r["servers"], "register_cores": reg_r["cores"],
        "job_states_seen": dict(size.states), "unexpected_states": size.notes,
        "load": size.snaps[-1]["load"],
    }


def work_dir(keep_in: str | None, gpus: int) -> contextlib.AbstractContextManager[str]:
    """A size's folder: temporary, or kept under `keep_in` (its processes' logs outlive it)."""
    if keep_in is None:
        return tempfile.TemporaryDirectory(prefix="zeus-scale-")
    kept = tempfile.mkdtemp(prefix=f"zeus-scale-{gpus}-", dir=keep_in)
    print(f"{gpus} GPUs: logs kept in {kept}", file=sys.stderr, flush=True)
    return contextlib.nullcontext(kept)


async def one_size(args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    """Start, idle, then per wave register, run and end; stop: one size's record."""
    rng = random.Random(args.seed)
    with work_dir(args.keep_logs, gpus) as tmp:
        size = Size(args, gpus, Path(tmp))
        try:
            await size.start()
            await asyncio.sleep(args.warm_s)
            s = await size.snap("before jobs")
            print(f"{gpus} GPUs: fleet up; before jobs: replicas RSS {size.replica_rss(s)} MB, "
                  f"NATS RSS {size.nats_rss(s)} MB; load {s['load']}", file=sys.stderr,
                  flush=True)
            waves = []
            for wave in range(1, args.waves + 1):
                reg = await register(size, rng, wave)
                print(f"{gpus} GPUs, wave {wave}: {reg['jobs']} jobs ({reg['big_job_gpus']} + "
                      f"{reg['small_jobs']} small), {reg['job_gpus']} ranks registered in "
                      f"{reg['register_s']} s ({reg['rank_failures']} failed), first limit on "
                      f"{reg['gpus_with_first_limit']} GPUs by {reg['first_limit_s']} s",
                      file=sys.stderr, flush=True)
                ran = await run(size, wave)
                ended = await end(size, wave)
                print(f"{gpus} GPUs, wave {wave}: {ended['removed']}/{reg['jobs']} jobs removed "
                      f"{ended['removed_s']} s after their trainers stopped; replicas RSS "
                      f"after {ended['rss_after_mb']}", file=sys.stderr, flush=True)
                waves.append({"reg": reg, "ran": ran, "ended": ended})
            return summary(size, waves)
        except BaseException:
            with contextlib.suppress(Exception):  # what NATS says of the failure
                s = await size.snap("failed")
                print(f"{gpus} GPUs failed; NATS servers: {s['servers']}", file=sys.stderr)
            if size.reps is not None:
                size.reps.print_logs()
            print(size.fleet.all_logs(2000), file=sys.stderr)
            raise
        finally:
            await size.close()


def growth(by_size: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How each per-1,000-GPU figure changes from the smallest size to the largest."""
    done = {k: v for k, v in by_size.items() if "error" not in v}
    if len(done) < 2:
        return {}
    lo, hi = done[min(done, key=int)], done[max(done, key=int)]
    keys = ("coordinator_cpu_s_per_1k_gpus", "coordinator_rss_mb_per_1k_gpus",
            "coordinator_rss_growth_mb_per_1k_gpus", "nats_rss_mb_per_1k_gpus",
            "memory_per_job_mb", "coordinator_register_cpu_s_per_1k_gpus")
    out: dict[str, Any] = {"from_gpus": lo["gpus"], "to_gpus": hi["gpus"]}
    for key in keys:
        out[key] = round(hi[key] / lo[key], 3) if lo[key] else None
    out["register_s"] = round(hi["register_s"] / lo["register_s"], 3) if lo["register_s"] else None
    out["nats_out_msgs_per_s"] = (round(hi["nats_msgs_per_s_total"]["out"]
                                        / lo["nats_msgs_per_s_total"]["out"], 3)
                                  if lo["nats_msgs_per_s_total"]["out"] else None)
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    by_size: dict[str, dict[str, Any]] = {}
    for gpus in args.sizes:
        try:
            by_size[str(gpus)] = r = await one_size(args, gpus)
        except Exception as e:  # noqa: BLE001 - the sizes before and after still count
            by_size[str(gpus)] = {"gpus": gpus, "error": repr(e)[:500]}
            print(json.dumps({"size_record": by_size[str(gpus)]}), flush=True)
            continue
        print(json.dumps({"size_record": r}), flush=True)  # kept even if a later size fails
        mem = r["memory_by_wave"]
        print(f"{gpus} GPUs: coordinator {r['coordinator_cpu_s_per_1k_gpus']} CPU-s per minute "
              f"and {r['coordinator_rss_mb_per_1k_gpus']} MB per 1,000 GPUs; NATS "
              f"{r['nats_msgs_per_s_total']} msgs/s, RSS {r['nats_rss_mb_peak']} MB; replicas' "
              f"RSS by wave {[(m['replicas_peak_mb'], m['replicas_after_mb']) for m in mem]} "
              f"(peak, after the jobs ended), allocated Python blocks the jobs added given "
              f"back {[m.get('blocks_released_share') for m in mem]}; load {r['load']}",
              flush=True)
    return {
        "bench": "cluster_scale", "gpus": args.sizes, "by_size": by_size,
        "growth": growth(by_size), "quick": args.quick, "minutes": args.minutes,
        "settings": {k: getattr(args, k) for k in (
            "gpus_per_node", "fleet_procs", "step_s", "sample_s", "hello_s", "fill",
            "small_min", "small_max", "idle_s", "window", "waves", "seed")},
        "power_limit_options": OPTIONS.model_dump(include={"warmup_steps", "profile_steps",
                                                           "pl_step_w"}),
        "replicas": 2, "nats_servers": 3, "state_replicas": 3,
        "cores": os.cpu_count(), "machine": machine(), "load_before": load_before,
        "load": load(), "date": now(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[10_000, 25_000, 50_000, 100_000],
                   help="cluster sizes in GPUs, comma separated (default 10000,25000,50000,"
                   "100000)")
    p.add_argument("--minutes", type=float, default=3.0,
                   help="minutes of running after registration, per size (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2,000 GPUs, 20 s of running (well under a minute)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--fleet-procs", type=int, default=2,
                   help="fake fleet processes, each a block of nodes (default 2)")
    p.add_argument("--step-s", type=float, default=10.0,
                   help="the fake trainers' training step (s; default 10)")
    p.add_argument("--sample-s", type=float, default=10.0,
                   help="each GPU's samples period (s; a real agent publishes every 1 s; "
                   "default 10; 0: none)")
    p.add_argument("--hello-s", type=float, default=5.0,
                   help="each node's heartbeat period (s; the agent's default, 5)")
    p.add_argument("--fill", type=float, default=1.0,
                   help="fraction of the nodes that jobs occupy (default 1: every GPU)")
    p.add_argument("--small-min", type=int, default=8, help="smallest small job, GPUs")
    p.add_argument("--small-max", type=int, default=64, help="largest small job, GPUs")
    p.add_argument("--idle-s", type=int, default=None,
                   help="the replicas' --max-job-idle-time: a job is removed this long after "
                   "its trainers stopped (default 2 steps + 10 s: a running job is never idle "
                   "that long)")
    p.add_argument("--window", type=int, default=2000,
                   help="rank registrations outstanding per fleet process (default 2000)")
    p.add_argument("--warm-s", type=float, default=10.0,
                   help="the fleet alone before jobs register (s; default 10)")
    p.add_argument("--every-s", type=float, default=10.0, help="reading period (s)")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="after the last job's removal, before the RSS is read (s; default 5)")
    p.add_argument("--register-timeout-s", type=float, default=600.0,
                   help="the most the ranks' registrations may take (s)")
    p.add_argument("--limit-timeout-s", type=float, default=180.0,
                   help="after the registrations, the most the first limits may take to reach "
                   "every GPU (s; the run goes on without)")
    p.add_argument("--end-timeout-s", type=float, default=120.0,
                   help="beyond --idle-s, how long jobs may take to be removed (s)")
    p.add_argument("--waves", type=int, default=2,
                   help="waves of jobs per size, each registered, run and ended: memory must "
                   "not grow from one to the next (default 2)")
    p.add_argument("--seed", type=int, default=1, help="seed of the small jobs' sizes")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="keep each size's processes' logs and state in a new folder under DIR "
                   "(default: a temporary folder, removed)")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.minutes, args.warm_s, args.every_s = [2_000], 8 / 60, 2.0, 4.0
        args.idle_s, args.settle_s, args.step_s = 5, 1.0, 2.0
    if args.idle_s is None:
        args.idle_s = int(2 * args.step_s + 10)
    if args.idle_s <= args.step_s:
        p.error(f"--idle-s {args.idle_s} would remove running jobs (steps every {args.step_s} s)")
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        result = uvloop.run(bench(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(bench(args))
    print(f"load {result['load_before']} -> {result['load']} on {os.cpu_count()} cpu",
          file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
