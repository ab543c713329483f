"""Ingest with many jobs on 1, 2, 4... replicas (`coordinator_ingest.py --replicas 1,2,4`).

For each replica count, on fresh processes: an embedded nats-server with JetStream, that many
`zeus-coordinator run` replicas (their rosters warm before any job registers, so the jobs spread
by rendezvous hashing at once), fake agents, and `--jobs` data-parallel power-limit jobs of
`--ranks / --jobs` ranks each (every job on its own nodes). Then `--duration` s of training
steps at `--scan-rate` steps/s per rank, flushed `--flush-hz` times a second, published as a
real agent does (`Publisher`: the per-rank event batches, and the marks and measurements).

Done is counted from outside, per job: after each flush a sentinel goes on each job's events
subject (a batch from a node none of its ranks is on: its owner counts it as `wrong_node`), so
when the replicas have counted every job's sentinels (summed over them), everything published
before them is processed. events_per_s: events published / (first publish -> that moment).
Each replica's CPU and its share of the jobs are in the record, with the machine's core count:
on a machine with fewer cores than replicas + nats-server + this harness, the cores bound the
scaling, not the replicas (`cpu_ms_per_1000_events` per replica shows the work is split, not
repeated).
"""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import Replicas, cpu_seconds, load

from zeus_agent.broker import EmbeddedNats, connect
from zeus_demo.cluster import wait_for_async

Register = Callable[[Any, int, int], Awaitable[tuple[str, str]]]
"""(nc, ranks, first node) -> (job id, join token): registers a job, each rank through its node."""
Publish = Callable[[Any, list[tuple[str, str, int, int]], int, int, float], Awaitable[int]]
"""(nc, jobs' (id, digest, ranks, first node), first step, last step, step s) -> messages
published: one flush of every rank of every job."""
Owners = Callable[[Any, list[str]], Awaitable[dict[str, str]]]
"""(nc, job ids) -> job id -> its owning replica (the ownership bucket)."""



async def scan(replica_counts: list[int], *, jobs: int, ranks: int, rate: float,
               duration_s: float, flush_hz: float, register: Register, publish: Publish,
               owners_of: Owners, sentinel: Callable[[str], tuple[str, bytes]],
               fake_agents: Callable[[str], Awaitable[Any]], settle_s: float,
               replica_args: list[str]) -> dict[str, Any]:
    """One ingest run per replica count; what `coordinator_ingest.py` prints."""
    runs = []
    for n in replica_counts:
        run = await _one(n, jobs=jobs, ranks=ranks, rate=rate, duration_s=duration_s,
                         flush_hz=flush_hz, register=register, publish=publish,
                         owners_of=owners_of, sentinel=sentinel, fake_agents=fake_agents,
                         settle_s=settle_s, replica_args=replica_args)
        runs.append(run)
        print(f"ingest with {n} replica(s), {jobs} jobs of {ranks // jobs} ranks: "
              f"{run['events_per_s']} events/s ({run['messages_per_s']} msg/s), jobs per "
              f"replica {run['jobs_by_replica']}, CPU ms per 1000 events "
              f"{run['cpu_ms_per_1000_events']}, load {run['load']}", flush=True)
    base = runs[0]["events_per_s"] or 0
    return {
        "jobs": jobs, "ranks": ranks, "rate_steps_per_s_per_rank": rate,
        "events_per_s_by_replicas": {str(r["replicas"]): r["events_per_s"] for r in runs},
        "speedup_by_replicas": {str(r["replicas"]): round(r["events_per_s"] / base, 2)
                                if base and r["events_per_s"] else None for r in runs},
        "cores": os.cpu_count(), "runs": runs,
    }


