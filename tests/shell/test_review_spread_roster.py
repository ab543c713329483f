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
  a NATS outage; a slow consumer) still trusts its roster of one and takes every job.
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
from tests.shell.coordinator_kit import bucket_of, register_job, start, stop, wait_for
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
        await wait_for(lambda: "long" in short.leases.roster.live(time.time()), 10)
        live = samples = 0
        settled = False
        end = time.monotonic() + 12.0  # Over three of its announcement periods.
        while time.monotonic() < end:
            now = time.time()
            live += "long" in short.leases.roster.live(now)
            samples += 1
            settled = settled or short.leases.roster.settled("long", now)
            await asyncio.sleep(0.02)
        assert live == samples and settled, (
            f"'long' (announcing every {coords['long'].leases.period_s:g} s) was live in "
            f"'short''s roster {live}/{samples} of the time, settled: {settled}")
    finally:
        for name, task in tasks.items():
            await stop(coords[name], task)


@pytest.mark.timeout(60)
async def test_announcements_come_further_apart_than_the_warm_up_assumes(
        nats_server: Any, nc: Any, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "r1", replica_name="r1",
                              ownership_lease_s=3.0)
    try:
        heard: list[float] = []

        async def on_alive(msg: Any) -> None:
            heard.append(time.monotonic())

        sub = await nc.subscribe(subjects.replica_alive("r1"), cb=on_alive)
        await wait_for(lambda: len(heard) >= 12, 30)
        await sub.unsubscribe()
        gaps = [b - a for a, b in zip(heard, heard[1:], strict=False)]
        warm_after = WARM_PERIODS * coord.leases.period_s
        assert max(gaps) <= warm_after, (
            f"a replica is warm {warm_after:g} s after it first announced, but r1's "
            f"announcements came up to {max(gaps):.2f} s apart: {[round(g, 2) for g in gaps]}")
    finally:
        await stop(coord, task)


@pytest.mark.timeout(90)
async def test_a_replica_that_heard_nobody_for_a_lease_still_trusts_its_roster(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm once, warm for ever: a replica that heard no announcement for longer than the
    roster's ttl (a NATS outage, then the first seconds after its reconnection; a slow consumer
    whose messages the server dropped) has only itself in its roster and still calls it warm.
    It then prefers itself for every job: it takes every registration it answers and every job
    nobody holds, and gives the others' back only after handover_after_s (each restarting from
    its progress). Not warm until it has listened again, it would leave them to their
    preferred replicas."""
    kw = {"state_bucket": bucket_of(tmp_path), "ownership_lease_s": 3.0,
          "handover_after_s": 3.0}
    coords: dict[str, CoordinatorService] = {}
    tasks: dict[str, Any] = {}
    try:
        for name in ("r1", "r2"):
            coords[name], tasks[name] = await start(nats_server, tmp_path / name,
                                                    replica_name=name, **kw)
        r1, r2 = coords["r1"], coords["r2"]
        await wait_for(lambda: r1.leases.settled("r2") and r2.leases.settled("r1"), 15)
        # r2 hears nothing for longer than its roster's ttl (its announcements still go out).
        monkeypatch.setattr(r2.leases.roster, "heard", lambda *_: None)
        await wait_for(lambda: r2.leases.roster.live(time.time()) == ["r2"], 10)
        ids = [await register_job(nc, dp=1, job_metadata=f"deaf{i}") for i in range(16)]
        hashes = {records.job_hash(j): j for j in ids}
        await asyncio.sleep(1.0)
        now = time.time()
        wrong = {hashes[h]: name for h in hashes for name, c in coords.items()
                 if c.book.owns(h, now) and name != preferred(h, ["r1", "r2"])}
        assert not wrong, (
            f"r2 (warm: {r2.leases.warm(now)}, roster {r2.leases.roster.live(now)}) took "
            f"{len(wrong)} of {len(ids)} jobs r1 is preferred for")
    finally:
        for name, task in tasks.items():
            await stop(coords[name], task)
