"""Review of the job spread (rendezvous hashing): trainer events, on a real nats-server.

Defect this proves (it fails on the code it was written against): a job registered through a
replica it does not prefer is not taken before the registration is answered; its preferred
replica takes it (and subscribes to its events) only once the job's record reaches it through
the state bucket's watch. Events its ranks send in between reach nobody. Before the spread,
the registrar took the lease before answering, and every replica followed every job's events,
so none was lost; now the first events of about half the jobs (those registered through a
replica they do not prefer) can be.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordinator.state import records
from coordinator.state.assignment import preferred
from tests.shell.coordinator_kit import NODE, register_job, replicas
from zeus_agent.wire import subjects

LEASE_S = 3.0
JOBS = 24


@pytest.mark.timeout(90)
async def test_events_sent_right_after_a_registration_reach_no_replica(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with replicas(nats_server, tmp_path, lease_s=LEASE_S) as group:
        await group.all_live()
        coords = group.coords
        heard: Counter[str] = Counter()
        for coord in coords.values():
            real = coord.streams.on_events

            async def counting(msg: Any, real: Any = real) -> None:
                where = subjects.parse_job_events(msg.subject)
                heard[where.job if where is not None else ""] += 1
                await real(msg)

            monkeypatch.setattr(coord.streams, "on_events", counting)
        ids = []
        for i in range(JOBS):
            job_id = await register_job(nc, dp=1, job_metadata=f"ev{i}")
            ids.append(job_id)
            # Rank 0's first events, as its agent relays them once the trainer runs.
            await nc.publish(subjects.job_events(job_id, 0, NODE), b"{}")
        await nc.flush()
        await asyncio.sleep(1.0)
        hashes = {records.job_hash(j): j for j in ids}
        assert all(any(c.book.owns(h, time.time()) for c in coords.values()) for h in hashes)
        lost = [j for j in ids if heard[subjects.token(j)] == 0]
        assert not lost, (
            f"{len(lost)} of {JOBS} jobs' first events reached no replica; of them "
            f"{sum(1 for j in lost if preferred(records.job_hash(j), ['r1', 'r2']) == 'r2')} "
            "prefer r2")
