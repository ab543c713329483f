"""Review of the job spread (rendezvous hashing): handovers, against a real nats-server.

Defects these tests prove (they fail on the code they were written against):

* A job is handed over to its preferred replica whether or not that replica can take it. A
  replica that announces itself but whose lease writes fail (its JetStream requests time out,
  it does not know the job) never takes it; a lease later another replica takes it (the
  fallback) and, in the same ownership round, hands it straight back: nobody drives the job,
  ever. (Measured: worse still, the giver renews the lease it gave up every lease_s / 3, which
  restarts the job's unowned clock, so the fallback never even comes: the lease flips between
  "r1, live" and "r1, given up" twice a second, r1 never drives it, nobody says so;
  tests/core/test_review_spread_ownership.py.)
* A handover gives the lease up even when the job's latest progress could not be recorded
  (JetStream refused the write): the next owner resumes from older progress, and the giver
  drops the unsaved progress once the other replica holds the job.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.state import records
from coordinator.state.assignment import preferred
from coordinator.state.jetstream import StateUnavailableError
from tests.shell.coordinator_kit import collect, register_job, replicas, wait_for
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus

LEASE_S = 3.0


async def jobs_preferring(nc: Any, name: str, among: list[str], count: int) -> list[str]:
    """Register jobs until `count` of them prefer `name` among `among`; their ids."""
    found: list[str] = []
    for i in range(200):
        job_id = await register_job(nc, dp=1, job_metadata=f"review{i}")
        if preferred(records.job_hash(job_id), among) == name:
            found.append(job_id)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} jobs preferring {name}")


@pytest.mark.timeout(90)
async def test_job_handed_back_forever_to_a_live_replica_that_cannot_take_it(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with replicas(nats_server, tmp_path, lease_s=LEASE_S) as group:
        r1, r2 = group["r1"], group["r2"]
        await wait_for(lambda: r1.leases.warm() and r2.leases.warm()
                       and r1.leases.settled("r2") and r2.leases.settled("r1"), 15)

        async def no_take(job_hash: str, value: bytes, revision: int) -> int | None:
            return None  # JetStream does not answer r2's lease writes (it still announces).

        monkeypatch.setattr(r2.link.require_state(), "take", no_take)
        statuses = await collect(nc, subjects.all_job_status(), JobStatus)
        ids = await jobs_preferring(nc, "r2", ["r1", "r2"], 2)
        hashes = [records.job_hash(j) for j in ids]
        registered = time.monotonic()
        # A lease later r1 takes them (nobody took them): a sound r1 keeps driving them while
        # r2 cannot. Sampled from 1.5 leases after the registration for 2 leases.
        await asyncio.sleep(1.5 * LEASE_S - (time.monotonic() - registered))
        held = total = 0
        end = time.monotonic() + 2 * LEASE_S
        while time.monotonic() < end:
            now = time.time()
            held += sum(1 for h in hashes if r1.book.owns(h, now) or r2.book.owns(h, now))
            total += len(hashes)
            await asyncio.sleep(0.02)
        taken = [s for s in statuses if s.state == "taken_over" and s.job_id in ids]
        assert held / total >= 0.8, (
            f"the jobs were driven {held}/{total} of the samples; taken over {len(taken)} "
            f"times in {2 * LEASE_S:g} s: {[s.message for s in taken][:4]}")


@pytest.mark.timeout(90)
async def test_handover_gives_a_job_up_before_its_latest_progress_is_recorded(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with replicas(nats_server, tmp_path, ["r1"], lease_s=LEASE_S) as group:
        r1 = group["r1"]
        await wait_for(lambda: r1.leases.warm(), 10)
        [job_id] = await jobs_preferring(nc, "r2", ["r1", "r2"], 1)
        await wait_for(lambda: r1.leases.owns(job_id), 5)

        # The job's latest progress, which JetStream cannot take for now (a leader election).
        state = r1.link.require_state()
        real_put = state.put_progress
        failing = True

        async def put_progress(job_id_: str, kind: str, value: Any, **kw: Any) -> None:
            if failing:
                raise StateUnavailableError("stream leader election")
            await real_put(job_id_, kind, value, **kw)

        monkeypatch.setattr(state, "put_progress", put_progress)
        latest = {"measured": [[300, 1000.0, 10.0], [250, 700.0, 10.5]], "next": 200}
        r1.progress.save_progress(job_id, "windows", latest)
        await asyncio.sleep(0.2)
        assert r1.jobs.driver(job_id).unsaved is not None

        r2 = await group.add("r2")
        # r2 settles in r1's roster: the job is r2's to drive, once its progress is recorded.
        await wait_for(lambda: r1.leases.settled("r2"), 15)
        await asyncio.sleep(LEASE_S)
        failing = False  # JetStream takes writes again.
        await wait_for(lambda: r2.leases.owns(job_id), 15)
        recorded = await r2.link.require_state().get_progress(job_id)
        assert recorded == {"kind": "windows", "state": latest} or (
            recorded is not None and recorded.get("state") == latest), (
            f"r2 took the job over from progress {recorded!r}, not the latest ({latest!r})")
