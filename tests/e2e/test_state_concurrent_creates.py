"""Writers racing for one key of the state bucket, on a 3-server NATS cluster (R3 buckets).

`bench/cluster_scale.py` found two failures with 2 coordinator replicas, both from creates of
one key racing:

1. Concurrent creates of one key (two replicas giving two jobs the same id) failed with
   `unavailable (KeyNotFoundError)`: on a clustered stream the leader refuses a create while
   another write of that key is still being replicated (error 10164, "wrong last sequence"
   with no sequence), and nats-py's `KeyValue.create`, looking the key up for a delete marker,
   found nothing and raised `KeyNotFoundError`. Each race now has one winner and one clean
   loser (`create_job` False, `create_rank` False for the same rank), never an error.
2. Same-shaped jobs registered in one second on two replicas collided on their ids until one
   answered `unavailable: could not give the job a unique id; retry`. Every registration now
   gets an id of the documented form (`<second>+dp+pp+tp+Scheduler[+meta]`, then `+2`, `+3`,
   ... when taken), unique across the replicas, and both replicas' views hold every job.

Both need the cluster: a single server stores a write before it answers the next, so neither
race happens there. About 15 s on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from coordinator.jobs import JobRegistry, RankRecord
from coordinator.state import jetstream
from coordinator.state.jetstream import JetStreamState
from tests.shell.coordinator_kit import start, stop
from zeus_agent.broker import connect
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import GpuBinding, PowerLimitOptions, RegisterJob
from zeus_demo.cluster import NatsCluster, processes_with_mark, wait_for_async

ROUNDS = 30
"""Races of each kind (nearly every one hits a write in flight on a 3-server cluster)."""
JOBS_PER_REPLICA = 24
SECOND = datetime(2026, 12, 6, 13, 0, 0)
"""The wall-clock second every job of the id test is registered in."""


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A started 3-server NATS cluster, shared by the module; killed and removed after."""
    nats = NatsCluster()
    try:
        nats.start()
        yield nats
    finally:
        nats.close()
    assert processes_with_mark(nats.procs.mark) == []


def job(registry: JobRegistry, second: int) -> Any:
    """A new job record (a one-rank power-limit job, its id stamped with `second`)."""
    request = RegisterJob(job=JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1),
                          power_limit=PowerLimitOptions())
    return registry.register_job(request, 0.0, "node-a", SECOND.replace(second=second))


async def test_concurrent_creates_of_one_key_have_one_winner_and_no_error(
        cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes: Counter[str] = Counter()
    classify = jetstream.create_outcome

    def counted(ack: bytes) -> str:
        outcomes[outcome := classify(ack)] += 1
        return outcome

    monkeypatch.setattr(jetstream, "create_outcome", counted)
    ncs = [await connect(cluster.url(i), f"writer-{i}") for i in (0, 1)]
    try:
        states = [JetStreamState(nc, "zeus", replicas=3, bucket="races") for nc in ncs]
        for state in states:
            await state.open()

        async def race(calls: list[Any]) -> list[Any]:
            return sorted(await asyncio.gather(*calls, return_exceptions=True), key=repr)

        registry = JobRegistry()
        rank = RankRecord(RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                                   available_frequencies=[]),
                          GpuBinding(node="node-a", gpu_index=0))
        for i in range(ROUNDS):
            record = job(registry, i)
            assert await race([s.create_job(record) for s in states]) == [False, True]
            assert await race([s.create_rank(record.job_id, rank) for s in states]) == [
                False, True]
        # The race was run: some creates met the other's write still in flight.
        assert outcomes[jetstream.IN_FLIGHT] > 0, outcomes
        # A job, a GPU, a rank per round: a rank's two keys in one atomic batch (group commit),
        # the loser's batch refused and sorted out one key at a time.
        batched = sum(s.batches.batches for s in states if s.batches is not None)
        assert outcomes[jetstream.CREATED] + 2 * batched == 3 * ROUNDS, (outcomes, batched)

        # A key deleted (a job removed) is created again over its delete marker.
        await states[0].delete_job(record.job_id)
        assert await states[1].create_job(record) is True
        assert (await states[0].get_job(record.job_id)) is not None
    finally:
        for nc in ncs:
            await nc.close()


async def test_same_shaped_jobs_in_one_second_on_two_replicas_get_unique_ids(
        cluster: NatsCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Frozen(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return SECOND

    monkeypatch.setattr("coordinator.service.endpoints.datetime", Frozen)

    class Server:
        def __init__(self, url: str) -> None:
            self.url = url

    kw: dict[str, Any] = {"state_replicas": 3, "state_bucket": "ids"}
    replicas = [await start(Server(cluster.url(i)), tmp_path / f"r{i}",
                            replica_name=f"r{i}", **kw) for i in (0, 1)]
    try:
        request = codec.encode(RegisterJob(
            job=JobInfo(dp_degree=8, pp_degree=1, tp_degree=1, world_size=8),
            power_limit=PowerLimitOptions()))
        subject = subjects.coord_register_job("node-a")
        replies = await asyncio.gather(*(
            coord.endpoints.register_job(request, subject)
            for _ in range(JOBS_PER_REPLICA) for coord, _ in replicas))
        assert [r.error for r in replies if not r.ok] == []
        ids = [str(r.result["job_id"]) for r in replies]
        assert len(set(ids)) == len(ids) == 2 * JOBS_PER_REPLICA
        base = "2026-12-06-13-00-00+dp8+pp1+tp1+PowerLimitOptimizer"
        form = re.compile(re.escape(base) + r"(\+[0-9]+)?")
        assert all(form.fullmatch(i) for i in ids), ids
        assert base in ids

        # Every replica's view, and the bucket, hold every job once.
        async def known_everywhere() -> bool:
            return all(set(ids) <= set(coord.jobs.ids()) for coord, _ in replicas)

        await wait_for_async(known_everywhere, 10.0)
        state = replicas[0][0].link.require_state()
        assert set(await state.read_jobs()) == set(ids)
    finally:
        for coord, task in replicas:
            await stop(coord, task)
