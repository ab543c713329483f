"""Reproducers from an adversarial review of the join tokens (a job's ranks must present the
secret rank 0 got with the job id): each test asserts the safe behaviour and fails while the
defect it names is present.

Real processes: an embedded `nats-server`, `zeus-coordinator run`, `zeus-agent run --backend
sim` on two simulated nodes (`adversarial_kit.running_cluster`, a `SimCluster`), and trainers
speaking the datagram protocol on the agents' sockets; trainers that the agent must tell apart
(by the kernel's pid) run as child processes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.e2e.adversarial_kit import (
    DEFAULT_W,
    Raw,
    bye_everywhere,
    running_cluster,
    spawn_rank,
)
from zeus_agent.broker import connect
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobQuery, Reply
from zeus_agent.wire.trainer import Kind
from zeus_demo.cluster import SimCluster, kill_group, wait_for_async

pytestmark = pytest.mark.timeout(90)


cluster_fixture = pytest.fixture(scope="module", name="cluster")(running_cluster)


def register_job(cluster: SimCluster, dp: int, metadata: str) -> tuple[str, str]:
    """Register a power-limit job through node a; returns its id and join token."""
    r = Raw(cluster.socket_path("a"))
    job = {"job": {"dp_degree": dp, "pp_degree": 1, "tp_degree": 1, "world_size": dp,
                   "job_metadata": metadata},
           "power_limit": {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 3,
                           "pl_step_w": 100}}
    try:
        registered = r.req(Kind.REGISTER_JOB, job).result
    finally:
        r.close()
    return registered["job_id"], registered["join_token"]


async def _power_limit_progress(nc: Any, job_id: str) -> dict[str, Any] | None:
    """The job's power-limit optimiser progress as a query shows it (None: not started)."""
    raw = await nc.request(subjects.coord_job_query(), codec.encode(JobQuery(job_id=job_id)),
                           timeout=5)
    reply = codec.decode(raw.data, Reply)
    assert reply.ok, reply
    progress = reply.result.get("power_limit")
    return progress if isinstance(progress, dict) else None


async def _wait_progress(nc: Any, job_id: str, done: Any, timeout_s: float, what: str) -> Any:
    last: list[dict[str, Any] | None] = [None]

    async def reached() -> dict[str, Any] | None:
        last[0] = progress = await _power_limit_progress(nc, job_id)
        return progress if progress is not None and done(progress) else None

    return await wait_for_async(
        reached, timeout_s, lambda: f"timed out waiting for {what}; progress: {last[0]}",
        interval_s=0.1)


async def _steps_pace_nothing(intruder: Raw, nc: Any, job_id: str, what: str) -> None:
    """The intruder sends 8 steps; the job's power-limit search must not move."""
    for step in range(8):
        intruder.event(Kind.STEP_BEGIN, step)
    await asyncio.sleep(1.5)
    progress = await _power_limit_progress(nc, job_id)
    assert progress is not None and progress["phase"] == "Ready", (
        f"a process that knows only the job id {what}: {progress}")


