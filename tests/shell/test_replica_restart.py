"""Coordinator replicas restarted, duplicated or cut off, against a real nats-server and agent.

Regressions (issue 33, item 5):
* `/healthz`'s `owned` (and the `zeus_coordinator_jobs_owned` metric) counted leases that had
  run out: a replica cut off from NATS went on reporting the jobs another replica drove.
* A lease named its owner by replica name only, so a process started under the name of a
  live (or frozen) one drove that one's jobs at once, both commanding their GPUs. A lease now
  names the process (its incarnation); a process restarted under the same name takes its
  predecessor's jobs at once only when its lock file (`ReplicaSeat`) proves that process gone,
  and waits the lease out otherwise, as a replica under another name does.

A crash is `crash()`: the replica stops without giving its leases up; a dead process's lock is
dropped (as the kernel does at exit), a frozen one's is kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from coordinator import metrics
from coordinator.service import CoordinatorService
from coordinator.service.leases import SEAT_HISTORY, ReplicaSeat
from coordinator.state import records
from tests.shell.coordinator_kit import (
    NODE,
    ask,
    collect,
    rank_request,
    register_job,
    stall,
    start,
    stop,
    wait_for,
)
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import JobStatus, PowerLimitOptions


async def running_job(nc: Any, coord: CoordinatorService) -> str:
    """A power-limit job with both ranks in, its optimiser running on `coord`."""
    options = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2)
    job_id = await register_job(nc, dp=2, power_limit=options)
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    return job_id


async def crash(coord: CoordinatorService, task: asyncio.Task, frozen: bool = False) -> None:
    """Stop `coord` without giving its leases up (they stay in the bucket until they run out).

    Its lock is dropped as a dead process's is; `frozen`: kept, as a stopped (SIGSTOP) or
    hung process keeps it.
    """
    async def dies() -> None:
        if not frozen:
            coord.leases.seat.release()

    coord.replicas.give_up_jobs = dies  # type: ignore[method-assign]
    await stop(coord, task)


def owned(coord: CoordinatorService) -> tuple[int, int]:
    """What `/healthz` and `/metrics` report as owned."""
    return coord.health()[1]["owned"], metrics.snapshot(coord).owned


def takeovers(statuses: list[JobStatus], job_id: str) -> list[str]:
    return [s.message for s in statuses if s.job_id == job_id and s.state == "taken_over"]


async def test_a_replica_restarted_under_its_name_resumes_its_jobs_at_once(
        nats_server, agent, nc, tmp_path) -> None:
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    state = tmp_path / "state"
    kw: dict[str, Any] = {"replica_name": "coord-a", "ownership_lease_s": 30.0, "lease_s": 60.0}
    old, task = await start(nats_server, state, **kw)
    job_id = await running_job(nc, old)
    job_hash = records.job_hash(job_id)
    await crash(old, task)
    lease = old.book.leases[job_hash]
    assert lease.incarnation == old.book.incarnation
    assert lease.until - time.time() > 15  # (renewed every 10 s: at least 20 s were left)

    new, task = await start(nats_server, state, **kw)
    try:
        assert new.book.incarnation != old.book.incarnation
        await wait_for(lambda: job_id in new.optimisers, timeout_s=30)
        resumed_at = time.time()
        assert resumed_at < lease.until - 10  # well before the old lease would have ended
        held = new.book.leases[job_hash]
        assert (held.owner, held.incarnation) == ("coord-a", new.book.incarnation)
        assert owned(new) == (1, 1)
        await wait_for(lambda: takeovers(statuses, job_id))
        assert f"its previous process (incarnation {old.book.incarnation}) is gone" in (
            takeovers(statuses, job_id)[0])
    finally:
        await stop(new, task)


async def test_a_replica_under_another_name_still_waits_out_the_lease(
        nats_server, agent, nc, tmp_path) -> None:
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    state = tmp_path / "state"
    old, task = await start(nats_server, state, replica_name="coord-a", ownership_lease_s=3.0)
    job_id = await running_job(nc, old)
    await crash(old, task)
    until = old.book.leases[records.job_hash(job_id)].until

    new, task = await start(nats_server, state, replica_name="coord-b", ownership_lease_s=3.0)
    try:
        await wait_for(lambda: job_id in new.optimisers, timeout_s=15)
        assert time.time() >= until  # (one host, one clock: taken only once it ran out)
        assert "replica coord-a stopped renewing its lease" in takeovers(statuses, job_id)[0]
    finally:
        await stop(new, task)


async def test_a_replica_restarted_while_its_old_process_is_frozen_waits_out_the_lease(
        nats_server, agent, nc, tmp_path) -> None:
    """The old process still holds the lock (stopped, hung): nothing proves it gone, so its
    successor waits its lease out, like a replica under another name; meanwhile it neither
    drives nor counts the job."""
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    state = tmp_path / "state"
    kw: dict[str, Any] = {"replica_name": "coord-a", "ownership_lease_s": 3.0}
    old, task = await start(nats_server, state, **kw)
    job_id = await running_job(nc, old)
    await crash(old, task, frozen=True)
    until = old.book.leases[records.job_hash(job_id)].until

    new, task = await start(nats_server, state, **kw)
    try:
        assert not new.leases.seat.held
        while time.time() < until - 0.5:
            assert job_id not in new.optimisers and not new.owns(job_id)
            assert owned(new) == (0, 0)
            await asyncio.sleep(0.05)
        await wait_for(lambda: job_id in new.optimisers, timeout_s=15)
        assert time.time() >= until
        assert "replica coord-a stopped renewing its lease" in takeovers(statuses, job_id)[0]
    finally:
        await stop(new, task)
        old.leases.seat.release()


async def test_two_live_processes_under_one_name_never_both_drive_a_job(
        nats_server, agent, nc, tmp_path, caplog) -> None:
    """Before: the second process owned every job of the first at once (same name), and both
    drove them. Each keeps its own state directory (as on two hosts). The lease is long enough
    (3 s: renewed every 1 s, acted on for 2 s after each) that a loaded CI host delaying one
    renewal does not fence the first process's own job (a 1.5 s lease did, once in CI)."""
    kw: dict[str, Any] = {"replica_name": "coord-a", "ownership_lease_s": 3.0}
    first, first_task = await start(nats_server, tmp_path / "host-1", **kw)
    job_id = await running_job(nc, first)
    second, second_task = await start(nats_server, tmp_path / "host-2",
                                      state_bucket=first.settings.state_bucket, **kw)
    try:
        assert second.leases.seat.held  # (another host's lock: proves nothing about first)
        loop = asyncio.get_running_loop()
        end = loop.time() + 2 * 3.0  # several renewals of first's lease
        while loop.time() < end:
            assert first.owns(job_id) and not second.owns(job_id)
            assert job_id not in second.optimisers
            assert owned(first) == (1, 1) and owned(second) == (0, 0)
            await asyncio.sleep(0.05)
        assert any(f"another process under this name (incarnation {first.book.incarnation})"
                   in r.getMessage() for r in caplog.records)  # the operator is told
    finally:
        await stop(second, second_task)
        await stop(first, first_task)


