"""Review of the job spread: a removed job's subscription, on a real nats-server.

Defect this proves (it fails on the code it was written against): when an idle job is removed,
its lease is purged from the ownership bucket with every error suppressed
(`JetStreamState.delete_hash`). If that purge fails (JetStream busy), the job is gone from the
replica's table but its lease stays in the book: the ownership loop renews it for ever, and
`OwnedStreams.reconcile`, which follows every lease this replica holds, keeps the removed
job's event subscription for ever (and follows it again if dropped). A replica also offers such
a lease in handovers, to a replica that does not know the job and never takes it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator.state import records
from tests.shell.coordinator_kit import register_job, start, stop, wait_for


@pytest.mark.timeout(60)
async def test_a_removed_job_whose_lease_purge_failed_keeps_its_subscription_for_ever(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coord, task = await start(nats_server, tmp_path / "r1", replica_name="r1",
                              ownership_lease_s=3.0, max_job_idle_time=2)
    try:
        owners = coord.link.require_state().owners
        real_purge = owners.purge

        async def purge(key: str) -> Any:
            if key in hashes:
                raise TimeoutError("JetStream did not answer")
            return await real_purge(key)

        hashes: set[str] = set()
        monkeypatch.setattr(owners, "purge", purge)
        job_id = await register_job(nc, dp=1, job_metadata="removed")
        hashes.add(records.job_hash(job_id))
        await wait_for(lambda: job_id in coord.owned, 5)
        await wait_for(lambda: job_id not in coord.jobs, 15)  # Removed as idle.
        held = coord.book.leases.get(records.job_hash(job_id))
        revision = held.revision if held is not None else None
        await asyncio.sleep(2.0)  # (The ownership loop runs a few rounds.)
        lease = coord.book.leases.get(records.job_hash(job_id))
        assert job_id not in coord.owned and (lease is None or lease.revision == revision), (
            f"the removed job's events are still followed ({job_id in coord.owned}) and its "
            f"lease renewed ({revision} -> {lease})")
    finally:
        await stop(coord, task)
