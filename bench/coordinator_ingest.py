"""Coordinator ingest: trainer events and GPU measurements of 1,024 ranks; replica takeover time.

Part 1, ingest. An embedded nats-server with JetStream, `--replicas` coordinator replicas (2 by
default; each a `zeus-coordinator run` process) and, in this process, fake agents for 128
nodes x 8 GPUs (they answer `info` and the power-limit commands) and the 1,024 simulated ranks
of one data-parallel power-limit job, registered through their own nodes like real agents do
(the coordinator accepts a rank's events only from the node its GPU is on). Then, for each
offered rate of `--rates` (steps per second per rank) for `--duration` s, every rank's agent
publishes what a real agent does for a training step, flushed `--flush-hz` times a second at
most (a flush carries every step since the last one):

* a `TrainerEventBatch` on `<p>.job.<job>.ev.<rank>.<node>` (`TrainerEventColumns` with
  `--event-layout columns`): step_end and step_begin per step;
* its GPU's part of its node's `NodeMeasurementBatch` on `<p>.job.<job>.meas.<node>` (one
  message per node of 8 GPUs): per step, the step_begin mark (GPU time and energy counter) and
  the step's measurement (time, energy).

"Events" below are the items: trainer events + marks + measurements (4 per rank-step);
"messages" are the batches (9 per node and flush: 8 ranks' events, the node's measurements).
Rank 0 paces the power-limit optimiser (warmup 5 + profile 10 steps per limit, 41 limits
100-300 W: it profiles for the whole run, so windows keep closing, every GPU keeps getting new
limits, and the owner keeps writing its progress to JetStream).

End to end, counted from outside (the coordinator has no counter of processed events): after
each flush, one sentinel goes on each of the job's streams, from a node no rank is on (only
the job's owner follows them): on its events subject an event batch (dropped as `wrong_node`),
on its measurements subject bytes that are not msgpack (dropped as `malformed`); the owner
processes each stream in order and counts the sentinels as `dropped` in its `/healthz`, so
when the replicas have counted n of each (summed: the job may be handed over to its preferred
replica meanwhile), everything published before them is processed. For each rate (the owner:
the job's at its end):

* events_per_s: the events published / (first publish -> the owner has processed the last);
  `keeps_up` when the owner finished within 1 s of the last publish;
* cpu_ms_per_1000_events: CPU of the owning replica (and of the other replica, which follows
  none of the job's streams) per 1,000 events, over the same span;
* the publisher's own rate, so a harness that could not keep the pace is visible.

Part 2, takeover. For each lease of `--leases` (`--ownership-lease-s`), `--trials` times: a
fresh nats-server and 2 replicas, a job of 8 ranks registered and started (its first power
limit delivered), then, at a random point of the owner's renewal cycle, SIGKILL of the owner
(read from the `<bucket>-owners` KV bucket); timed from the kill to the other replica's
`taken_over` status on `<p>.job.<job>.status`, and to its first power-limit command to the
job's GPUs (it drives the job again). The owner renews its lease every lease/3 to now + lease,
and the others look every lease/3, so a takeover is expected 2/3 to 4/3 of the lease after
the kill (lease_left_s: what was left of the lease at the kill).

Prints a human line per rate and per trial, then LAST one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from _common import Replicas, cpu_seconds, jetstream_syncs, load, machine, now, spread
from _fleet import node_batch, step_batches
from _ingest_replicas import scan as ingest_scan

from coordinator.state import records
from zeus_agent import children
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    GpuDescription,
    JobStatus,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
    join_token_digest,
)
from zeus_demo.cluster import wait_for_async

GPUS_PER_NODE = 8
SENTINEL_NODE = "bench-sentinel-node"
KEEPS_UP_S = 1.0
"""A rate is sustained when the owner has processed everything within this of the last publish."""
OPTIONS = PowerLimitOptions(warmup_steps=5, profile_steps=10, pl_step_w=5)
"""41 limits x (5 + 10) steps: the job profiles for ~600 steps, longer than any run here."""


def node_name(n: int) -> str:
    return f"node{n:04d}"


def placement(rank: int) -> tuple[str, int]:
    """(node, GPU index) of a rank: 8 GPUs per node, in rank order."""
    return node_name(rank // GPUS_PER_NODE), rank % GPUS_PER_NODE


class FakeAgents:
    """Every GPU's command responder: `info`, and an ok to everything else (limits counted)."""

    def __init__(self) -> None:
        desc = GpuDescription(
            index=0, uuid="GPU-x", name="NVIDIA A40", architecture="Ampere",
            min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
            supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
            has_energy_counter=True, power_limit_w=300,
        ).model_dump()
        self._desc = desc
        self._info: dict[str, bytes] = {}
        self._ok = codec.encode(Reply.success())
        self.limits: list[tuple[float, str, int]] = []
        """(monotonic time, holder, watts) of every set_power_limit received."""
        self.counts: dict[str, int] = {}

    def info_reply(self, subject: str) -> bytes:
        reply = self._info.get(subject)
        if reply is None:
            parts = subject.split(".")  # <p>.gpu.<node>.<gpu>.cmd
            node, gpu = parts[-3], int(parts[-2])
            desc = {**self._desc, "index": gpu, "uuid": f"GPU-{node}-{gpu}"}
            reply = self._info[subject] = codec.encode(Reply.success(node=node, gpu=desc))
        return reply

    async def on_cmd(self, msg: Any) -> None:
        cmd = msgpack.unpackb(msg.data)["cmd"]
        op = cmd["op"]
        self.counts[op] = self.counts.get(op, 0) + 1
        if op == "info":
            await msg.respond(self.info_reply(msg.subject))
            return
        if op == "set_power_limit":
            self.limits.append((time.monotonic(), cmd.get("holder", ""), cmd["power_limit_w"]))
        await msg.respond(self._ok)

    async def start(self, url: str) -> Any:
        nc = await connect(url, "fake-agents")
        # A wildcard subscription (subjects.gpu_command would sanitise "*" as a user token).
        await nc.subscribe(subjects.all_gpu_commands(), cb=self.on_cmd)
        await confirm_subscriptions(nc)
        return nc



