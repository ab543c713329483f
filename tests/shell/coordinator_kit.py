"""Helpers of the coordinator's shell tests: start and stop a `CoordinatorService` (and a
simulated-GPU agent) on a test's nats-server, ask it over NATS, register jobs and ranks, feed
their steps, collect what it publishes. The fixtures built on them are in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from coordinator.service.replicas import Replicas
from zeus_agent.agent.server import AgentServer
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    CommandEnvelope,
    GpuBinding,
    InfoCmd,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
    join_token_digest,
)
from zeus_demo.cluster import wait_for_async

NODE = "shell-node"


async def start_agent(nats_server, tmp: Path) -> tuple[AgentServer, asyncio.Task]:
    """An agent with two simulated A40s (100-300 W, their state in `tmp`) on node `NODE`."""
    server = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=0,
        sim_state_dir=str(tmp / "gpus"), socket_path=str(tmp / "agent.sock"), node=NODE,
        sample_hz=20,
    ))
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.started.wait(), 10)
    return server, task


def bucket_of(state_dir: Path) -> str:
    """A JetStream bucket of the test's own (the NATS server is shared by the session)."""
    return "t-" + hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]


async def start(nats_server, state_dir: Path, **kw: Any) -> tuple[CoordinatorService, asyncio.Task]:
    kw.setdefault("state_bucket", bucket_of(state_dir))
    settings = CoordinatorSettings(nats_url=nats_server.url, state_dir=str(state_dir),
                                   command_timeout_s=1.0, **kw)
    coord = CoordinatorService(settings)
    task = asyncio.create_task(coord.serve())
    await asyncio.wait_for(coord.started.wait(), 10)
    return coord, task


async def stop(coord: CoordinatorService, task: asyncio.Task) -> None:
    coord.should_exit.set()
    await asyncio.wait_for(task, 10)


class ReplicaSet:
    """Coordinator replicas sharing one state bucket, by name (`replicas` starts and stops them)."""

    def __init__(self, nats_server: Any, tmp: Path, kw: dict[str, Any]) -> None:
        self.nats_server, self.tmp, self.kw = nats_server, tmp, kw
        self.coords: dict[str, CoordinatorService] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def __getitem__(self, name: str) -> CoordinatorService:
        return self.coords[name]

    async def add(self, name: str) -> CoordinatorService:
        """Start replica `name` (its own state dir; the set's bucket and settings)."""
        self.coords[name], self.tasks[name] = await start(
            self.nats_server, self.tmp / name, replica_name=name, **self.kw)
        return self.coords[name]

    async def remove(self, name: str) -> None:
        """Stop replica `name` as an operator would (it says it is leaving)."""
        await stop(self.coords.pop(name), self.tasks.pop(name))

    async def all_live(self, timeout_s: float = 10.0) -> None:
        """Until every replica is warm and counts every other live."""
        await wait_for(lambda: all(c.leases.warm() and len(c.leases.live()) == len(self.coords)
                                   for c in self.coords.values()), timeout_s)


@contextlib.asynccontextmanager
async def replicas(nats_server: Any, tmp: Path, names: Iterable[str] = ("r1", "r2"),
                   lease_s: float = 3.0, **kw: Any) -> AsyncIterator[ReplicaSet]:
    """Replicas `names` on one bucket, with leases and handovers of `lease_s`; all stopped after."""
    kw = {"state_bucket": bucket_of(tmp), "ownership_lease_s": lease_s,
          "handover_after_s": lease_s, **kw}
    group = ReplicaSet(nats_server, tmp, kw)
    try:
        for name in names:
            await group.add(name)
        yield group
    finally:
        for name in list(group.coords):
            await group.remove(name)


async def ask(nc, subject: str, payload: Any) -> Reply:
    data = payload if isinstance(payload, bytes) else codec.encode(payload)
    msg = await nc.request(subject, data, timeout=5)
    return codec.decode(msg.data, Reply)


def job_request(dp: int = 2, job_metadata: str | None = None, **kw: Any) -> RegisterJob:
    info = JobInfo(dp_degree=dp, pp_degree=1, tp_degree=1, world_size=dp,
                   job_metadata=job_metadata)
    return RegisterJob(job=info, **kw)


JOIN_TOKENS: dict[str, str] = {}
"""Job id -> the join token its registration returned (`register_job` keeps it)."""


def rank_request(job_id: str, rank: int, gpu: int | None = None, node: str = NODE,
                 uuid: str = "") -> RegisterRank:
    return RegisterRank(
        job_id=job_id,
        join_token=JOIN_TOKENS.get(job_id),
        rank_info=RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                           available_frequencies=[1740, 210]),
        gpu=GpuBinding(node=node, gpu_index=rank if gpu is None else gpu, gpu_uuid=uuid),
    )


