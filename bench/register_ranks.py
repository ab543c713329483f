"""Register 4,096 ranks of one job with 2 coordinator replicas on JetStream; time the first limit.

The setup: an embedded nats-server with JetStream (file storage, in a temporary directory),
`--replicas` coordinator replicas (2 by default), each a `zeus-coordinator run` process
(`--replica-name r1`, `r2`, ...: request endpoints in one queue group, state in the JetStream
KV bucket, ownership leases), and, in this process, the rest of the cluster: one fake agent
subscribed to `<p>.gpu.*.*.cmd` and the nodes' batches `<p>.agent.*.cmd` for 512 nodes x 8 GPUs
(it answers `info` with a description of the GPU and counts `set_power_limit` commands;
`--per-gpu-agents`: the per-GPU subjects only) and the trainers: a client registers the job
(dp=4096), then all 4,096 ranks at once, each node's 8 ranks in one request on its node's
subject as its agent relays ranks that register together (`RegisterRankColumns`; `--rows`: a
`RegisterRanks`; `--per-rank`: one request per rank, as agents did before), every request
outstanding at once (4,096 trainers starting together). The job's owner is chosen among the
replicas; the queue group spreads the requests over them, each recording its ranks in JetStream
(compare-and-set creates: one key per GPU binding, one per rank, many ranks' keys to an atomic
batch) before answering; the owner learns the others' ranks from the bucket and starts the
power-limit optimiser when the last one is in.

Per run:
* register_s: first rank request sent -> last rank reply received (every rank durable);
* deliver_s: last rank reply -> the fake agent has received the job's first power limit on
  all 4,096 GPUs (0 when the limits arrive before the client has read its last reply);
* total_s: first rank request -> last delivery. Budget 1 s; Zeus's HTTP server needs 10.2 s
  at best for the same registration (in memory, no replicas);
* state_writes: messages in the state bucket's stream (its last sequence: every create, put
  and delete any replica made), owner_writes: in the ownership bucket's; state_batches: the
  atomic batches they came in, state_unbatched_writes: those written alone (each batch and
  each lone write one write nats-server syncs);
* cpu_s: CPU seconds each process used during the run (replicas, nats-server, this harness);
  cpu_total_s their sum, cpu_bound_s the least total_s that CPU allows on this machine were
  nothing else running (max of sum / cores and the largest process): what the budget needs
  on a shared machine, independent of its load; harness_setup_cpu_s: the part of the
  harness's that came before the first request (building the requests and the fake agents'
  replies), which neither total_s nor a real registration includes;
* register_rank_requests: rank registration requests each replica answered (`nats.micro`
  stats; a node's batch is one).

Each run starts a fresh nats-server and fresh replicas. `--profile DIR` (one run) samples the
replicas with py-spy while the ranks register (`--py-spy PATH`, else `py-spy` on PATH; stacks
in DIR/<replica>.txt) and prints where each replica's CPU went by activity; without py-spy it
runs them under cProfile (DIR/<replica>.prof, top functions printed; wall time, every
coroutine resumption a call, and slower: for orientation, not for the figures).

Prints a human line per run, then LAST one JSON object (medians and spread over `--runs`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
from _common import Replicas, cpu_seconds, jetstream_syncs, load, machine, now, spread

from zeus_agent import children
from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    GpuDescription,
    JobQuery,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
)
from zeus_agent.wire.rank_batch import RegisterRanks
from zeus_agent.wire.rank_columns import RegisterRankColumns

BUDGET_S = 1.0
ZEUS_HTTP_S = 10.2


class _FakeAgents:
    """One responder for every GPU of every node: answers `info`, counts first limits."""

    def __init__(self, nodes: int, gpus_per_node: int, batches: bool = True) -> None:
        self.ranks = nodes * gpus_per_node
        self.batches = batches
        self.info_replies: dict[str, bytes] = {}
        self.descriptions: dict[tuple[int, int], GpuDescription] = {}
        for n in range(nodes):
            for g in range(gpus_per_node):
                self.descriptions[n, g] = desc = GpuDescription(
                    index=g, uuid=f"GPU-{n:04d}-{g}", name="NVIDIA A40",
                    architecture="Ampere", min_power_limit_w=100, max_power_limit_w=300,
                    default_power_limit_w=300, supported_memory_clocks_mhz=[7251],
                    supported_graphics_clocks_mhz=[1740, 210], has_energy_counter=True,
                    power_limit_w=300,
                )
                subject = subjects.gpu_command(f"node{n:04d}", g)
                self.info_replies[subject] = codec.encode(
                    Reply.success(node=f"node{n:04d}", gpu=desc.model_dump()))
        self.ok_reply = codec.encode(Reply.success())
        self.delivered: set[str] = set()
        self.all_delivered = asyncio.Event()
        self.delivered_at = 0.0
        self.counts = {"info": 0, "set_power_limit": 0}
        self.nc: Any = None

    async def start(self, url: str) -> Any:
        """Connect and answer every GPU's commands; returns the connection (to drain)."""
        nc = self.nc = await connect(url, "fake-agents")
        # A wildcard subscription (subjects.gpu_command would sanitise "*" as a user token).
        await nc.subscribe(subjects.all_gpu_commands(), cb=self.on_cmd)
        if self.batches:
            await nc.subscribe(subjects.all_node_commands(), cb=self.on_batch)
        await nc.flush()
        return nc

    async def on_batch(self, msg: Any) -> None:
        """A node's batch (`NodeCommandBatch`), answered as an agent does: a reply per item."""
        node = msg.subject.rsplit(".", 2)[1]
        replies = []
        for item in msgpack.unpackb(msg.data)["items"]:
            op = item["envelope"]["cmd"]["op"]
            self.counts[op] = self.counts.get(op, 0) + 1
            subject = subjects.gpu_command(node, item["gpu"])
            if op == "info":
                replies.append(self.info_replies[subject])
                continue
            if op == "set_power_limit":
                self.deliver(subject)
            replies.append(self.ok_reply)
        # (Each reply's msgpack bytes as they are, in a `NodeCommandReply`.)
        head = msgpack.packb({"v": 1, "replies": []})[:-1] + _array_head(len(replies))
        await self.nc.publish(msg.reply, head + b"".join(replies))

    def deliver(self, subject: str) -> None:
        self.delivered.add(subject)
        if len(self.delivered) == self.ranks and not self.all_delivered.is_set():
            self.delivered_at = time.perf_counter()
            self.all_delivered.set()

    async def on_cmd(self, msg: Any) -> None:
        op = msgpack.unpackb(msg.data)["cmd"]["op"]
        self.counts[op] = self.counts.get(op, 0) + 1
        # Answered without the request's headers, as an agent's `nats.micro` endpoint answers
        # (`msg.respond` would echo the coordinator's `Zeus-Lease` header to it: 16,384 header
        # blocks for the replicas to parse that a real agent never sends).
        if op == "info":
            await self.nc.publish(msg.reply, self.info_replies[msg.subject])
            return
        if op == "set_power_limit":
            self.deliver(msg.subject)
        await self.nc.publish(msg.reply, self.ok_reply)