async def _teardown(reps: Any, server: Any, *clients: Any) -> None:
    """Close the bench's NATS clients, stop the replicas, then the server (always)."""
    for c in clients:
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()
    await asyncio.to_thread(reps.stop_all)
    await asyncio.to_thread(server.stop)

async def register(
    nc: Any, ranks: int, options: PowerLimitOptions = OPTIONS, first_node: int = 0
) -> tuple[str, str]:
    """Register a job of `ranks` ranks, each through its own node (from `first_node` on);
    returns the job id and its join token."""
    info = JobInfo(dp_degree=ranks, pp_degree=1, tp_degree=1, world_size=ranks)
    raw = await nc.request(subjects.coord_register_job(node_name(first_node)),
                           codec.encode(RegisterJob(job=info, power_limit=options)), timeout=10)
    reply = codec.decode(raw.data, Reply)
    if not reply.ok:
        raise RuntimeError(f"job not registered: {reply.code}: {reply.error}")
    job_id, token = str(reply.result["job_id"]), str(reply.result["join_token"])

    async def one(r: int) -> Reply:
        node, gpu = placement(r + first_node * GPUS_PER_NODE)
        request = RegisterRank(
            job_id=job_id,
            join_token=token,
            rank_info=RankInfo(rank=r, dp_rank=r, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 1500, 1200, 900, 600, 210]),
            gpu=GpuBinding(node=node, gpu_index=gpu, gpu_uuid=f"GPU-{node}-{gpu}"))
        msg = await nc.request(subjects.coord_register_rank(node), codec.encode(request),
                               timeout=60)
        return codec.decode(msg.data, Reply)

    replies = await asyncio.gather(*(one(r) for r in range(ranks)))
    failed = [r for r in replies if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} rank registrations failed, e.g. {failed[0].code}: "
                           f"{failed[0].error}")
    return job_id, token


