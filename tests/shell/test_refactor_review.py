"""Review of the coordinator shell split (issue 24): behaviour the split changed by mistake.

Against a real nats-server and a real agent with simulated GPUs (the fixtures of
`tests/shell/conftest.py`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from coordinator.optimizer import SaveProgress
from tests.shell.coordinator_kit import bound_energy_job, stall, start, stop, wait_for
from zeus_demo.cluster import wait_for_async


async def test_progress_an_optimiser_records_while_its_actions_are_fenced_is_written_later(
        nats_server, agent, nc, tmp_path, monkeypatch) -> None:
    """Before the split, a window measured while the replica's lease was lapsing (its actions
    fenced: a late renewal JetStream did not answer) was still kept as unsaved progress and
    written once the lease was renewed (or before the replica gave its jobs up). The split made
    `SaveProgress` an action, and a fenced `execute` dropped it with the commands: a replica
    taking the job over later resumed from older progress (a window measured again, a
    straggler notice forgotten)."""
    stalled = stall(monkeypatch, "ownership")
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=3.0)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: job_id in coord.optimisers and coord.owns(job_id), 10)
        stalled.set()
        await wait_for(lambda: not coord.owns(job_id), 10)  # inside its fence, not renewed
        assert coord.link.state is not None
        take = coord.link.state.take

        async def jetstream_not_answering(*args: Any) -> int | None:
            return None

        monkeypatch.setattr(coord.link.state, "take", jetstream_not_answering)
        progress = {"windows": [{"power_limit": 300, "time_s": 2.0, "energy_j": 600.0}]}
        driver = coord.jobs.get(job_id)
        assert driver is not None
        async with driver.lock:  # (What a stream handler holds while the optimiser acts.)
            await coord.actions.act(job_id, lambda _r, _i: [SaveProgress("windows", progress)],
                                    0, None)
        assert job_id in coord.optimisers  # still driven here, its actions fenced
        monkeypatch.setattr(coord.link.state, "take", take)
        stalled.clear()  # The ownership loop takes the lease again and writes what is unsaved.
        await wait_for(lambda: coord.owns(job_id), 10)
        async def windows_recorded() -> dict | None:  # (Its profile was recorded first.)
            recorded = await coord.link.state.get_progress(job_id)
            return recorded if recorded and recorded["kind"] == "windows" else None

        recorded = await wait_for_async(windows_recorded, 5, interval_s=0.05, fail=False)
        assert recorded == {"kind": "windows", "state": progress}
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_a_file_a_scheduler_produced_is_written_while_the_actions_are_fenced(
        nats_server, agent, nc, tmp_path, monkeypatch) -> None:
    """A scheduler wrote its files itself (the instruction profile, Perseus' frontier) until
    issue 24 made them `WriteFile` actions; a fenced `execute` dropped them with the commands,
    so the instruction profile a job ran for was never written if its lease was lapsing just
    then (a replica taking the job over writes what its replay produced; this one, renewing its
    lease, never did)."""
    from coordinator.optimizer import WriteFile

    stalled = stall(monkeypatch, "ownership")
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=3.0)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: job_id in coord.optimisers and coord.owns(job_id), 10)
        stalled.set()
        await wait_for(lambda: not coord.owns(job_id), 10)  # inside its fence, not renewed
        assert coord.link.state is not None

        async def jetstream_not_answering(*args: Any) -> int | None:
            return None

        monkeypatch.setattr(coord.link.state, "take", jetstream_not_answering)
        path = tmp_path / "profiles" / "instruction_profile.csv"
        record = coord.registry.jobs[job_id]
        await coord.actions.execute(record, [WriteFile(str(path), "rank,time\n",
                                                       "the instruction profile")])
        assert not coord.owns(job_id)  # (It was fenced.)
        assert path.read_text() == "rank,time\n"
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_asking_whether_a_job_may_be_acted_on_makes_no_driver(tmp_path) -> None:
    """`owns_now` (every `execute` and GPU command asks it) made a `JobDriver` for the job
    before looking at its lease: a job forgotten while a plan or a request was in flight got a
    driver again, kept for ever. Before the split the late-renewal throttle was written only
    when a renewal was tried."""
    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService

    coord = CoordinatorService(CoordinatorSettings(state_dir=str(tmp_path / "state")))
    assert not await coord.leases.owns_now("removed-or-never-known")
    assert coord.jobs.drivers() == []


async def test_a_start_that_runs_after_its_job_was_forgotten_makes_no_driver(tmp_path) -> None:
    """`maybe_start` spawns `start`; the job removed before that task ran (the ownership loop
    retries a job whose optimiser refused to start every round, while idle collection removes
    it) got a new `JobDriver` from `start`, kept for ever."""
    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService
    from tests.shell.coordinator_kit import job_request

    coord = CoordinatorService(CoordinatorSettings(state_dir=str(tmp_path / "state")))
    record = coord.jobs.register(job_request(dp=2), coord.clock(), "n", datetime.now(), "t")
    coord.jobs.driver(record.job_id).begin_start()  # (What `maybe_start` did.)
    coord.jobs.forget(record.job_id)
    await coord.starter.start(record)
    assert coord.jobs.drivers() == []


def test_the_optimisers_can_be_read_from_another_thread_while_jobs_come_and_go(tmp_path) -> None:
    """`/metrics` reads `optimisers` on the status server's thread. Before the split it was a
    dict, copied whole under the GIL; the split made it a comprehension over the drivers, which
    the event loop's thread changes meanwhile: "dictionary changed size during iteration"
    (`metrics.snapshot` tries three times, then the scrape fails)."""
    import sys
    import threading

    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService

    coord = CoordinatorService(CoordinatorSettings(state_dir=str(tmp_path / "state")))
    for i in range(2000):
        coord.jobs.driver(f"job-{i}")
    stop = threading.Event()

    def jobs_come_and_go() -> None:
        i = 0
        while not stop.is_set():
            coord.jobs.driver(f"new-{i % 50}")
            coord.jobs.forget(f"new-{(i + 25) % 50}")
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    churn = threading.Thread(target=jobs_come_and_go)
    churn.start()
    errors = 0
    try:
        for _ in range(3000):
            try:
                coord.optimisers  # noqa: B018 - the read is the test
            except RuntimeError:
                errors += 1
    finally:
        stop.set()
        churn.join()
        sys.setswitchinterval(interval)
    assert errors == 0


async def test_a_job_removed_while_unsaved_progress_is_written_stops_nothing(tmp_path) -> None:
    """`record_unsaved` (every ownership round, and before a stopping replica gives its jobs
    up) writes the jobs' unsaved progress one after the other; a job removed during an earlier
    write (another replica collected it) had lost its driver, and dropping its unsaved progress
    raised KeyError: the shutdown stopped there (NATS not drained, the embedded server not
    stopped). Before the split the unsaved progress was popped from a map."""
    import time

    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService
    from coordinator.state import records
    from coordinator.state.ownership import Lease

    coord = CoordinatorService(CoordinatorSettings(state_dir=str(tmp_path / "state")))
    until = time.time() + 60
    for job_id, owner in (("mine", coord.book.me), ("taken", "another-replica")):
        coord.jobs.driver(job_id).keep_unsaved("windows", {"windows": []})
        coord.book.leases[records.job_hash(job_id)] = Lease(owner, until, 1, job_id)

    async def write_progress(job_id: str, stopping: bool = False) -> None:
        coord.jobs.forget("taken")  # (Its removal arrives while this write waits on JetStream.)

    coord.progress.write_progress = write_progress  # type: ignore[method-assign]
    await coord.progress.record_unsaved(stopping=True)
    assert coord.jobs.get("taken") is None