def _array_head(n: int) -> bytes:
    """A msgpack array header of `n` items."""
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def _requests(job_id: str, token: str, agents: _FakeAgents, nodes: int, gpus_per_node: int,
              ask_info: bool, per_rank: bool, rows: bool = False) -> list[tuple[str, bytes]]:
    """(node, payload) of every registration request, as the nodes' agents relay them."""
    ranks_requests = [
        RegisterRank(
            job_id=job_id,
            join_token=token,
            rank_info=RankInfo(rank=r, dp_rank=r, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 1500, 1200, 900, 600, 210]),
            gpu=GpuBinding(node=f"node{r // gpus_per_node:04d}", gpu_index=r % gpus_per_node,
                           gpu_uuid=f"GPU-{r // gpus_per_node:04d}-{r % gpus_per_node}"),
            # As the node's agent relays it: with the GPU's description (unless --ask-info).
            gpu_info=None if ask_info else agents.descriptions[divmod(r, gpus_per_node)],
        )
        for r in range(nodes * gpus_per_node)
    ]
    # A node's ranks, registering together, in one request (`RankRelay`); --per-rank: one
    # request per rank (agents before that).
    if per_rank:
        return [(f"node{r // gpus_per_node:04d}", codec.encode(x))
                for r, x in enumerate(ranks_requests)]
    # In columns, as agents send them to coordinators that read them (`--rows`: as before).
    batches = [ranks_requests[n * gpus_per_node:(n + 1) * gpus_per_node] for n in range(nodes)]
    return [(f"node{n:04d}", codec.encode(
                (None if rows else RegisterRankColumns.from_ranks(batch))
                or RegisterRanks(ranks=batch)))
            for n, batch in enumerate(batches)]


