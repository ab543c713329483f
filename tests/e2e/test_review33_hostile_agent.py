"""Issue 33 review: what one node's agent credential (or a buggy agent) still does to the replicas.

Real processes where it matters (nats-server with the `nats-auth` users, coordinator replicas,
a raw client holding only `agent-gpu-node-1`'s credential), reusing the harness of
`tests/e2e/test_hostile_agent.py`. Each test failed on the code it was written against (what it
found is below) and passes since the fixes: ranks' instructions are not kept from a
registration, clocks lists hold at most 1,024, and one node's GPUs hold at most
`max_ranks_per_node` ranks (2,048); a marks batch yields every 256 marks and one input replays
at most 1,000 lost steps; a profile too long for a question to rank 0 falls back at once.

1. Fat ranks: a job registered through the agent may have `world_size` up to 2**24 - 1, and each
   rank relayed by that agent may carry ~1 MB of `RankInfo` (4,096 clocks, up to 1,000,000
   instruction names). Every replica keeps every rank in memory and JetStream keeps it on disk,
   and a restarted replica reads it all again: ~1.1 MB of RSS per rank on every replica, at
   ~50 ranks/s, without any quota (the per-node quota counts jobs, not ranks or bytes). Left
   running, every replica runs out of memory, and again after each restart.
2. One marks batch: a node batch (`NodeMeasurementBatch`) of ~13,000 marks (just under NATS's
   1 MB) of the attacker's own job, whose GPU it describes as 1..4,096 W with `pl_step_w=1`
   (4,096 windows, all waiting for marks after 16 events), is fed mark by mark without a yield:
   each mark scans every window, and the replica's event loop stops for ~11 s. Its ownership
   leases lapse (other replicas take every job it drives; it fences their commands meanwhile)
   and every request waits.
3. A user's own selector ("Custom") with more than 256 profiled limits (e.g. an H100's
   200..700 W with `pl_step_w=1`): `SelectCmd.measurements` is bounded to 256 rows, so building
   the command raises `ValidationError` in `ActionExecutor.ask_selector`, and the job fails and
   is quarantined instead of asking rank 0 or falling back to ZeusCost.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.optimizer import AskSelector
from coordinator.service.actions import ActionExecutor
from tests.e2e.hostile_kit import (
    GOOD,
    HOSTILE,
    READY_S,
    Cluster,
    FakeAgent,
    description,
)
from zeus_agent.models import JobInfo, PowerLimitMeasurement, RankInfo
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    JobQuery,
    Mark,
    PowerLimitOptions,
    RegisterJob,
    Reply,
    TrainerEvent,
    TrainerEventBatch,
    join_token_digest,
)
from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch
from zeus_demo.cluster import wait_for_async

pytestmark = pytest.mark.timeout(150)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_one_agent_cannot_grow_every_replica_with_fat_ranks() -> None:
    ranks, budget_mb = 200, 64.0
    tmp = Path(tempfile.mkdtemp(prefix="zeus-review33-ranks-", dir="/tmp"))
    cluster = Cluster(tmp)
    clients: list[Any] = []
    try:
        cluster.start_server()
        await cluster.start_replicas()
        nc = await cluster.connect(permissions.agent_user(HOSTILE),
                                   permissions.inbox("agent", HOSTILE))
        clients.append(nc)
        attacker = FakeAgent(nc, HOSTILE)
        await attacker.serve()
        ws = 2**24 - 1
        reply = await attacker.request(
            subjects.coord_register_job(HOSTILE),
            codec.encode(RegisterJob(job=JobInfo(dp_degree=ws, pp_degree=1, tp_degree=1,
                                                 world_size=ws),
                                     power_limit=PowerLimitOptions())))
        assert reply.ok, reply
        job_id, token = reply.result["job_id"], reply.result["join_token"]
        names = [f"{i:06d}" + "x" * 249 for i in range(3600)]  # ~0.9 MB per registration
        before = {n: rss_mb(p.pid) for n, p in cluster.replicas.items()}
        accepted = 0
        for r in range(ranks):
            info = RankInfo(rank=r, dp_rank=r, pp_rank=0, tp_rank=0,
                            available_frequencies=list(range(1000, 1512)), instructions=names)
            payload = {"v": 1, "job_id": job_id, "join_token": token,
                       "rank_info": info.model_dump(),
                       "gpu": GpuBinding(node=HOSTILE, gpu_index=r).model_dump(),
                       "gpu_info": description(r, 100, 300, 300)}
            rep = await attacker.request(subjects.coord_register_rank(HOSTILE),
                                         codec.encode(payload))
            accepted += rep.ok
        await cluster.assert_alive("after the registrations", 0.5)
        grown = {n: round(rss_mb(p.pid) - before[n]) for n, p in cluster.replicas.items()}
        assert all(g < budget_mb for g in grown.values()), (
            f"one agent credential registered {accepted} of {ranks} ranks of ~0.9 MB each; "
            f"every replica's RSS grew (MB): {grown}")
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_one_marks_batch_does_not_stop_the_replica() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="zeus-review33-marks-", dir="/tmp"))
    cluster = Cluster(tmp)
    clients: list[Any] = []
    try:
        cluster.start_server()
        cluster.start_replica("r1")
        await wait_for_async(lambda: "coordinator ready" in cluster.log("r1").read_text(
            errors="replace"), READY_S, lambda: cluster.report("r1 not ready"))

        async def connect(user: str, inbox: str) -> Any:
            nc = await cluster.connect(user, inbox)
            clients.append(nc)
            return nc

        attacker = FakeAgent(await connect(permissions.agent_user(HOSTILE),
                                           permissions.inbox("agent", HOSTILE)), HOSTILE)
        good = FakeAgent(await connect(permissions.agent_user(GOOD),
                                       permissions.inbox("agent", GOOD)), GOOD)
        observer = await connect(permissions.OBSERVER_USER, permissions.inbox("observer"))
        await attacker.serve()
        await good.serve()
        good.descriptions[0] = description(0, 100, 300, 300)
        job_ok, token_ok = await good.register_job(PowerLimitOptions())
        assert (await good.register_rank(job_ok, token_ok, 0, good.descriptions[0])).ok
        job, token = await attacker.register_job(
            PowerLimitOptions(pl_step_w=1, warmup_steps=0, profile_steps=1))
        reply = await attacker.register_rank(job, token, 0, description(0, 1, 4096, 300))
        assert reply.ok, reply
        await asyncio.sleep(1)
        digest = join_token_digest(token)
        events = [TrainerEvent(kind="step_begin", t_ns=i + 1, epoch=0, step=i * 1000)
                  for i in range(16)]  # every window opens and closes, waiting for marks
        await attacker.nc.publish(subjects.job_events(job, 0, HOSTILE), codec.encode(
            TrainerEventBatch(job_id=job, rank=0, node=HOSTILE, gpu=0, events=events,
                              join_digest=digest)))
        await attacker.nc.flush()
        await asyncio.sleep(3)

        async def query_s() -> float:
            t = time.monotonic()
            msg = await observer.request(subjects.coord_job_query(),
                                         codec.encode(JobQuery(job_id=job_ok)), timeout=120)
            assert codec.decode(msg.data, Reply).ok
            return time.monotonic() - t

        await query_s()
        marks = [Mark(kind="step_begin", epoch=1, step=i, t_ns=i + 1, energy_j=float(i))
                 for i in range(13_000)]
        data = codec.encode(NodeMeasurementBatch(node=HOSTILE, job_id=job, gpus=[
            GpuMeasurements(gpu=0, rank=0, marks=marks, join_digest=digest)]))
        assert len(data) < 1 << 20
        await attacker.nc.publish(subjects.job_measurements(job, HOSTILE), data)
        await attacker.nc.flush()
        await asyncio.sleep(0.3)
        waited = await query_s()
        await cluster.assert_alive("after the marks batch", 0.1)
        assert waited < 3.0, (f"a {len(data)}-byte marks batch of one agent's own job stopped "
                              f"the replica for {waited:.1f} s (its query waited that long)")
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_custom_selector_with_more_than_256_limits_falls_back_with_a_reason() -> None:
    """A profile longer than a question to a trainer carries (256 rows) is not sent: the job
    is told at once why rank 0 cannot be asked, and its fallback chooses (no exception)."""
    sent: list[list[tuple[str, bytes]]] = []
    told: list[tuple[int, str]] = []
    job = SimpleNamespace(selector_unreachable=lambda request, why: told.append((request, why))
                          or [])
    record = SimpleNamespace(
        job_id="job-300-limits",
        ranks={0: SimpleNamespace(gpu=GpuBinding(node="node-a", gpu_index=0))})

    async def command(_record: Any, _what: str, requests: list[tuple[str, bytes]]) -> list[Any]:
        sent.append(requests)
        return [Reply.success()]

    async def act(_job_id: str, step: Any, rank: int, item: Any) -> None:
        step(rank, item)

    executor = ActionExecutor(  # Only what ask_selector uses; the rest is never reached.
        settings=SimpleNamespace(prefix="zeus"), pfo=None, clock=time.monotonic,  # type: ignore[arg-type]
        jobs=SimpleNamespace(optimiser=lambda _j: job), link=None,  # type: ignore[arg-type]
        leases=None, commands=SimpleNamespace(command=command),  # type: ignore[arg-type]
        failures=None, progress=None)  # type: ignore[arg-type]
    executor.act = act  # type: ignore[method-assign]
    rows = tuple(PowerLimitMeasurement(power_limit=w, energy=1000.0 - w, time=1.0 + w / 1000)
                 for w in range(400, 100, -1))  # 300 limits: 101..400 W by 1 W
    await executor.ask_selector(record, AskSelector(0, 1, rows))  # type: ignore[arg-type]
    assert not sent
    assert len(told) == 1 and told[0][0] == 1 and "300 limits" in told[0][1], told