async def owner_of(nc: Any, job_id: str) -> dict[str, Any]:
    """The job's ownership lease as recorded (`owner`, `until`), from the owners bucket."""
    _, owners_bucket = subjects.state_buckets()
    kv = await nc.jetstream().key_value(owners_bucket)
    return dict(json.loads((await kv.get(records.job_hash(job_id))).value))


# ---------------------------------------------------------------------------- part 1: ingest
class Ranks:
    """The simulated ranks: what their agents publish at each flush (pre-built subjects)."""

    def __init__(self, job_id: str, ranks: int, join_digest: str, columns: bool = False,
                 event_columns: bool = False) -> None:
        self.job_id = job_id
        self.columns = columns
        """Node batches in columns (`NodeColumnBatch`), not rows."""
        self.event_columns = event_columns
        """Trainer events in columns (`TrainerEventColumns`), not rows."""
        self.join_digest = join_digest
        """Sent with every batch, as the agent of a trainer whose HELLO had the token does."""
        self.ranks = ranks
        self.subjects = []
        for r in range(ranks):
            node, gpu = placement(r)
            self.subjects.append((node, gpu, subjects.job_events(job_id, r, node)))
        self.nodes: dict[str, list[int]] = {}
        """Each node's ranks, in order."""
        for r in range(ranks):
            self.nodes.setdefault(placement(r)[0], []).append(r)
        self.meas_subjects = {node: subjects.job_measurements(job_id, node) for node in self.nodes}
        # The job's events from a node none of its ranks is on: its owner (the only replica
        # following them) counts it as wrong_node; its measurements subject, bytes that are not
        # msgpack: malformed.
        self.sentinel_events = codec.encode({
            "v": 1, "job_id": job_id, "rank": 0, "node": SENTINEL_NODE, "gpu": 0,
            "events": [], "join_digest": join_digest})
        self.sentinel_events_subject = subjects.job_events(job_id, 0, SENTINEL_NODE)
        self.sentinel_meas_subject = subjects.job_measurements(job_id, SENTINEL_NODE)
        self.step_ns = 0
        self.t0_ns = time.monotonic_ns()

    def payloads(self, r: int, first: int, last: int, step_s: float
                 ) -> tuple[bytes, dict[str, Any]]:
        """Rank r's event batch and its GPU's part of the node's batch, steps first..last."""
        node, gpu = self.subjects[r][0], self.subjects[r][1]
        return step_batches(self.job_id, r, node, gpu, self.join_digest, first, last, step_s,
                            self.t0_ns, 250.0 + (r % 7), self.event_columns)


def sentinels(health: dict[str, Any] | None) -> tuple[int, int]:
    """(events, measurements) sentinels a replica has processed, from its `/healthz`."""
    dropped = (health or {}).get("dropped", {})
    return int(dropped.get("wrong_node", 0)), int(dropped.get("malformed", 0))


@dataclass
class Published:
    """What `publish_level` sent: steps up to `step`, when it began and when it was flushed."""

    step: int
    items: int
    """Events: trainer events + marks + measurements."""
    messages: int
    late_ticks: int
    t_start: float
    t_published: float