async def harness(url: str, nodes: int, gpus_per_node: int,
                  ask_info: bool = False, per_rank: bool = False,
                  rows: bool = False, per_gpu_agents: bool = False) -> dict[str, Any]:
    """The outside world: fake agents for every GPU, and the trainers registering.

    Returns the timings (`time.perf_counter`, the system-wide monotonic clock) and counts.
    """
    ranks = nodes * gpus_per_node
    agents = _FakeAgents(nodes, gpus_per_node, batches=not per_gpu_agents)
    agent_nc = await agents.start(url)
    client = await connect(url, "trainers")
    info = JobInfo(dp_degree=ranks, pp_degree=1, tp_degree=1, world_size=ranks)
    raw = await client.request(
        subjects.coord_register_job("node0000"),
        codec.encode(RegisterJob(job=info, power_limit=PowerLimitOptions())), timeout=10)
    registered = codec.decode(raw.data, Reply).result
    job_id = registered["job_id"]
    requests = _requests(job_id, registered["join_token"], agents, nodes, gpus_per_node,
                         ask_info, per_rank, rows)

    # The trainers (through their agents): every request outstanding at once, replies on one
    # wildcard inbox (4,096 real trainers each pay their own request overhead, in their own
    # process, and their agents theirs).
    inbox = client.new_inbox()
    replies: dict[int, Reply] = {}
    all_replied = asyncio.Event()

    async def on_reply(msg: Any) -> None:
        n = int(msg.subject.rsplit(".", 1)[1])
        reply = codec.decode(msg.data, Reply)
        if per_rank or not reply.ok:
            replies[n] = reply
        else:
            for i, each in enumerate(reply.result["replies"]):
                replies[n * gpus_per_node + i] = Reply.model_validate(each)
        if len(replies) == ranks:
            all_replied.set()

    await client.subscribe(f"{inbox}.*", cb=on_reply)
    await client.flush()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_at_t0 = usage.ru_utime + usage.ru_stime  # (Its setup before: `harness_setup_cpu_s`.)
    t0 = time.perf_counter()
    for i, (node, payload) in enumerate(requests):  # each through its own node's subject
        await client.publish(subjects.coord_register_rank(node), payload, reply=f"{inbox}.{i}")
    await client.flush()
    t_sent = time.perf_counter()
    await asyncio.wait_for(all_replied.wait(), 60)
    t_registered = time.perf_counter()
    failures = [r for r in replies.values() if not r.ok]
    if failures:
        print(f"{len(failures)} registrations failed, e.g. {failures[0].code}: "
              f"{failures[0].error}", file=sys.stderr)
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agents.all_delivered.wait(), 60)
    t_delivered = agents.delivered_at or time.perf_counter()
    await client.drain()
    await agent_nc.drain()
    return {"job_id": job_id, "cpu_at_t0": cpu_at_t0, "t0": t0, "t_sent": t_sent,
            "t_registered": t_registered,
            "t_delivered": t_delivered, "failures": len(failures),
            "delivered": len(agents.delivered), "info_requests": agents.counts["info"],
            "set_power_limit_commands": agents.counts["set_power_limit"]}


