"""Jobs stay with a live owner that renews late, against a real nats-server (issue 39 item 4).

Defect (`bench/idle_jobs.py --pin-cpu 0 --ownership-lease-s 3`: two replicas on one core, 4,000
idle jobs): a saturated replica's announcements came late (the other dropped it from its
roster, so preferred itself for every job) and some of its renewals landed after their lease
had ended, while others kept landing; the other replica took those jobs at once. 31,430
`taken_over` statuses for 4,000 jobs in 5 minutes. Here r1's announcements stop and half its
renewals take 0.8 of a lease to land (each lease of that half lapses for a while every
round): no job may change owner. Transitions are counted, not timed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from coordinator.service.leases import Leases
from coordinator.state import records
from tests.shell.coordinator_kit import collect, register_job, replicas, wait_for
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus

JOBS = 16
LEASE_S = 3.0


async def test_a_live_owner_renewing_late_keeps_its_jobs(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: Any) -> None:
    quiet: set[str] = set()
    announce = Leases.announce

    async def announcing(self: Leases, leaving: bool = False) -> None:
        if self.book.me not in quiet:
            await announce(self, leaving)

    monkeypatch.setattr(Leases, "announce", announcing)
    async with replicas(nats_server, tmp_path, lease_s=LEASE_S) as group:
        r1, r2 = group["r1"], group["r2"]
        await group.all_live()
        ids = [await register_job(nc, dp=1, job_metadata=f"flap{i}") for i in range(JOBS)]
        hashes = [records.job_hash(j) for j in ids]
        await wait_for(lambda: all(r1.book.owns(h, time.time()) or r2.book.owns(h, time.time())
                                   for h in hashes), 10)
        mine = sorted(h for h in hashes if r1.book.owns(h, time.time()))
        assert len(mine) >= 2, "rendezvous hashing gave r1 too few jobs for this test"
        slow = set(mine[::2])
        owners = {h: r1.book.leases[h].owner for h in hashes}
        statuses = await collect(nc, subjects.all_job_status(), JobStatus)
        state = r1.link.require_state()
        take = state.take
        lapsed = 0

        async def late(job_hash: str, value: bytes, revision: int) -> int | None:
            nonlocal lapsed
            if job_hash in slow:  # A saturated replica: the write lands after its lease ends.
                lease = r1.book.leases.get(job_hash)
                await asyncio.sleep(0.8 * LEASE_S)
                lapsed += lease is not None and time.time() >= lease.until
            return await take(job_hash, value, revision)

        state.take = late  # type: ignore[method-assign]
        quiet.add("r1")  # r2 drops r1 from its roster after 3 periods: it prefers itself.
        await wait_for(lambda: r2.leases.live() == ["r2"], 10)
        # Until each slow lease lapsed twice (or a job moved: a failure).
        await wait_for(lambda: lapsed >= 2 * len(slow)
                       or any(s.state == "taken_over" for s in statuses), 30)
        moved = [s for s in statuses if s.state == "taken_over"]
        assert moved == [], [s.message for s in moved]
        now = time.time()
        assert all(not r2.book.owns(h, now) for h in mine)
        assert {h: r2.book.leases[h].owner for h in hashes} == owners
        state.take = take  # type: ignore[method-assign]
        quiet.clear()
