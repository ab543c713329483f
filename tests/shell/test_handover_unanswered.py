"""A handover whose give-up lands unanswered leaves one driver, against a real nats-server.

Defect (review31, found with the model in tests/core/test_ownership_adversary.py): a replica
handing a job over wrote its give-up (`until` 0) and, told nothing (`JetStreamState.take` gives
None on a timeout, when the write may have landed), kept its lease as its own: the preferred
replica took the job at once while the giver, its ownership watch lagging, still counted it as
driven here (`owns`) until its next renewal failed. Now a give-up not answered is taken as
given (`OwnershipBook.gave_up`). Transitions are checked, not timed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coordinator.service.durable import DurableState
from coordinator.state import records
from tests.shell.coordinator_kit import register_job, replicas, wait_for

JOBS = 8


async def test_a_give_up_not_answered_is_not_driven_by_the_giver(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: Any) -> None:
    lagging: set[str] = set()
    follow = DurableState.on_owner_entry

    async def watch(self: DurableState, entry: Any) -> None:
        if self.book.me not in lagging:  # (Its ownership watch lags: nothing comes.)
            await follow(self, entry)

    monkeypatch.setattr(DurableState, "on_owner_entry", watch)
    async with replicas(nats_server, tmp_path, names=("r1",)) as group:
        r1 = group["r1"]
        ids = [await register_job(nc, dp=1, job_metadata=f"hand{i}") for i in range(JOBS)]
        hashes = [records.job_hash(j) for j in ids]
        await wait_for(lambda: all(r1.book.owns(h, time.time()) for h in hashes), 10)
        state = r1.link.require_state()
        take = state.take

        async def unanswered(job_hash: str, value: bytes, revision: int) -> int | None:
            landed = await take(job_hash, value, revision)
            return None if b'"until": 0.0' in value else landed  # A give-up: not answered.

        state.take = unanswered  # type: ignore[method-assign]
        lagging.add("r1")
        r2 = await group.add("r2")
        # r2 settles (handover_after_s), r1 gives it its share, r2 takes it at once.
        await wait_for(lambda: any(r2.book.owns(h, time.time()) for h in hashes), 20)
        now = time.time()
        both = [h for h in hashes if r2.book.owns(h, now) and r1.book.owns(h, now)]
        assert both == [], f"{len(both)} jobs driven by both replicas"
        state.take = take  # type: ignore[method-assign]
        lagging.clear()