async def register_job(nc, **kw: Any) -> str:
    reply = await ask(nc, subjects.coord_register_job(NODE), job_request(**kw))
    assert reply.ok, reply
    JOIN_TOKENS[reply.result["job_id"]] = reply.result["join_token"]
    return reply.result["job_id"]


async def gpu_info(nc, index: int) -> dict[str, Any]:
    reply = await ask(nc, subjects.gpu_command(NODE, index), CommandEnvelope(cmd=InfoCmd()))
    assert reply.ok
    return reply.result


async def collect(nc, subject: str, model: Any) -> list[Any]:
    got: list[Any] = []

    async def cb(msg: Any) -> None:
        got.append(codec.decode(msg.data, model))

    await nc.subscribe(subject, cb=cb)
    await confirm_subscriptions(nc)
    return got


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    """Poll `predicate()` every 20 ms until it holds (the harness's `wait_for_async`)."""
    await wait_for_async(predicate, timeout_s, interval_s=0.02)


async def state_keys(coord: CoordinatorService) -> set[str]:
    """The keys in the coordinator's state bucket now."""
    from coordinator.state.buckets import bucket_keys

    return set(await bucket_keys(coord.link.state.kv))


async def state_values(coord: CoordinatorService) -> list[bytes]:
    """Every value in the coordinator's state bucket now."""
    return [(await coord.link.state.kv.get(key)).value or b"" for key in await state_keys(coord)]


def measurements(limits_energy_time: list[tuple[int, float, float]]) -> list:
    from zeus_agent.models import PowerLimitMeasurement

    return [PowerLimitMeasurement(power_limit=w, energy=e, time=t)
            for w, e, t in limits_energy_time]


async def feed_steps(nc, job_id: str, steps: range, joules_per_step: float = 100.0,
                     columns: bool = False) -> None:
    """Rank 0's step_begin events and both ranks' marks, as the agents publish them (with the
    digest of the join token their trainers' HELLO presented): both GPUs' marks in one node
    batch. `columns`: both in columns (`TrainerEventColumns`, `NodeColumnBatch`)."""
    from zeus_agent.wire.event_columns import TrainerEventColumns
    from zeus_agent.wire.messages import Mark, TrainerEvent, TrainerEventBatch
    from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch
    from zeus_agent.wire.node_columns import NodeColumnBatch

    digest = join_token_digest(JOIN_TOKENS[job_id])
    for s in steps:
        events = TrainerEventBatch(job_id=job_id, rank=0, node=NODE, gpu=0, join_digest=digest,
                                   events=[TrainerEvent(kind="step_begin", t_ns=s * 10**9,
                                                        epoch=0, step=s)])
        await nc.publish(subjects.job_events(job_id, 0, NODE), codec.encode(
            TrainerEventColumns.from_batch(events) if columns else events))
        parts = [GpuMeasurements(gpu=rank, rank=rank, join_digest=digest, marks=[
            Mark(kind="step_begin", epoch=0, step=s, t_ns=s * 10**9,
                 energy_j=s * joules_per_step * (rank + 1))]) for rank in (0, 1)]
        batch = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=parts)
        await nc.publish(subjects.job_measurements(job_id, NODE), codec.encode(
            NodeColumnBatch.from_rows(batch) if columns else batch))
    await nc.flush()


def limits_are(sim_dir: Any, watts: int) -> bool:
    """Whether both simulated GPUs in `sim_dir` are at `watts`."""
    return all(SimGPU.open(sim_dir, i).get_power_limit_w() == watts for i in (0, 1))


async def bind_trainers(nc, job_id: str) -> None:
    """What the agent does on each rank's trainer HELLO: bind its GPU to (job, rank)."""
    for r in (0, 1):
        assert (await ask(nc, subjects.gpu_command(NODE, r),
                          {"v": 1, "cmd": {"op": "bind", "job_id": job_id, "rank": r,
                                           "join_digest": join_token_digest(JOIN_TOKENS[job_id])}}
                          )).ok


async def bound_energy_job(nc) -> str:
    """A 2-rank job whose profile makes 250 W optimal, its ranks registered and bound."""
    profile = measurements([(300, 1000.0, 10.0), (250, 700.0, 10.5), (200, 800.0, 13.0)])
    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions(selector="Energy",
                                                                        profile=profile))
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await bind_trainers(nc, job_id)
    return job_id


def stall(monkeypatch: Any, method: str, part: type = Replicas) -> asyncio.Event:
    """Make `<part>.<method>` (a part of the service) do nothing while the event is set."""
    stalled = asyncio.Event()
    real = getattr(part, method)

    async def stallable(self: Any, *args: Any) -> None:
        if not stalled.is_set():
            await real(self, *args)

    monkeypatch.setattr(part, method, stallable)
    return stalled