async def test_a_process_knowing_only_the_job_id_cannot_speak_as_its_rank(
    cluster: SimCluster,
) -> None:
    """The agent binds a GPU to (job, rank) on HELLO, which carries no token; the coordinator
    took a rank's events from any GPU of the node the rank is bound to (its marks and errors
    only from the rank's own GPU). So a process of the job's user on that node that knows only
    the job id said HELLO as rank 0 on a free GPU and its step events paced the job's
    power-limit search (which commands every GPU of the job), while the real rank 0 was silent:
    the join token was not needed to speak for a rank, only to register one."""
    job_id, token = register_job(cluster, 1, "silent-victim")
    # The intruder: the job's user on the node of rank 0, on a GPU of its own (no token). It
    # says HELLO before rank 0 registers (later, the agent, which then relayed rank 0 with the
    # job's token, refuses a HELLO without it: checked below), so its binding stands.
    intruder = Raw(cluster.socket_path("a"))
    assert intruder.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 1}).ok
    victim = spawn_rank(cluster, (job_id, token), 0, "a", 0, steps=6, bye_at=None,
                        period=0.1)
    nc = await connect(cluster.url, "join-token-review")
    try:
        line = json.loads(victim.stdout.readline())  # type: ignore[union-attr]
        assert line["hello"] and line["rank"], line
        await _wait_progress(nc, job_id, lambda p: p["phase"] == "Ready", 15,
                             "the job's optimiser to start")
        late = Raw(cluster.socket_path("a"))
        try:
            refused = late.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 2})
            assert (refused.ok, refused.code) == (False, "forbidden"), refused
        finally:
            late.close()
        await _steps_pace_nothing(intruder, nc, job_id, "paced its power-limit search as rank 0 "
                                  "(from GPU 1 of rank 0's node; rank 0 drives GPU 0 and sent "
                                  "nothing)")
        assert cluster.gpu_limit("a", 0) == DEFAULT_W  # rank 0's GPU was not commanded either
        # The real rank 0 (its own GPU) still paces it.
        victim.stdin.write(b"go\n")  # type: ignore[union-attr]
        victim.stdin.flush()  # type: ignore[union-attr]
        await _wait_progress(nc, job_id, lambda p: p["phase"] != "Ready", 15,
                             "rank 0's own steps to pace the search")
    finally:
        intruder.close()
        await nc.close()
        kill_group(victim)
        bye_everywhere(cluster)


async def test_a_departed_ranks_gpu_cannot_be_taken_over_with_the_job_id_alone(
    cluster: SimCluster,
) -> None:
    """Rank 0 (node a, GPU 0) dies; rank 1 (node b) is still running. A process of the job's
    user on node a that knows only the job id said HELLO as rank 0 on GPU 0 (its trainer was
    gone, so the agent let it) and sent steps: the coordinator took them as rank 0's, paced
    the power-limit search on them and commanded rank 1's GPU on node b. Now an agent that
    relayed a rank of the job with its join token refuses a HELLO for the job without it;
    a restarted rank 0 (with the token) binds the GPU again."""
    job_id, token = register_job(cluster, 2, "departed-rank-0")
    ranks = [spawn_rank(cluster, (job_id, token), 0, "a", 0, steps=0, bye_at=None),
             spawn_rank(cluster, (job_id, token), 1, "b", 0, steps=0, bye_at=None)]
    intruder = Raw(cluster.socket_path("a"))
    nc = await connect(cluster.url, "join-token-review")
    try:
        for p in ranks:
            line = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            assert line["hello"] and line["rank"], line
        await _wait_progress(nc, job_id, lambda p: p["phase"] == "Ready", 15,
                             "the job's optimiser to start")
        kill_group(ranks[0])  # rank 0 dies; rank 1 goes on
        hello = intruder.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0})
        assert (hello.ok, hello.code) == (False, "forbidden"), hello
        assert "join token" in hello.error
        guessed = intruder.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0,
                                            "join_token": "a-guessed-join-token-0000"})
        assert (guessed.ok, guessed.code) == (False, "forbidden"), guessed
        refused = intruder.req(Kind.REGISTER_RANK, {
            "job_id": job_id, "rank_info": {"rank": 0, "dp_rank": 0, "pp_rank": 0,
                                            "tp_rank": 0, "available_frequencies": []},
            "gpu": {"node": "a", "gpu_index": 0}})
        assert (refused.ok, refused.code) == (False, "forbidden")  # no token: no rank
        await _steps_pace_nothing(intruder, nc, job_id,
                                  "spoke as its departed rank 0 and paced the power-limit search")
        assert cluster.gpu_limit("b", 0) == DEFAULT_W  # rank 1's GPU not commanded on its steps
        # Rank 0 restarted by its launcher (it has the token) takes its GPU back.
        back = Raw(cluster.socket_path("a"))
        try:
            rejoined = back.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0,
                                             "join_token": token})
            assert rejoined.ok, rejoined
        finally:
            back.close()
    finally:
        intruder.close()
        await nc.close()
        for p in ranks:
            kill_group(p)
        bye_everywhere(cluster)
