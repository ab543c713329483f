"""Jobs shared out among coordinator replicas by rendezvous hashing, against a real nats-server.

Three replicas share one state bucket. Jobs registered through the queue group (whichever
replica answers) end up driven by the replica rendezvous hashing prefers among those live, each
replica following the trainer events of its own jobs only; a replica that joins is handed its
share once settled (and only its share moves); one that leaves gives its jobs to the others at
once, each to its preferred replica.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coordinator.service import CoordinatorService
from coordinator.state import records
from coordinator.state.assignment import preferred
from tests.shell.coordinator_kit import collect, register_job, replicas, wait_for
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus

JOBS = 40
LEASE_S = 3.0
"""Ownership lease: announcements and renewals every second, a roster warm after 1.2 s."""


def owners(coords: dict[str, CoordinatorService], hashes: list[str]) -> dict[str, str | None]:
    """Job hash -> the replica that drives it now (None: none)."""
    now = time.time()
    out: dict[str, str | None] = {}
    for h in hashes:
        held = [name for name, c in coords.items() if c.book.owns(h, now)]
        assert len(held) <= 1, (h, held)  # Never two.
        out[h] = held[0] if held else None
    return out


def following(coord: CoordinatorService) -> set[str]:
    """Job hashes whose trainer events this replica subscribes to."""
    return {records.job_hash(j) for j in coord.owned._subs}


async def test_jobs_spread_by_rendezvous_hashing_and_follow_joins_and_leaves(
        nats_server: Any, nc: Any, tmp_path: Path) -> None:
    async with replicas(nats_server, tmp_path, lease_s=LEASE_S) as group:
        coords = group.coords
        await group.all_live()
        statuses = await collect(nc, subjects.all_job_status(), JobStatus)
        ids = [await register_job(nc, dp=1, job_metadata=f"spread{i}") for i in range(JOBS)]
        hashes = [records.job_hash(j) for j in ids]
        two = {h: preferred(h, ["r1", "r2"]) for h in hashes}
        await wait_for(lambda: owners(coords, hashes) == two, 10)
        assert 0 < sum(1 for o in two.values() if o == "r1") < JOBS
        # Each replica follows the events of its own jobs, and only those.
        await wait_for(lambda: all(following(c) == {h for h, o in two.items() if o == name}
                                   for name, c in coords.items()), 5)

        # Registered through either, each taken by its preferred replica at once: none moved.
        assert [s for s in statuses if s.state == "taken_over"] == []

        # A third replica joins: once settled it is handed its share; nothing else moves.
        await group.add("r3")
        three = {h: preferred(h, ["r1", "r2", "r3"]) for h in hashes}
        moved = {h for h in hashes if three[h] != two[h]}
        assert moved and all(three[h] == "r3" for h in moved)
        await wait_for(lambda: owners(coords, hashes) == three, 15)
        await wait_for(lambda: following(coords["r3"]) == moved, 5)
        # Each moved job says so: handed over, not taken from a dead replica.
        await wait_for(lambda: {records.job_hash(s.job_id) for s in statuses
                                if s.state == "taken_over"} >= moved, 5)
        said = [s.message for s in statuses if s.state == "taken_over"]
        assert all("coordinator replica r3 drives the job now (replica " in m
                   and "handed it over" in m for m in said), said

        # It leaves: its jobs go back at once (it says so), not a lease later.
        left_at = time.monotonic()
        await group.remove("r3")
        await wait_for(lambda: owners(coords, hashes) == two, 10)
        assert time.monotonic() - left_at < LEASE_S, "its jobs waited for its leases to end"
        await wait_for(lambda: all(following(c) == {h for h, o in two.items() if o == name}
                                   for name, c in coords.items()), 5)
