"""Review of the job spread (rendezvous hashing): the roster of live replicas, on a real
nats-server.

Defects these tests prove (they fail on the code they were written against):

* A replica judges whether another is live with its *own* ownership lease (`Roster.ttl_s`), and
  ignores the period the other announces (`ReplicaAlive.period_s`). Replicas whose ownership
  leases differ (`--ownership-lease-s`, or `--lease-s`, which caps it at half) disagree on who
  is live: a replica announcing every 3.5 s (lease 10 s) drops out of the roster of one with a
  3 s lease between two announcements, and starts a new run each time, so it is never settled
  there (never handed a job) and the two compute different preferred replicas for its share.
* `Leases.warm` trusts the roster after 1.2 announcement periods ("every live replica has
  announced itself once by then"), but a replica announces on its ownership round (every 0.5 s,
  or lease_s / 3 if shorter) only once a full period has passed since the last: the gap is
  rounded up to the next round, up to a period and a round (1.5 s for a 3 s lease, 2 periods
  at the shortest leases). A replica starting up can thus be warm before it heard a live one,
  prefer itself for that one's jobs and take them (given back only after handover_after_s).
* Warm once, warm for ever: a replica that heard nobody for longer than the roster's ttl (after
  a NATS outage; a slow consumer) still trusts its roster of one and takes every job. (Fixed
  for a reconnection, which makes it listen afresh; the test now checks that.)

Fixed: the roster keeps each replica's own announced period, replicas announce on their own
timer (every period) and answer a new replica at once, and the warm-up is 1.5 periods.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import CoordinatorService
from coordinator.service.leases import WARM_PERIODS
from coordinator.state import records
from coordinator.state.assignment import preferred
from tests.shell.coordinator_kit import bucket_of, register_job, replicas, start, stop, wait_for
from zeus_agent.wire import subjects


@pytest.mark.timeout(90)
async def test_a_replica_with_a_longer_ownership_lease_is_never_settled_in_the_roster(
        nats_server: Any, tmp_path: Path) -> None:
    bucket = bucket_of(tmp_path)
    coords: dict[str, CoordinatorService] = {}
    tasks: dict[str, Any] = {}
    try:
        coords["short"], tasks["short"] = await start(
            nats_server, tmp_path / "short", replica_name="short", state_bucket=bucket,
            ownership_lease_s=3.0, handover_after_s=3.0)
        coords["long"], tasks["long"] = await start(
            nats_server, tmp_path / "long", replica_name="long", state_bucket=bucket,
            ownership_lease_s=10.0, handover_after_s=3.0)
        short = coords["short"]
        await wait_for(lambda: "long" in short.leases.live(), 10)
        live = samples = 0
        settled = False
        end = time.monotonic() + 8.0  # Over two of its announcement periods (3.3 s).
        while time.monotonic() < end:
            live += "long" in short.leases.live()
            samples += 1
            settled = settled or short.leases.roster.settled("long", time.monotonic())
            await asyncio.sleep(0.02)
        assert live == samples and settled, (
            f"'long' (announcing every {coords['long'].leases.period_s:g} s) was live in "
            f"'short''s roster {live}/{samples} of the time, settled: {settled}")
    finally:
        for name, task in tasks.items():
            await stop(coords[name], task)


@pytest.mark.timeout(60)
async def test_announcements_keep_their_period_and_a_new_replica_is_answered_at_once(
        nats_server: Any, nc: Any, tmp_path: Path) -> None:
    """Announcements come every period (their own timer), and a replica that starts hears the
    live ones before it trusts its roster: they answer a new replica at once, even one whose
    own period is long (here 3 s: a warm-up of WARM_S, 1 s, would otherwise miss it)."""
    bucket = bucket_of(tmp_path)
    slow, slow_task = await start(nats_server, tmp_path / "slow", replica_name="slow",
                                  state_bucket=bucket, ownership_lease_s=9.0)
    fast = fast_task = None
    try:
        heard: list[float] = []

        async def on_alive(msg: Any) -> None:
            heard.append(time.monotonic())

        sub = await nc.subscribe(subjects.replica_alive("slow"), cb=on_alive)
        await wait_for(lambda: len(heard) >= 3, 30)
        await sub.unsubscribe()
        gaps = [b - a for a, b in zip(heard, heard[1:], strict=False)]
        assert max(gaps) <= WARM_PERIODS * slow.leases.period_s, gaps
        fast, fast_task = await start(nats_server, tmp_path / "fast", replica_name="fast",
                                      state_bucket=bucket, ownership_lease_s=3.0)
        await wait_for(lambda: fast.leases.warm(), 5)
        assert fast.leases.live() == ["fast", "slow"], (
            "warm before it heard the live replica: it would prefer itself for that one's jobs")
    finally:
        if fast is not None:
            await stop(fast, fast_task)
        await stop(slow, slow_task)


@pytest.mark.timeout(90)
async def test_a_replica_reconnected_listens_afresh_before_it_trusts_its_roster(
        nats_server: Any, nc: Any, tmp_path: Path) -> None:
    """Warm once, warm for ever (the review's defect): a replica that missed announcements
    (a NATS outage) would trust a roster of itself and prefer itself for every job. After a
    reconnection it listens afresh: not warm (so it takes no job another replica may be
    preferred for, except by the fallback), then warm again with the others in its roster,
    and the jobs registered then go to their preferred replicas.

    (Not covered: a replica whose connection stays up but whose announcement subscription
    alone loses messages; docs/guides/replicas.md says so.)"""
    async with replicas(nats_server, tmp_path) as group:
        coords = group.coords
        r1, r2 = coords["r1"], coords["r2"]
        await wait_for(lambda: r1.leases.settled("r2") and r2.leases.settled("r1"), 15)
        await r2._reconnected()  # What BusHealth calls once NATS is back.
        assert not r2.leases.warm() and r2.leases.prefer("x" * 32) is None
        await wait_for(lambda: r2.leases.warm() and r2.leases.live() == ["r1", "r2"], 5)
        ids = [await register_job(nc, dp=1, job_metadata=f"back{i}") for i in range(16)]
        hashes = {records.job_hash(j): j for j in ids}
        await wait_for(lambda: all(any(c.book.owns(h, time.time()) for c in coords.values())
                                   for h in hashes), 10)
        now = time.time()
        wrong = {hashes[h]: name for h in hashes for name, c in coords.items()
                 if c.book.owns(h, now) and name != preferred(h, ["r1", "r2"])}
        assert not wrong, f"{len(wrong)} of {len(ids)} jobs on a replica not preferred: {wrong}"
