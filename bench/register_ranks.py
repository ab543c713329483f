"""Register 4,096 ranks of one data-parallel job and deliver its first power limit to every GPU.

An embedded nats-server, an in-process `CoordinatorService`, and, in a child process standing
for the rest of the cluster (`--in-process`: in the same event loop), one fake agent subscribed
to `<p>.gpu.*.*.cmd` for 512 nodes x 8 GPUs (it answers `info` with a description of the GPU
and counts `set_power_limit` commands) and a client that registers the job (dp=4096), then
all 4,096 ranks concurrently (every request outstanding at once, like 4,096 trainers starting).

* register_s: first rank request sent -> last rank reply received;
* deliver_s: last rank reply -> the fake agent has received the job's first power limit on
  all 4,096 GPUs (the coordinator starts the optimiser when the last rank is in; 0 when the
  limits arrive before the client has read its last reply);
* total_s: first rank request -> last delivery. Budget 1 s (the README's budget); Zeus's HTTP server
  needs 10.2 s at best for the same registration.

Prints a human line, then LAST one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import tempfile
import time

import msgpack
from _common import machine, now

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    GpuDescription,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
)

BUDGET_S = 1.0


async def harness(url: str, nodes: int, gpus_per_node: int) -> dict:
    """The outside world: fake agents for every GPU, and the 4,096 trainers registering.

    Returns the timings (`time.perf_counter`, the system-wide monotonic clock) and counts.
    """
    ranks = nodes * gpus_per_node
    # The fake agents: one responder for every GPU of every node.
    agent_nc = await connect(url, "fake-agents")
    info_replies: dict[str, bytes] = {}
    for n in range(nodes):
        for g in range(gpus_per_node):
            desc = GpuDescription(
                index=g, uuid=f"GPU-{n:04d}-{g}", name="NVIDIA A40", architecture="Ampere",
                min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
                supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
                has_energy_counter=True, power_limit_w=300,
            )
            subject = subjects.gpu_command(f"node{n:04d}", g)
            info_replies[subject] = codec.encode(
                Reply.success(node=f"node{n:04d}", gpu=desc.model_dump()))
    ok_reply = codec.encode(Reply.success())
    delivered: set[str] = set()
    all_delivered = asyncio.Event()
    delivered_at = [0.0]
    counts = {"info": 0, "set_power_limit": 0}

    async def on_cmd(msg) -> None:
        op = msgpack.unpackb(msg.data)["cmd"]["op"]
        counts[op] = counts.get(op, 0) + 1
        if op == "info":
            await msg.respond(info_replies[msg.subject])
            return
        if op == "set_power_limit":
            delivered.add(msg.subject)
            if len(delivered) == ranks and not all_delivered.is_set():
                delivered_at[0] = time.perf_counter()
                all_delivered.set()
        await msg.respond(ok_reply)

    # A wildcard subscription (subjects.gpu_command would sanitise "*" as a user token).
    await agent_nc.subscribe(subjects.all_gpu_commands(), cb=on_cmd)
    await agent_nc.flush()

    client = await connect(url, "trainers")
    info = JobInfo(dp_degree=ranks, pp_degree=1, tp_degree=1, world_size=ranks)
    raw = await client.request(
        subjects.coord_register_job("n0"),
        codec.encode(RegisterJob(job=info, power_limit=PowerLimitOptions())), timeout=10)
    job_id = codec.decode(raw.data, Reply).result["job_id"]
    requests = [
        codec.encode(RegisterRank(
            job_id=job_id,
            rank_info=RankInfo(rank=r, dp_rank=r, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 1500, 1200, 900, 600, 210]),
            gpu=GpuBinding(node=f"node{r // gpus_per_node:04d}", gpu_index=r % gpus_per_node,
                           gpu_uuid=f"GPU-{r // gpus_per_node:04d}-{r % gpus_per_node}"),
        ))
        for r in range(ranks)
    ]

    # The trainers: every request outstanding at once, replies on one wildcard inbox (4,096
    # real trainers each pay their own request overhead, in their own process).
    inbox = client.new_inbox()
    replies: dict[int, bytes] = {}
    all_replied = asyncio.Event()

    async def on_reply(msg) -> None:
        replies[int(msg.subject.rsplit(".", 1)[1])] = msg.data
        if len(replies) == ranks:
            all_replied.set()

    await client.subscribe(f"{inbox}.*", cb=on_reply)
    await client.flush()
    t0 = time.perf_counter()
    for r, payload in enumerate(requests):
        node = f"node{r // gpus_per_node:04d}"  # each rank through its own node's subject
        await client.publish(subjects.coord_register_rank(node), payload, reply=f"{inbox}.{r}")
    await asyncio.wait_for(all_replied.wait(), 30)
    t_registered = time.perf_counter()
    failures = [r for r in (codec.decode(x, Reply) for x in replies.values()) if not r.ok]
    if failures:
        print(f"{len(failures)} registrations failed, e.g. {failures[0].error}")
    else:
        await asyncio.wait_for(all_delivered.wait(), 30)
    t_delivered = delivered_at[0] or time.perf_counter()
    await client.drain()
    await agent_nc.drain()
    return {"job_id": job_id, "t0": t0, "t_registered": t_registered,
            "t_delivered": t_delivered, "failures": len(failures),
            "delivered": len(delivered), "info_requests": counts["info"]}


def _harness_process(url: str, nodes: int, gpus_per_node: int, conn) -> None:
    conn.send(asyncio.run(harness(url, nodes, gpus_per_node)))
    conn.close()


async def bench(nodes: int, gpus_per_node: int, state_dir: str, in_process: bool) -> dict:
    """Run the benchmark once and return its JSON record."""
    ranks = nodes * gpus_per_node
    with EmbeddedNats() as server:
        coord = CoordinatorService(CoordinatorSettings(
            nats_url=server.url, state_dir=state_dir, command_timeout_s=10.0))
        coord_task = asyncio.create_task(coord.serve())
        await asyncio.wait_for(coord.started.wait(), 10)
        if in_process:
            timings = await harness(server.url, nodes, gpus_per_node)
        else:
            ctx = multiprocessing.get_context("spawn")
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_harness_process,
                               args=(server.url, nodes, gpus_per_node, there))
            proc.start()
            while not here.poll():
                await asyncio.sleep(0.01)
            timings = here.recv()
            await asyncio.to_thread(proc.join, 10)
        record = coord.registry.get(timings["job_id"])
        coord.should_exit.set()
        await coord_task

    t0, t_registered, t_delivered = timings["t0"], timings["t_registered"], timings["t_delivered"]
    register_s = t_registered - t0
    deliver_s = max(0.0, t_delivered - t_registered)
    total_s = max(t_delivered, t_registered) - t0
    ok = (not timings["failures"] and len(record.ranks) == ranks
          and timings["delivered"] == ranks and total_s <= BUDGET_S)
    return {
        "bench": "register_ranks",
        "ranks": ranks,
        "register_s": round(register_s, 4),
        "deliver_s": round(deliver_s, 4),
        "total_s": round(total_s, 4),
        "budget_s": BUDGET_S,
        "ok": ok,
        "failures": timings["failures"],
        "info_requests": timings["info_requests"],
        "state_writes": coord.writes,
        "harness": "in-process" if in_process else "subprocess",
        "machine": machine(),
        "date": now(),
    }


def main() -> None:
    """Run the benchmark; print a human line, then the JSON record last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--in-process", action="store_true",
                        help="run the fake agents and trainers in the coordinator's event loop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as state_dir:
        try:
            import uvloop

            result = uvloop.run(bench(args.nodes, args.gpus_per_node, state_dir, args.in_process))
        except ImportError:  # pragma: no cover
            result = asyncio.run(bench(args.nodes, args.gpus_per_node, state_dir, args.in_process))
    verdict = "within" if result["ok"] else "OVER"
    print(f"registered {result['ranks']} ranks in {result['register_s']:.3f} s, first power "
          f"limit on every GPU {result['deliver_s']:.3f} s later: {result['total_s']:.3f} s in "
          f"all, {verdict} the {BUDGET_S:g} s budget (Zeus HTTP server: 10.2 s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