async def publish_level(nc: Any, sim: Ranks, rate: float, tick_hz: float, duration_s: float,
                        first_step: int, published: list[int]) -> Published:
    """Publish every rank's steps at `rate`, flushed `tick_hz` times a second, with sentinels."""
    step_s = 1.0 / rate
    t_start = time.monotonic()
    step = first_step - 1  # last step published
    items = messages = 0
    late_ticks = 0
    tick = 0
    while True:
        due = t_start + tick / tick_hz
        now_t = time.monotonic()
        if due > t_start + duration_s:
            break
        if due > now_t:
            await asyncio.sleep(due - now_t)
        elif now_t - due > 1.0 / tick_hz:
            late_ticks += 1
        target = first_step + int((due - t_start) * rate)
        if target > step:
            first = step + 1
            n_steps = target - step
            for node, node_ranks in sim.nodes.items():
                parts = []
                for r in node_ranks:
                    ev, part = sim.payloads(r, first, target, step_s)
                    await nc.publish(sim.subjects[r][2], ev)
                    parts.append(part)
                await nc.publish(sim.meas_subjects[node], node_batch(sim.job_id, node, parts,
                                                                        sim.columns))
            messages += sim.ranks + len(sim.nodes)
            items += 4 * n_steps * sim.ranks - (sim.ranks * 2 if first == 0 else 0)
            step = target
            await nc.publish(sim.sentinel_events_subject, sim.sentinel_events)
            await nc.publish(sim.sentinel_meas_subject, b"\xc1 not msgpack")
            published[0] += 1
            published[1] += 1
        tick += 1
    await nc.flush()
    return Published(step, items, messages, late_ticks, t_start, time.monotonic())


async def wait_processed(reps: Replicas, published: list[int], timeout_s: float
                         ) -> dict[str, float]:
    """When each replica saw every sentinel counted (absent: not by `timeout_s`)."""
    names = reps.names
    done_at: dict[str, float] = {}

    async def all_done() -> bool:
        seen = {n: sentinels(await asyncio.to_thread(reps.health, n)) for n in names}
        # Each sentinel reaches the job's owner at the time only (the job may be handed over to
        # its preferred replica meanwhile): all of them counted, summed.
        done = (sum(s[0] for s in seen.values()) >= published[0]
                and sum(s[1] for s in seen.values()) >= published[1])
        for name in names:
            if name not in done_at and done:
                done_at[name] = time.monotonic()
        return len(done_at) == len(names)

    await wait_for_async(all_done, timeout_s, fail=False)
    return done_at


async def ingest_level(nc: Any, sim: Ranks, reps: Replicas, owner: str, rate: float,
                       duration_s: float, flush_hz: float, first_step: int,
                       published: list[int], extra_pids: dict[str, int]) -> dict[str, Any]:
    """Publish at `rate` steps/s per rank for `duration_s`; measure until the owner has it all.

    `published` holds the sentinels published so far on each stream (updated).
    """
    tick_hz = min(rate, flush_hz)
    names = reps.names
    pids = {**{n: reps.pid(n) for n in names}, **extra_pids}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    pub = await publish_level(nc, sim, rate, tick_hz, duration_s, first_step, published)
    t_start, t_published, items, messages = pub.t_start, pub.t_published, pub.items, pub.messages
    # Until every replica has processed everything (the owner's time is the figure). Past the
    # timeout, what is missing shows in the figures (a replica not done: now).
    done_at = await wait_processed(reps, published, max(60.0, 4 * duration_s))
    owner = str((await owner_of(nc, sim.job_id))["owner"])  # (Handed over meanwhile?)
    t_end = done_at.get(owner, time.monotonic())
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu["harness"] = self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime
    span = t_end - t_start
    others = [n for n in names if n != owner]
    per_k = 1000.0 / items if items else 0.0
    return {
        "rate_steps_per_s_per_rank": rate,
        "owner": owner,
        "flushes_per_s": tick_hz,
        "steps": pub.step - first_step + 1,
        "events": items,
        "messages": messages,
        "offered_events_per_s": round(4 * rate * sim.ranks),
        "offered_messages_per_s": round(tick_hz * (sim.ranks + len(sim.nodes))),
        "published_events_per_s": round(items / (t_published - t_start)),
        "published_messages_per_s": round(messages / (t_published - t_start)),
        "late_flushes": pub.late_ticks,
        "events_per_s": round(items / span) if owner in done_at else None,
        "messages_per_s": round(messages / span) if owner in done_at else None,
        "drain_s": round(t_end - t_published, 3) if owner in done_at else None,
        "others_drain_s": {n: round(done_at[n] - t_published, 3) if n in done_at else None
                           for n in others},
        "keeps_up": owner in done_at and t_end - t_published <= KEEPS_UP_S,
        "cpu_ms_per_1000_events": {
            "owner": round(cpu[owner] * 1000 * per_k, 3),
            **{f"other:{n}": round(cpu[n] * 1000 * per_k, 3) for n in others},
            **{k: round(cpu[k] * 1000 * per_k, 3) for k in (*extra_pids, "harness")},
        },
        "cpu_cores": {k: round(v / span, 3) for k, v in cpu.items()},
        "load": load(),
    }