async def test_owned_counts_only_the_leases_still_live(nats_server, agent, nc, tmp_path,
                                                       monkeypatch) -> None:
    """A replica whose renewals stopped (cut off from NATS: its book keeps its last lease)
    stops counting the job once the lease reaches its fence; it counted it for ever before."""
    stalled = stall(monkeypatch, "ownership")
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=0.9)
    try:
        job_id = await running_job(nc, coord)
        await wait_for(lambda: owned(coord) == (1, 1))
        stalled.set()
        lease = coord.book.leases[records.job_hash(job_id)]
        await wait_for(lambda: owned(coord) == (0, 0), timeout_s=10)
        assert time.time() >= lease.until - coord.book.fence_s
        assert coord.book.leases[records.job_hash(job_id)].owner == coord.book.me  # still held
    finally:
        stalled.clear()
        await stop(coord, task)


def test_the_lock_lists_the_processes_that_held_it(tmp_path: Path) -> None:
    first = ReplicaSeat(tmp_path, "coord-a", "i1")
    assert first.hold() == [] and first.held
    busy = ReplicaSeat(tmp_path, "coord-a", "i2")
    assert busy.hold() is None and not busy.held  # held by a live process (flock)
    assert ReplicaSeat(tmp_path, "coord-b", "j1").hold() == []  # one lock per name
    first.release()
    assert busy.hold() == ["i1"]
    busy.release()
    assert ReplicaSeat(tmp_path, "coord-a", "i3").hold() == ["i1", "i2"]


def test_the_lock_keeps_a_bounded_history_and_survives_a_garbled_file(tmp_path: Path) -> None:
    for i in range(SEAT_HISTORY + 5):
        seat = ReplicaSeat(tmp_path, "coord-a", f"i{i}")
        assert seat.hold() is not None
        seat.release()
    last = ReplicaSeat(tmp_path, "coord-a", "last")
    before = last.hold()
    assert before is not None and len(before) == SEAT_HISTORY
    assert before[-1] == f"i{SEAT_HISTORY + 4}"
    last.release()
    last.path.write_bytes(b"\xff not json")
    seat = ReplicaSeat(tmp_path, "coord-a", "after")
    assert seat.hold() == []  # nothing proven, nothing taken early
    assert json.loads(seat.path.read_bytes())["incarnations"] == ["after"]
    seat.release()
