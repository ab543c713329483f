"""A fleet of fake agents and trainers for the scale benchmarks: message load, no GPU physics.

Shared pieces:

* `step_batches(...)`: what a rank's agent publishes for some training steps (a
  `TrainerEventBatch`, msgpack, and the rank's GPU's part of its node's `NodeMeasurementBatch`),
  and `node_batch(...)`, that batch of the node's parts, as `coordinator_ingest.py` drives the
  power-limit optimiser with;
* `GPU_DESCRIPTION`: the fake GPU (an A40, 100-300 W) every fake agent describes;
* `Fleet`: one asyncio process standing in for the agents of a block of nodes (`worker`).

A fleet worker (`python bench/_fleet.py --url ... --index i --first-node a --nodes n`) is, for
its nodes: every GPU's command responder (`<p>.gpu.<node>.*.cmd`, one subscription per node:
`info` answered, everything else acknowledged and counted), a listener of lease renewals
(`<p>.lease.<job>` once per node of each job, as each real agent follows the holders of its
leases: the count is the deliveries real agents would get), the agents' heartbeats (an
`AgentHello` per node every `--hello-s`) and samples (a `SampleBatch` of 10 samples per GPU
and a `NodePower` per node every `--sample-s`; 0: none), and the trainers of the jobs placed
on them: their rank registrations (through each node's subject, with the GPU's description as
agents relay it) and a step every `--step-s` (one event batch per rank and one measurement
batch per node and job per step, as an agent flushing once per step). Publishing is spread
over 0.1 s ticks.

It is driven by JSON requests on `bench.fleet.<index>.ctl`: `ping`, `register` (jobs as
`[job_id, join_token, first_node, nodes]`: whole nodes; it registers the ranks on its own
nodes, then steps them), `end` (its trainers of these jobs stop: the job goes idle and the
coordinator removes it after `--max-job-idle-time`), `stats` (what it published and received,
its CPU and RSS), `quit`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.models import RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.event_columns import EVENT_KINDS
from zeus_agent.wire.messages import (
    AgentHello,
    GpuBinding,
    GpuDescription,
    RegisterRank,
    Reply,
    SampleBatch,
    join_token_digest,
)
from zeus_agent.wire.node_columns import MARK_KINDS, MEASUREMENT_KINDS
from zeus_agent.wire.node_power import NodePower

GPU_DESCRIPTION = GpuDescription(
    index=0, uuid="GPU-x", name="NVIDIA A40", architecture="Ampere",
    min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
    supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
    has_energy_counter=True, power_limit_w=300,
)
FREQUENCIES = [1740, 1500, 1200, 900, 600, 210]
TICK_S = 0.1
RANK_TRIES = 4
"""A rank registration answered `unavailable` (retry), or not answered, is sent again."""
RANK_TIMEOUT_S = 120.0
CONTROL = "bench.fleet"


def control_subject(index: int) -> str:
    """The subject a fleet worker takes its requests on."""
    return f"{CONTROL}.{index}.ctl"


def node_name(n: int) -> str:
    return f"node{n:05d}"


def step_batches(job_id: str, rank: int, node: str, gpu: int, digest: str, first: int,
                 last: int, step_s: float, t0_ns: int, watts: float,
                 event_columns: bool = False) -> tuple[bytes, dict[str, Any]]:
    """A rank's event batch and its GPU's part of the node's measurement batch, for steps
    first..last (inclusive).

    Per step: step_end of the previous one and step_begin (events), the step_begin mark (time
    and energy counter) and the previous step's measurement (time, energy), at `t0_ns` +
    step x `step_s`. `event_columns`: the events as a `TrainerEventColumns`.
    """
    step_ns = int(step_s * 1e9)
    kinds, stamps, steps, marks, meas = [], [], [], [], []
    for s in range(first, last + 1):
        t = t0_ns + s * step_ns
        if s > 0:
            kinds.append("step_end")
            stamps.append(t - 1000)
            steps.append(s - 1)
            meas.append({"kind": "step", "name": "step", "epoch": 0, "step": s - 1,
                         "index": 0, "t0_ns": t - step_ns, "t1_ns": t - 1000,
                         "time_s": step_s, "energy_j": watts * step_s, "schedule": None})
        kinds.append("step_begin")
        stamps.append(t)
        steps.append(s)
        marks.append({"kind": "step_begin", "epoch": 0, "step": s, "t_ns": t,
                      "energy_j": watts * step_s * s, "power_limit_w": None})
    header = {"v": 1, "job_id": job_id, "rank": rank, "node": node, "gpu": gpu,
              "join_digest": digest}
    body = (event_column_fields(kinds, stamps, steps) if event_columns else {"events": [
        {"kind": k, "t_ns": t, "epoch": 0, "step": s, "index": 0, "name": ""}
        for k, t, s in zip(kinds, stamps, steps, strict=True)]})
    ev = msgpack.packb({**header, **body}, use_bin_type=True)
    part = {"gpu": gpu, "rank": rank, "marks": marks, "measurements": meas,
            "join_digest": digest}
    return ev, part


_EVENT_KIND = {kind: i for i, kind in enumerate(EVENT_KINDS)}


def event_column_fields(kinds: list[str], stamps: list[int], steps: list[int]
                        ) -> dict[str, Any]:
    """`step_batches`' events as the arrays of a `TrainerEventColumns` (epoch, index 0, no name).

    Built as directly as the rows' maps are (the harness shares the 2 cores with the replicas).
    """
    n = len(kinds)
    return {"columns": 1, "kind": [_EVENT_KIND[k] for k in kinds], "t_ns": stamps,
            "epoch": [0] * n, "step": steps, "index": [0] * n, "name": [0] * n,
            "power_limit_w": [None] * n, "names": [""]}


def node_batch(job_id: str, node: str, parts: list[dict[str, Any]],
               columns: bool = False) -> bytes:
    """A node's `NodeMeasurementBatch` of one job (msgpack), from its GPUs' parts.

    `columns`: the same batch as a `NodeColumnBatch`.
    """
    if columns:
        return msgpack.packb(column_batch(job_id, node, parts), use_bin_type=True)
    return msgpack.packb({"v": 1, "node": node, "job_id": job_id, "gpus": parts},
                         use_bin_type=True)


MARK_FIELDS = ("epoch", "step", "t_ns", "energy_j", "power_limit_w")
MEASUREMENT_FIELDS = ("epoch", "step", "index", "t0_ns", "t1_ns", "time_s", "energy_j",
                      "schedule")


def column_batch(job_id: str, node: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """`step_batches`' parts as a `NodeColumnBatch` (plain data, as an agent would pack it)."""
    marks = [m for p in parts for m in p["marks"]]
    meas = [m for p in parts for m in p["measurements"]]
    names: dict[str, int] = {}
    mark_cols = {f: [m[f] for m in marks] for f in MARK_FIELDS}
    mark_cols["kind"] = [MARK_KINDS.index(m["kind"]) for m in marks]
    meas_cols = {f: [m[f] for m in meas] for f in MEASUREMENT_FIELDS}
    meas_cols["kind"] = [MEASUREMENT_KINDS.index(m["kind"]) for m in meas]
    meas_cols["name"] = [names.setdefault(m["name"], len(names)) for m in meas]
    return {"v": 1, "columns": 1, "node": node, "job_id": job_id,
            "gpu": [p["gpu"] for p in parts], "rank": [p["rank"] for p in parts],
            "join_digest": [p["join_digest"] for p in parts],
            "mark_count": [len(p["marks"]) for p in parts],
            "measurement_count": [len(p["measurements"]) for p in parts],
            "names": list(names), "marks": mark_cols, "measurements": meas_cols}


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` (MB; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class LocalJob:
    """A job's ranks on this worker's nodes, and their progress."""

    job_id: str
    digest: str
    ranks: list[tuple[int, str, int]]  # (rank, node, gpu)
    step_s: float
    next_due: float
    step: int = 0
    t0_ns: int = field(default_factory=time.monotonic_ns)


class Fleet:
    """The fake agents and trainers of nodes first_node .. first_node + nodes - 1."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prefix = subjects.DEFAULT_PREFIX
        self.nodes = [node_name(n) for n in range(args.first_node, args.first_node + args.nodes)]
        self.gpn = args.gpus_per_node
        self.nc: Any = None
        self.jobs: dict[str, LocalJob] = {}
        self.published: dict[str, int] = {"hello": 0, "sample": 0, "power": 0, "events": 0,
                                           "meas": 0}
        self.commands: dict[str, int] = {}
        self.renewals = 0
        self.renewal_subs: dict[str, list[Any]] = {}
        """Job -> one subscription to its lease renewals per node of it here."""
        self.limited: set[str] = set()
        self.quit = asyncio.Event()
        self._tasks: set[asyncio.Future[None]] = set()
        self._ok = codec.encode(Reply.success())
        self._info: dict[str, bytes] = {}
        self._hellos = [self._hello(node) for node in self.nodes]
        self._samples = [(subjects.gpu_samples(node, g, self.prefix), self._sample(node, g))
                         for node in self.nodes for g in range(self.gpn)]
        self._powers = [(subjects.agent_power(node, self.prefix), codec.encode(NodePower(
            node=node, gpus=list(range(self.gpn)), power_w=[250.0] * self.gpn)))
            for node in self.nodes]

    def _desc(self, node: str, gpu: int) -> GpuDescription:
        return GPU_DESCRIPTION.model_copy(update={"index": gpu, "uuid": f"GPU-{node}-{gpu}"})

    def _hello(self, node: str) -> tuple[str, bytes]:
        hello = AgentHello(node=node, agent_id=f"fake-{node}", backend="fake",
                           heartbeat_s=self.args.hello_s, socket_path="/nonexistent",
                           gpus=[self._desc(node, g) for g in range(self.gpn)])
        return subjects.agent_hello(node, self.prefix), codec.encode(hello)

    def _sample(self, node: str, gpu: int) -> bytes:
        t = time.time_ns()
        samples = [{"t_ns": t + i * 100_000_000, "energy_j": 1000.0 + 25 * i, "power_w": 250.0,
                    "power_limit_w": 300, "sm_clock_mhz": 1740, "memory_clock_mhz": 7251}
                   for i in range(10)]
        return codec.encode(SampleBatch.model_validate(
            {"node": node, "gpu": gpu, "uuid": f"GPU-{node}-{gpu}", "samples": samples}))

    # ------------------------------------------------------------------ the agents' side
    async def on_cmd(self, msg: Any) -> None:
        cmd = msgpack.unpackb(msg.data)["cmd"]
        op = str(cmd["op"])
        self.commands[op] = self.commands.get(op, 0) + 1
        if op == "info":
            reply = self._info.get(msg.subject)
            if reply is None:
                parts = msg.subject.split(".")  # <p>.gpu.<node>.<gpu>.cmd
                desc = self._desc(parts[-3], int(parts[-2]))
                reply = self._info[msg.subject] = codec.encode(
                    Reply.success(node=parts[-3], gpu=desc.model_dump()))
            await msg.respond(reply)
            return
        if op == "set_power_limit":
            self.limited.add(msg.subject)
        if msg.reply:
            await msg.respond(self._ok)

    async def on_renewal(self, msg: Any) -> None:
        self.renewals += 1

    async def spread(self, items: list[tuple[str, bytes]], period_s: float, kind: str) -> None:
        """Publish every item once per `period_s`, a slice every tick."""
        if period_s <= 0 or not items:
            return
        per_tick = len(items) * TICK_S / period_s
        cursor, owed = 0, 0.0
        next_t = time.monotonic()
        while not self.quit.is_set():
            owed += per_tick
            n = int(owed)
            owed -= n
            for _ in range(n):
                subject, payload = items[cursor]
                await self.nc.publish(subject, payload)
                cursor = (cursor + 1) % len(items)
            self.published[kind] += n
            next_t += TICK_S
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))

    # ------------------------------------------------------------------ the trainers' side
    async def steps(self) -> None:
        """Every job's ranks take a step when due (all of a job's local ranks at once)."""
        while not self.quit.is_set():
            now = time.monotonic()
            for job in [j for j in self.jobs.values() if j.next_due <= now]:
                s = job.step
                parts: dict[str, list[dict[str, Any]]] = {}
                for i, (rank, node, gpu) in enumerate(job.ranks):
                    ev, part = step_batches(job.job_id, rank, node, gpu, job.digest, s, s,
                                            job.step_s, job.t0_ns, 250.0 + rank % 7)
                    await self.nc.publish(subjects.job_events(job.job_id, rank, node), ev)
                    parts.setdefault(node, []).append(part)
                    if i % 512 == 511:
                        await asyncio.sleep(0)
                for node, node_parts in parts.items():  # One batch per node, as agents send.
                    await self.nc.publish(subjects.job_measurements(job.job_id, node),
                                          node_batch(job.job_id, node, node_parts))
                self.published["events"] += len(job.ranks)
                self.published["meas"] += len(parts)
                job.step += 1
                job.next_due += job.step_s
            await asyncio.sleep(TICK_S)

    async def register(self, jobs: list[list[Any]], window: int) -> dict[str, Any]:
        """Register this worker's ranks of `jobs` (at most `window` outstanding); each job steps
        once its ranks here are in (a trainer steps once registered: waiting for the whole
        fleet, a job registered early was silent for the burst and collected as idle)."""
        t0 = time.monotonic()
        mine = set(self.nodes)
        sem = asyncio.Semaphore(window)
        failures: list[str] = []
        failed: set[tuple[str, int]] = set()  # (job, rank): its trainer does not step
        retries: dict[str, int] = {}
        todo: list[tuple[str, str, int, str, int]] = []
        for job_id, token, first_node, nodes in jobs:
            for n in range(first_node, first_node + nodes):
                node = node_name(n)
                if node in mine:
                    todo += [(job_id, token, (n - first_node) * self.gpn + g, node, g)
                             for g in range(self.gpn)]

        async def one(job_id: str, token: str, rank: int, node: str, gpu: int) -> None:
            request = RegisterRank(
                job_id=job_id, join_token=token,
                rank_info=RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                                   available_frequencies=FREQUENCIES),
                gpu=GpuBinding(node=node, gpu_index=gpu, gpu_uuid=f"GPU-{node}-{gpu}"),
                gpu_info=self._desc(node, gpu))
            payload = codec.encode(request)
            for attempt in range(RANK_TRIES):
                async with sem:
                    try:
                        msg = await self.nc.request(subjects.coord_register_rank(node),
                                                    payload, timeout=RANK_TIMEOUT_S)
                        reply = codec.decode(msg.data, Reply)
                        why = None if reply.ok else f"{reply.code}: {reply.error}"
                        again = reply.code == "unavailable"  # the reply says: retry
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        why, again = repr(e), True
                if why is None:
                    return
                if not again or attempt == RANK_TRIES - 1:
                    failures.append(why)
                    failed.add((job_id, rank))
                    return
                retries[why[:120]] = retries.get(why[:120], 0) + 1
                await asyncio.sleep(0.5 * 2 ** attempt)

        async def job(index: int, job_id: str, token: str) -> None:
            """Its ranks here registered, the job steps (as trainers do once registered)."""
            mine = by_job.get(job_id, [])
            renewals = subjects.lease_renewal(job_id, self.prefix)
            self.renewal_subs[job_id] = [await self.nc.subscribe(renewals, cb=self.on_renewal)
                                         for _node in sorted({t[3] for t in mine})]
            await asyncio.gather(*(one(*t) for t in mine))
            ranks = [(r, node, g) for _j, _t, r, node, g in mine if (job_id, r) not in failed]
            if ranks:  # each job its own phase within the step
                phase = (index * 0.37) % 1.0
                self.jobs[job_id] = LocalJob(job_id, join_token_digest(token), ranks,
                                             self.args.step_s,
                                             time.monotonic() + phase * self.args.step_s)

        by_job: dict[str, list[tuple[str, str, int, str, int]]] = {}
        for t in todo:
            by_job.setdefault(t[0], []).append(t)
        await asyncio.gather(*(job(i, job_id, token)
                               for i, (job_id, token, _first, _nodes) in enumerate(jobs)))
        return {"registered": len(todo) - len(failures), "failed": len(failures),
                "error": failures[0] if failures else None, "retries": retries,
                "seconds": round(time.monotonic() - t0, 3)}

    # ------------------------------------------------------------------ control
    def stats(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        base = subjects.gpu_command("x", 0).split(".gpu.")[0]
        missing = {j.job_id: n for j in self.jobs.values()
                   if (n := sum(f"{base}.gpu.{node}.{g}.cmd" not in self.limited
                                for _r, node, g in j.ranks))}
        return {"published": dict(self.published), "commands": dict(self.commands),
                "without_limit": dict(list(missing.items())[:10]),
                "renewals": self.renewals, "gpus_limited": len(self.limited),
                "jobs": len(self.jobs), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
                "rss_mb": round(rss_mb(os.getpid()), 1)}

    async def on_ctl_soon(self, msg: Any) -> None:
        task = asyncio.ensure_future(self.on_ctl(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_ctl(self, msg: Any) -> None:
        req = json.loads(msg.data)
        op = req.get("op")
        out: dict[str, Any] = {"ok": True}
        if op == "ping":
            out["pid"] = os.getpid()
        elif op == "register":
            out.update(await self.register(req["jobs"], int(req.get("window", 2000))))
        elif op == "end":
            for job_id in req["job_ids"]:
                self.jobs.pop(job_id, None)
                for sub in self.renewal_subs.pop(job_id, []):
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
        elif op == "stats":
            out.update(self.stats())
        elif op == "quit":
            self.quit.set()
        else:
            out = {"ok": False, "error": f"unknown op {op!r}"}
        await msg.respond(json.dumps(out).encode())

    async def run(self) -> None:
        self.nc = await connect(self.args.url, f"fleet-{self.args.index}",
                                pending_size=256 * 1024 * 1024)
        base = subjects.gpu_command("x", 0).split(".gpu.")[0]
        for node in self.nodes:
            await self.nc.subscribe(f"{base}.gpu.{node}.*.cmd", cb=self.on_cmd)
        # Control requests run as tasks: `register` takes long and `stats` must still answer.
        await self.nc.subscribe(control_subject(self.args.index), cb=self.on_ctl_soon)
        await confirm_subscriptions(self.nc, 60)
        loops = [asyncio.ensure_future(c) for c in (
            self.spread(self._hellos, self.args.hello_s, "hello"),
            self.spread(self._samples, self.args.sample_s, "sample"),
            self.spread(self._powers, self.args.sample_s, "power"),
            self.steps())]
        await self.quit.wait()
        for task in loops:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.nc.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="NATS URL(s), comma separated")
    parser.add_argument("--index", type=int, required=True, help="this worker's number")
    parser.add_argument("--first-node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hello-s", type=float, default=5.0, help="heartbeat period (s)")
    parser.add_argument("--sample-s", type=float, default=10.0,
                        help="samples period per GPU (s; a real agent: 1; 0: none)")
    parser.add_argument("--step-s", type=float, default=10.0, help="training step (s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        uvloop.run(Fleet(args).run())
    except ImportError:  # pragma: no cover
        asyncio.run(Fleet(args).run())


if __name__ == "__main__":
    main()