async def _one(n: int, *, jobs: int, ranks: int, rate: float, duration_s: float,
               flush_hz: float, register: Register, publish: Publish, owners_of: Owners,
               sentinel: Callable[[str], tuple[str, bytes]],
               fake_agents: Callable[[str], Awaitable[Any]], settle_s: float,
               replica_args: list[str]) -> dict[str, Any]:
    names = [f"s{n}r{i + 1}" for i in range(n)]
    per_job = ranks // jobs
    with tempfile.TemporaryDirectory(prefix="zeus-ingest-scan-") as tmp:
        root = Path(tmp)
        server = EmbeddedNats(store_dir=str(root / "js"))
        await asyncio.to_thread(server.start)
        reps = Replicas(server.url, root, names, ["--command-timeout-s", "10", *replica_args])
        agents_nc = nc = None
        try:
            reps.start_all()
            await asyncio.to_thread(reps.wait_healthy, 60)
            # Every roster warm and complete before any job registers: the jobs spread at once.
            await wait_for_async(lambda: all(
                (h := reps.health(name)) is not None and h.get("roster_warm")
                and len(h.get("replicas_live", [])) == n for name in names), settle_s,
                lambda: "the replicas never all heard each other")
            agents_nc = await fake_agents(server.url)
            nc = await connect(server.url, "simulated-agents-scan")
            made = [await register(nc, per_job, j * (per_job // 8 + 1)) for j in range(jobs)]
            job_ids = [job_id for job_id, _ in made]
            owners = await owners_of(nc, job_ids)
            expect = {name: sum(1 for o in owners.values() if o == name) for name in names}
            return await _drive(nc, reps, names, made, per_job, owners, expect, rate,
                                duration_s, flush_hz, publish, sentinel,
                                server._proc.pid if server._proc is not None else 0)  # noqa: SLF001
        except BaseException:
            reps.print_logs()
            raise
        finally:
            for c in (nc, agents_nc):
                if c is not None:
                    await c.close()
            await asyncio.to_thread(reps.stop_all)
            await asyncio.to_thread(server.stop)


async def _drive(nc: Any, reps: Replicas, names: list[str], made: list[tuple[str, str]],
                 per_job: int, owners: dict[str, str], expect: dict[str, int], rate: float,
                 duration_s: float, flush_hz: float, publish: Publish,
                 sentinel: Callable[[str], tuple[str, bytes]], nats_pid: int) -> dict[str, Any]:
    """Publish for `duration_s`, then wait until every replica processed its jobs' sentinels."""
    from zeus_agent.wire.messages import join_token_digest

    jobs = [(job_id, join_token_digest(token), per_job, j * (per_job // 8 + 1))
            for j, (job_id, token) in enumerate(made)]
    sentinels = [sentinel(job_id) for job_id, _ in made]
    pids = {**{name: reps.pid(name) for name in names}, "nats-server": nats_pid}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    dropped0 = {name: _sentinels(reps.health(name)) for name in names}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    tick_hz, step_s = min(rate, flush_hz), 1.0 / rate
    t_start = time.monotonic()
    step, events, messages, flushes, rounds = -1, 0, 0, 0, 0
    while (due := t_start + flushes / tick_hz) <= t_start + duration_s:
        if due > time.monotonic():
            await asyncio.sleep(due - time.monotonic())
        target = int((due - t_start) * rate)
        if target > step:
            messages += await publish(nc, jobs, step + 1, target, step_s)
            events += 4 * (target - step) * per_job * len(jobs) - (
                2 * per_job * len(jobs) if step < 0 else 0)
            step = target
            for subject, data in sentinels:
                await nc.publish(subject, data)
            rounds += 1
        flushes += 1
    await nc.flush()
    t_published = time.monotonic()

    async def all_done() -> bool:
        seen = 0
        for name in names:
            seen += _sentinels(await asyncio.to_thread(reps.health, name)) - dropped0[name]
        return seen >= len(made) * rounds

    complete = bool(await wait_for_async(all_done, max(60.0, 4 * duration_s), fail=False))
    t_end = time.monotonic()
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu["harness"] = self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime
    span = t_end - t_start
    return {
        "replicas": len(names),
        "jobs_by_replica": expect,
        "events": events, "messages": messages,
        "offered_events_per_s": round(events / duration_s),
        "published_events_per_s": round(events / (t_published - t_start)),
        "events_per_s": round(events / span) if complete else None,
        "messages_per_s": round(messages / span) if complete else None,
        "drain_s": round(t_end - t_published, 3) if complete else None,
        "cpu_ms_per_1000_events": {k: round(v * 1e6 / events, 3) if events else None
                                   for k, v in cpu.items()},
        "cpu_cores": {k: round(v / span, 3) for k, v in cpu.items()},
        "load": load(),
    }


def _sentinels(health: dict[str, Any] | None) -> int:
    return int(((health or {}).get("dropped") or {}).get("wrong_node", 0))