async def ingest(args: argparse.Namespace, jetstream_sync: str = "always") -> dict[str, Any]:
    """Part 1: register 1,024 ranks, then each offered rate in turn."""
    names = [f"r{i + 1}" for i in range(args.replicas)]
    with tempfile.TemporaryDirectory(prefix="zeus-ingest-") as tmp:
        root = Path(tmp)
        server = EmbeddedNats(store_dir=str(root / "js"), jetstream_sync=jetstream_sync)
        await asyncio.to_thread(server.start)
        reps = Replicas(server.url, root, names, ["--command-timeout-s", "10"])
        agents_nc = nc = None
        try:
            reps.start_all()
            await asyncio.to_thread(reps.wait_healthy, 60)
            agents = FakeAgents()
            agents_nc = await agents.start(server.url)
            nc = await connect(server.url, "simulated-agents")
            t = time.monotonic()
            job_id, token = await register(nc, args.ranks)
            registered_s = time.monotonic() - t
            owner = (await owner_of(nc, job_id))["owner"]
            # The optimiser starts once every rank is in: its first limit reaches every GPU.
            await wait_for_async(
                lambda: agents.counts.get("set_power_limit", 0) >= args.ranks, 30,
                lambda: "the job's first power limit did not reach every GPU")
            sim = Ranks(job_id, args.ranks, join_token_digest(token), args.layout == "columns",
                        args.event_layout == "columns")
            nats_pid = server._proc.pid if server._proc is not None else 0  # noqa: SLF001
            published = [0, 0]
            levels = []
            step = 0
            for rate in args.rates:
                level = await ingest_level(nc, sim, reps, owner, rate, args.duration,
                                           args.flush_hz, step, published,
                                           {"nats-server": nats_pid})
                step += level["steps"]
                levels.append(level)
                c = level["cpu_ms_per_1000_events"]
                print(f"ingest {rate:g} steps/s/rank: offered {level['offered_events_per_s']} "
                      f"events/s ({level['offered_messages_per_s']} msg/s), published "
                      f"{level['published_events_per_s']}/s, owner processed "
                      f"{level['events_per_s']}/s, drained {level['drain_s']} s after the last "
                      f"publish ({'keeps up' if level['keeps_up'] else 'FALLS BEHIND'}); CPU ms "
                      f"per 1000 events: {c}; load {level['load']}", flush=True)
            query = await nc.request(subjects.coord_job_query(),
                                     codec.encode({"v": 1, "job_id": job_id}), timeout=10)
            progress = codec.decode(query.data, Reply).result.get("power_limit") or {}
            healths = {n: reps.health(n) for n in names}
        except BaseException:
            reps.print_logs()
            raise
        finally:
            await _teardown(reps, server, nc, agents_nc)
    sustained = [lv for lv in levels if lv["keeps_up"]]
    best = max(sustained, key=lambda lv: lv["events_per_s"] or 0) if sustained else None
    peak = max((lv for lv in levels if lv["events_per_s"]), key=lambda lv: lv["events_per_s"],
               default=None)
    return {
        "ranks": args.ranks,
        "layout": args.layout,
        "event_layout": args.event_layout,
        "registered_s": round(registered_s, 3),
        "owner": owner,
        "sustained_events_per_s": best["events_per_s"] if best else None,
        "sustained_messages_per_s": best["messages_per_s"] if best else None,
        "sustained_rate_steps_per_s_per_rank": best["rate_steps_per_s_per_rank"] if best else None,
        "cpu_ms_per_1000_events_at_sustained": best["cpu_ms_per_1000_events"] if best else None,
        "peak_events_per_s": peak["events_per_s"] if peak else None,
        "windows_measured": progress.get("measured"),
        "power_limit_phase": progress.get("phase"),
        "set_power_limit_commands": agents.counts.get("set_power_limit", 0),
        "dropped": {n: (h or {}).get("dropped") for n, h in healths.items()},
        "levels": levels,
    }