async def micro_stats(nc: Any, service: str = "zeus-coordinator") -> list[dict[str, Any]]:
    """Every instance's `nats.micro` STATS reply (one per replica), within 0.5 s."""
    inbox = nc.new_inbox()
    out: list[dict[str, Any]] = []

    async def on_reply(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            out.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(f"$SRV.STATS.{service}", b"", reply=inbox)
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    return out


async def synced_writes(nc: Any, bucket: str) -> dict[str, int]:
    """How the state bucket's messages were written: atomic batches, and messages alone.

    Each is one write nats-server syncs (`sync_interval: always`). Read from the stored
    messages' headers (a batch's last carries `Nats-Batch-Commit`), after the run.
    """
    from nats.js import api

    counts: Counter[str] = Counter()
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        headers = msg.headers or {}
        if "Nats-Batch-Commit" in headers:
            counts["state_batches"] += 1
        elif "Nats-Batch-Id" not in headers:
            counts["state_unbatched_writes"] += 1
        if msg.metadata.num_pending == 0:
            done.set()

    sub = await nc.jetstream().subscribe(f"$KV.{bucket}.>", ordered_consumer=True, cb=on_msg,
                                         headers_only=True,
                                         deliver_policy=api.DeliverPolicy.ALL)
    try:
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await sub.unsubscribe()
    return {"state_batches": counts["state_batches"],
            "state_unbatched_writes": counts["state_unbatched_writes"]}


async def inspect(url: str, job_id: str) -> dict[str, Any]:
    """What JetStream and the replicas say after the run: writes, owner, ranks, requests."""
    nc = await connect(url, "bench-inspector")
    try:
        bucket, owners_bucket = subjects.state_buckets()
        jsm = nc.jsm()
        state = (await jsm.stream_info(f"KV_{bucket}")).state
        owners_state = (await jsm.stream_info(f"KV_{owners_bucket}")).state
        from coordinator.state import records

        owners = await nc.jetstream().key_value(owners_bucket)
        owner = json.loads((await owners.get(records.job_hash(job_id))).value)["owner"]
        msg = await nc.request(subjects.coord_job_query(),
                               codec.encode(JobQuery(job_id=job_id)), timeout=10)
        reply = codec.decode(msg.data, Reply)
        ranks = len(reply.result.get("ranks", {})) if reply.ok else -1
        per_replica = []
        for st in await micro_stats(nc):
            for ep in st.get("endpoints", []):
                if ep.get("name") == "register_rank":
                    per_replica.append(int(ep.get("num_requests", 0)))
        synced = await synced_writes(nc, bucket)
        return {"state_writes": int(state.last_seq), "state_keys": int(state.messages),
                **synced,
                "owner_writes": int(owners_state.last_seq), "owner": owner,
                "ranks_recorded": ranks, "register_rank_requests": sorted(per_replica)}
    finally:
        await nc.close()


ACTIVITIES = [  # The first that matches a stack names it (nested ones first). Frames as py-spy
    # names them: before 0.4 with their class (`Endpoints.register_rank`), from 0.4 without
    # (`register_rank (coordinator/service/endpoints.py:NN)`): both are matched.
    ("owner: start the optimiser, info, first limit",
     ("OptimiserStarter.start", ";start (coordinator/service/starter.py", "request_all")),
    ("rank handler: JetStream creates (JetStreamState.create_rank, create_node_ranks)",
     ("create_rank", "create_node_ranks", "_commit (coordinator/state/group_commit.py",
      "GroupCommit._commit")),
    ("rank handler: GPU info request (GpuDirectory.describe)",
     ("GpuDirectory.describe", "describe (coordinator/service/gpus.py")),
    ("rank handler: the rest (decode, checks, registry, status)",
     ("Endpoints.register_rank", "register_rank (coordinator/service/endpoints.py")),
    ("reply: encode + respond (Endpoints.wrap.handle)",
     ("wrap.<locals>.handle", "handle (coordinator/service/endpoints.py")),
    ("request dispatch (nats.micro, task spawn)",
     ("micro/service.py", "CoordinatorService.spawn", "spawn (coordinator/service/")),
    ("KV watch: entries -> this replica's view (watch.follow)",
     ("follow.<locals>.on_msg", "on_msg (coordinator/state/watch.py")),
    ("nats-py read loop: parse, headers, Msg objects", ("_read_loop",)),
    ("nats-py reply routing (request futures)", ("_request_sub_callback",)),
    ("nats-py flusher: socket writes", ("_flusher",)),
    ("event loop itself (uvloop, callbacks)",
     ("Runner.run (asyncio/runners.py:118)", "run (asyncio/runners.py:118)")),
]


def spy_summary(path: Path, top: int) -> str:
    """Where a replica's sampled CPU went: by activity, then by leaf function."""
    by_activity: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or "asyncio/runners.py" not in stack:
            continue  # not the event loop's thread (the /healthz server's)
        n = int(count)
        total += n
        frames = stack.split(";")
        name = next((a for a, keys in ACTIVITIES if any(k in stack for k in keys)), "other")
        if name.startswith("event loop") and len(frames) > frames.index(
                next(f for f in frames if "asyncio/runners.py" in f)) + 1:
            name = "other: " + frames[-1].split(" (")[0]
        by_activity[name] += n
        leaves[frames[-1]] += n
    out = [f"{total} samples"]
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in by_activity.most_common()]
    out += ["  top leaf frames:"]
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in leaves.most_common(top)]
    return "\n".join(out)