# ---------------------------------------------------------------------------- part 2: takeover
async def takeover_trial(lease_s: float, trial: int, ranks: int) -> dict[str, Any]:
    """Kill a job's owning replica; time until another takes it over and drives it."""
    names = [f"t{trial}a", f"t{trial}b"]
    with tempfile.TemporaryDirectory(prefix="zeus-takeover-") as tmp:
        root = Path(tmp)
        server = EmbeddedNats(store_dir=str(root / "js"))
        await asyncio.to_thread(server.start)
        reps = Replicas(server.url, root, names,
                        ["--ownership-lease-s", f"{lease_s:g}", "--command-timeout-s", "5"])
        agents_nc = nc = None
        try:
            reps.start_all()
            await asyncio.to_thread(reps.wait_healthy, 60)
            agents = FakeAgents()
            agents_nc = await agents.start(server.url)
            nc = await connect(server.url, "takeover-observer")
            statuses: list[tuple[float, str, str, str]] = []

            async def on_status(msg: Any) -> None:
                with contextlib.suppress(Exception):
                    s = codec.decode(msg.data, JobStatus)
                    statuses.append((time.monotonic(), s.job_id, s.state, s.message))

            await nc.subscribe(subjects.all_job_status(), cb=on_status)
            await confirm_subscriptions(nc)
            job_id, _token = await register(nc, ranks)

            async def seen(what: str, found: Callable[[], float | None],
                           timeout_s: float) -> float:
                """When `found` was received (its own time: the poll's period adds nothing)."""
                t: float = await wait_for_async(
                    found, timeout_s, lambda: f"{what} not seen within {timeout_s:g} s",
                    interval_s=0.01)
                return t

            await seen("the job's first power limit", lambda: next(
                (t for t, h, _ in agents.limits if h == job_id), None), 30)
            lease = await owner_of(nc, job_id)
            owner = str(lease["owner"])
            survivor = next(n for n in names if n != owner)
            # Kill at a random point of the owner's renewal cycle (every lease / 3).
            await asyncio.sleep(random.uniform(0.2, 0.2 + lease_s / 3))
            lease = await owner_of(nc, job_id)
            lease_left = float(lease["until"]) - time.time()
            t_kill = time.monotonic()
            reps.kill(owner, signal.SIGKILL)
            timeout = 3 * lease_s + 15
            t_taken = await seen("taken_over", lambda: next(
                (t for t, j, s, _ in statuses if j == job_id and s == "taken_over"
                 and t > t_kill), None), timeout)
            t_cmd = await seen("a power-limit command after the takeover", lambda: next(
                (t for t, h, _ in agents.limits if h == job_id and t > t_kill), None), timeout)
            new_owner = str((await owner_of(nc, job_id))["owner"])
        except BaseException:
            reps.print_logs()
            raise
        finally:
            await _teardown(reps, server, nc, agents_nc)
    return {"lease_s": lease_s, "taken_over_s": round(t_taken - t_kill, 3),
            "first_command_s": round(t_cmd - t_kill, 3), "lease_left_s": round(lease_left, 3),
            "killed": owner, "new_owner": new_owner, "expected": new_owner == survivor,
            "load": load()}