def start_spies(py_spy: str, reps: Replicas, profile_dir: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy sampling every replica (raw collapsed stacks, 250 Hz, not pausing it)."""
    return [children.popen([py_spy, "record", "-p", str(reps.pid(n)), "-f", "raw", "-r", "250",
                            "--nonblocking", "-o", str(profile_dir / f"{n}.txt")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for n in reps.names]


def stop_spies(spies: list[subprocess.Popen[bytes]]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()


def print_profiles(profile_dir: Path, names: list[str], top: int) -> None:
    """Each replica's py-spy summary, or the top functions of its cProfile."""
    for name in names:
        spied = profile_dir / f"{name}.txt"
        if spied.exists():
            print(f"== replica {name}, py-spy: {spy_summary(spied, top)}", file=sys.stderr)
            continue
        path = profile_dir / f"{name}.prof"
        if not path.exists():
            print(f"== {name}: no profile written", file=sys.stderr)
            continue
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(str(path), stream=buf).sort_stats(key).print_stats(top)
            print(f"== replica {name}, by {key}\n{buf.getvalue()}", file=sys.stderr)


async def run_once(nodes: int, gpus_per_node: int, replicas: int, profile_dir: Path | None,
                   py_spy: str | None = None, ask_info: bool = False,
                   jetstream_sync: str = "always", per_rank: bool = False,
                   rows: bool = False, per_gpu_agents: bool = False) -> dict[str, Any]:
    """One run on a fresh nats-server and fresh replicas; its record.

    With `profile_dir`: py-spy samples the replicas during the run when `py_spy` is given,
    else they run under cProfile.
    """
    names = [f"r{i + 1}" for i in range(replicas)]
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="zeus-rr-") as tmp:
        root = Path(tmp)
        server = EmbeddedNats(store_dir=str(root / "js"), jetstream_sync=jetstream_sync)
        await asyncio.to_thread(server.start)
        reps = Replicas(server.url, root, names, ["--command-timeout-s", "10"],
                        profile_dir if py_spy is None else None)
        spies: list[subprocess.Popen[bytes]] = []
        try:
            reps.start_all()
            await asyncio.to_thread(reps.wait_healthy, 60)
            nats_pid = server._proc.pid if server._proc is not None else 0  # noqa: SLF001
            pids = {**{n: reps.pid(n) for n in names}, "nats-server": nats_pid}
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            if profile_dir is not None and py_spy is not None:
                spies = start_spies(py_spy, reps, profile_dir)
                await asyncio.sleep(1.0)  # py-spy attached
            self0 = resource.getrusage(resource.RUSAGE_SELF)
            timings = await harness(server.url, nodes, gpus_per_node, ask_info, per_rank, rows,
                                    per_gpu_agents)
            await asyncio.to_thread(stop_spies, spies)
            spies = []
            cpu = {k: round(cpu_seconds(p) - cpu0[k], 3) for k, p in pids.items()}
            self1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu["harness"] = round(self1.ru_utime + self1.ru_stime
                                   - self0.ru_utime - self0.ru_stime, 3)
            setup_cpu_s = round(timings["cpu_at_t0"] - self0.ru_utime - self0.ru_stime, 3)
            seen = await inspect(server.url, timings["job_id"])
        except BaseException:
            reps.print_logs()
            raise
        finally:
            await asyncio.to_thread(stop_spies, spies)
            await asyncio.to_thread(reps.stop_all)
            await asyncio.to_thread(server.stop)
    t0, t_registered, t_delivered = timings["t0"], timings["t_registered"], timings["t_delivered"]
    register_s = t_registered - t0
    deliver_s = max(0.0, t_delivered - t_registered)
    total_s = max(t_delivered, t_registered) - t0
    ranks = nodes * gpus_per_node
    complete = (not timings["failures"] and seen["ranks_recorded"] == ranks
                and timings["delivered"] == ranks)
    return {
        "register_s": round(register_s, 4), "deliver_s": round(deliver_s, 4),
        "total_s": round(total_s, 4), "send_s": round(timings["t_sent"] - t0, 4),
        "harness_setup_cpu_s": setup_cpu_s,
        "complete": complete, "failures": timings["failures"],
        "delivered": timings["delivered"], "info_requests": timings["info_requests"],
        "set_power_limit_commands": timings["set_power_limit_commands"],
        **seen, "cpu_s": cpu, "cpu_total_s": round(sum(cpu.values()), 3),
        "cpu_bound_s": cpu_bound(cpu), "load_before": load_before, "load_after": load(),
        "jetstream_sync": jetstream_sync,
    }


def cpu_bound(cpu: dict[str, float]) -> float:
    """The least total_s the run's CPU allows on this machine with nothing else running.

    Its processes' CPU spread perfectly over all cores, and no process faster than its own CPU
    (each is one event loop): max(sum / cores, the largest).
    """
    return round(max(sum(cpu.values()) / (os.cpu_count() or 1), max(cpu.values(), default=0)), 3)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark `args.runs` times; the JSON record."""
    ranks = args.nodes * args.gpus_per_node
    runs: list[dict[str, Any]] = []
    by_sync: dict[str, list[dict[str, Any]]] = {}
    for i in range(args.runs):
        # Each setting in turn within a run, so both see the same load.
        for sync in args.jetstream_sync:
            run = await run_once(args.nodes, args.gpus_per_node, args.replicas, args.profile,
                                 args.py_spy, args.ask_info, sync, args.per_rank, args.rows,
                                 args.per_gpu_agents)
            by_sync.setdefault(sync, []).append(run)
            if sync == args.jetstream_sync[0]:
                runs.append(run)
            print(f"run {i + 1}/{args.runs}, JetStream sync {sync}: {ranks} ranks registered in "
                  f"{run['register_s']:.3f} s, "
                  f"first power limit on every GPU {run['deliver_s']:.3f} s later: "
                  f"{run['total_s']:.3f} s in all; state writes {run['state_writes']} in "
                  f"{run['state_batches']} batches + {run['state_unbatched_writes']} alone, CPU s "
                  f"{run['cpu_s']} (idle-machine bound {run['cpu_bound_s']:.2f} s), load "
                  f"{run['load_before']} -> {run['load_after']}")
            if not run["complete"]:
                print(f"  INCOMPLETE: {run['failures']} failures, {run['ranks_recorded']} "
                      f"ranks recorded, {run['delivered']} GPUs got the limit", file=sys.stderr)
    totals = [r["total_s"] for r in runs]
    total = spread(totals)
    ok = all(r["complete"] for r in runs) and total["median"] <= BUDGET_S
    return {
        "bench": "register_ranks",
        "ranks": ranks,
        "replicas": args.replicas,
        "replica_processes": True,
        "durable": True,
        "state": "JetStream KV, file storage, 1 nats-server",
        "jetstream_sync": args.jetstream_sync[0],
        "requests": "per rank" if args.per_rank else "per node",
        "layout": "rows" if args.rows or args.per_rank or args.ask_info else "columns",
        "agents": "per-GPU commands only" if args.per_gpu_agents else "node command batches",
        "total_s_by_jetstream_sync": {
            sync: spread([r["total_s"] for r in sync_runs]) for sync, sync_runs in by_sync.items()},
        "cpu_total_s_by_jetstream_sync": {
            sync: spread([r["cpu_total_s"] for r in sync_runs], 3)
            for sync, sync_runs in by_sync.items()},
        "register_s": spread([r["register_s"] for r in runs]),
        "deliver_s": spread([r["deliver_s"] for r in runs]),
        "total_s": total,
        "budget_s": BUDGET_S,
        "zeus_http_s": ZEUS_HTTP_S,
        "ok": ok,
        "state_writes": runs[-1]["state_writes"],
        "state_batches": runs[-1]["state_batches"],
        "state_unbatched_writes": runs[-1]["state_unbatched_writes"],
        "owner_writes": runs[-1]["owner_writes"],
        "info_requests": runs[-1]["info_requests"],
        "register_rank_requests": runs[-1]["register_rank_requests"],
        "cpu_s": runs[-1]["cpu_s"],
        "cpu_total_s": spread([r["cpu_total_s"] for r in runs], 3),
        "cpu_bound_s": spread([r["cpu_bound_s"] for r in runs], 3),
        "profiled": None if args.profile is None else ("py-spy" if args.py_spy else "cProfile"),
        "runs": runs,
        "machine": machine(),
        "load": load(),
        "date": now(),
    }


def main() -> None:
    """Run the benchmark; print a human line per run, then the JSON record last."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=512, help="fake nodes (default 512)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="coordinator replicas, one process each (default 2)")
    parser.add_argument("--runs", type=int, default=5,
                        help="runs, each on a fresh server and replicas (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="one run (about 15 s); the same 4,096 ranks")
    parser.add_argument("--profile", type=Path, metavar="DIR", default=None,
                        help="one run, profiled: py-spy samples the replicas (stacks in "
                        "DIR/<replica>.txt) and their CPU is broken down by activity; without "
                        "py-spy, cProfile (DIR/<replica>.prof); the figures are then not "
                        "comparable")
    parser.add_argument("--py-spy", metavar="PATH", default=shutil.which("py-spy"),
                        help="the py-spy binary for --profile (default: py-spy on PATH)")
    parser.add_argument("--top", type=int, default=15, help="functions shown per profile")
    parser.add_argument("--ask-info", action="store_true",
                        help="registrations without the GPU's description (as older agents relay "
                        "them): the coordinator asks each GPU's agent first (`info`)")
    parser.add_argument("--per-rank", action="store_true",
                        help="one request per rank (agents before node batches), not one per "
                        "node (a node's ranks registering together, as its agent relays them)")
    parser.add_argument("--rows", action="store_true",
                        help="a node's batch in rows (`RegisterRanks`, as agents sent them before "
                        "columns), not in columns (`RegisterRankColumns`)")
    parser.add_argument("--per-gpu-agents", action="store_true",
                        help="fake agents that serve only the per-GPU command subjects (agents "
                        "before node batches): the coordinator's batches fall back per GPU")
    parser.add_argument("--jetstream-sync", type=jetstream_syncs, default=["always"],
                        metavar="SYNC[,SYNC]",
                        help="JetStream sync_interval(s) of the bench's nats-server: 'always' "
                        "(the project's default) and/or a duration ('2m', nats-server's "
                        "default); with two, each run measures both in turn and the JSON gives "
                        "both (the headline figures are the first's)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    if args.profile is not None:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
        args.runs = 1
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        result = uvloop.run(bench(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(bench(args))
    if args.profile is not None:
        print_profiles(args.profile, [f"r{i + 1}" for i in range(args.replicas)], args.top)
    verdict = "within" if result["ok"] else "OVER"
    t = result["total_s"]
    print(f"{result['ranks']} ranks, {result['replicas']} replicas, durable: median "
          f"{t['median']:.3f} s (min {t['min']:.3f}, max {t['max']:.3f}) to the first power "
          f"limit on every GPU, {verdict} the {BUDGET_S:g} s budget (Zeus HTTP server: "
          f"{ZEUS_HTTP_S} s); load {result['load']} on {os.cpu_count()} cpu; the run's CPU "
          f"({result['cpu_total_s']['median']:.2f} s) allows no less than "
          f"{result['cpu_bound_s']['median']:.2f} s here were the machine idle")
    print(json.dumps(result))


if __name__ == "__main__":
    with children.sigterm_as_sigint():  # SIGTERM cleans up as Ctrl-C does
        main()