async def takeovers(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: `--trials` takeovers for each lease of `--leases`."""
    out: dict[str, Any] = {}
    for lease_s in args.leases:
        trials = []
        for i in range(args.trials):
            t = await takeover_trial(lease_s, i + 1, args.takeover_ranks)
            trials.append(t)
            print(f"takeover, lease {lease_s:g} s, trial {i + 1}: taken over "
                  f"{t['taken_over_s']:.2f} s after SIGKILL of the owner (lease left at the "
                  f"kill {t['lease_left_s']:.2f} s), first command {t['first_command_s']:.2f} s "
                  f"after; load {t['load']}", flush=True)
        out[f"{lease_s:g}"] = {
            "taken_over_s": spread([t["taken_over_s"] for t in trials], 3),
            "first_command_s": spread([t["first_command_s"] for t in trials], 3),
            "expected_s": [round(2 * lease_s / 3, 3), round(4 * lease_s / 3, 3)],
            "trials": trials,
        }
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    result: dict[str, Any] = {"bench": "coordinator_ingest", "replicas": args.replicas,
                              "replica_processes": True, "durable": True,
                              "flush_hz": args.flush_hz, "duration_s": args.duration}
    if not args.skip_ingest:
        # Each JetStream sync setting in turn, on a fresh server and replicas: the headline
        # figures are the first's.
        by_sync = {sync: await ingest(args, sync) for sync in args.jetstream_sync}
        result["ingest"] = by_sync[args.jetstream_sync[0]]
        result["jetstream_sync"] = args.jetstream_sync[0]
        result["sustained_events_per_s_by_jetstream_sync"] = {
            sync: r["sustained_events_per_s"] for sync, r in by_sync.items()}
    if len(args.replica_counts) > 1:
        result["scan"] = await scan_replicas(args)
        result["events_per_s_by_replicas"] = result["scan"]["events_per_s_by_replicas"]
    if args.trials > 0 and args.leases:
        result["takeover"] = await takeovers(args)
    result.update(machine=machine(), load_before=load_before, load=load(), date=now())
    return result


async def scan_replicas(args: argparse.Namespace) -> dict[str, Any]:
    """Many jobs on each replica count of `--replicas` (`_ingest_replicas.scan`)."""
    per_job = args.ranks // args.jobs

    async def publish(nc: Any, jobs: list[tuple[str, str, int, int]], first: int, last: int,
                      step_s: float) -> int:
        t0_ns, sent = 0, 0
        for job_id, digest, ranks, first_node in jobs:
            for n in range(first_node, first_node + (ranks + GPUS_PER_NODE - 1) // GPUS_PER_NODE):
                node, parts = node_name(n), []
                for gpu in range(min(GPUS_PER_NODE, ranks - (n - first_node) * GPUS_PER_NODE)):
                    r = (n - first_node) * GPUS_PER_NODE + gpu
                    ev, part = step_batches(job_id, r, node, gpu, digest, first, last, step_s,
                                            t0_ns, 250.0 + (r % 7),
                                            args.event_layout == "columns")
                    await nc.publish(subjects.job_events(job_id, r, node), ev)
                    parts.append(part)
                await nc.publish(subjects.job_measurements(job_id, node),
                                 node_batch(job_id, node, parts, args.layout == "columns"))
                sent += len(parts) + 1
        return sent

    async def owners_of(nc: Any, job_ids: list[str]) -> dict[str, str]:
        return {j: str((await owner_of(nc, j))["owner"]) for j in job_ids}

    def sentinel(job_id: str) -> tuple[str, bytes]:
        return subjects.job_events(job_id, 0, SENTINEL_NODE), codec.encode({
            "v": 1, "job_id": job_id, "rank": 0, "node": SENTINEL_NODE, "gpu": 0, "events": []})

    async def fake_agents(url: str) -> Any:
        return await FakeAgents().start(url)

    async def register_at(nc: Any, ranks: int, first_node: int) -> tuple[str, str]:
        return await register(nc, ranks, OPTIONS, first_node)

    return await ingest_scan(
        args.replica_counts, jobs=args.jobs, ranks=per_job * args.jobs, rate=args.scan_rate,
        duration_s=args.duration, flush_hz=args.flush_hz, register=register_at,
        publish=publish, owners_of=owners_of, sentinel=sentinel, fake_agents=fake_agents,
        settle_s=60.0, replica_args=["--ownership-lease-s", "3"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024,
                        help="simulated ranks, 8 per node (default 1024)")
    parser.add_argument("--replicas", type=lambda v: [int(x) for x in v.split(",")],
                        default=[2], dest="replica_counts", metavar="N[,N...]",
                        help="coordinator replicas for the ingest of one job, one process each "
                        "(default 2; with a list, e.g. 1,2,4: the one-job ingest runs with 2 if "
                        "listed, and --jobs jobs are ingested on each count in turn, printing "
                        "events_per_s_by_replicas)")
    parser.add_argument("--jobs", type=int, default=64,
                        help="jobs of the replica scan, --ranks shared among them (default 64)")
    parser.add_argument("--scan-rate", type=float, default=20.0,
                        help="steps per second per rank in the replica scan (default 20)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=[1.0, 2.0, 5.0, 10.0, 20.0],
                        help="offered rates, steps per second per rank, comma-separated "
                        "(default 1,2,5,10,20)")
    parser.add_argument("--duration", type=float, default=15.0,
                        help="seconds of publishing per rate (default 15)")
    parser.add_argument("--flush-hz", type=float, default=10.0,
                        help="most batches per second per rank and stream, as an agent "
                        "flushes (default 10)")
    parser.add_argument("--leases", type=lambda s: [float(x) for x in s.split(",")],
                        default=[3.0, 10.0],
                        help="ownership leases to time takeovers with, s (default 3,10)")
    parser.add_argument("--trials", type=int, default=3,
                        help="takeovers per lease (default 3; 0: none)")
    parser.add_argument("--takeover-ranks", type=int, default=8,
                        help="ranks of the job taken over (default 8)")
    parser.add_argument("--skip-ingest", action="store_true", help="only time takeovers")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill times")
    parser.add_argument("--quick", action="store_true",
                        help="one rate (5 steps/s/rank) for 8 s, one takeover with a 3 s lease "
                        "(under 60 s)")
    parser.add_argument("--layout", choices=["rows", "columns"], default="rows",
                        help="the node batches' layout: rows (`NodeMeasurementBatch`, what "
                        "older agents and coordinators speak) or columns (`NodeColumnBatch`, "
                        "what agents send to coordinators that read them: "
                        "--measurement-columns auto)")
    parser.add_argument("--event-layout", choices=["rows", "columns"], default=None,
                        help="the trainer events' layout: rows (`TrainerEventBatch`) or "
                        "columns (`TrainerEventColumns`); default: --layout's")
    parser.add_argument("--jetstream-sync", type=jetstream_syncs, default=["always"],
                        metavar="SYNC[,SYNC]",
                        help="JetStream sync_interval(s) of the ingest's nats-server: 'always' "
                        "(the project's default) and/or a duration ('2m', nats-server's "
                        "default); with two, the ingest runs once with each")
    args = parser.parse_args()
    args.event_layout = args.event_layout or args.layout
    args.replicas = 2 if 2 in args.replica_counts else args.replica_counts[0]
    if args.quick:
        args.rates, args.duration, args.leases, args.trials = [5.0], 8.0, [3.0], 1
    random.seed(args.seed)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        result = uvloop.run(bench(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(bench(args))
    ing = result.get("ingest")
    if ing:
        print(f"{ing['ranks']} ranks, {args.replicas} replicas: sustained "
              f"{ing['sustained_events_per_s']} events/s end to end (at "
              f"{ing['sustained_rate_steps_per_s_per_rank']} steps/s/rank), peak "
              f"{ing['peak_events_per_s']}/s; owner CPU ms per 1000 events at the sustained rate "
              f"{ing['cpu_ms_per_1000_events_at_sustained']}")
    for lease, t in result.get("takeover", {}).items():
        print(f"takeover with a {lease} s lease: median {t['taken_over_s']['median']} s "
              f"(min {t['taken_over_s']['min']}, max {t['taken_over_s']['max']}), first command "
              f"median {t['first_command_s']['median']} s")
    print(f"load {result['load_before']} -> {result['load']} on {os.cpu_count()} cpu",
          file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
