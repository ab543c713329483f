"""A replica that no longer drives a job never commands its GPUs, whatever path leads there.

Regression (issue "One request must not stop a coordinator", item 2): a replica paused
(SIGSTOP) past its ownership lease, while another replica took its job over, was continued
and saw the trainer's events "after a quiet spell": `Streams.on_events` ->
`ActionExecutor.reapply` -> `apply_power_limit` sent `set_power_limit` without checking
ownership, and the GPUs sat at the stale replica's limit for seconds. Every command is now sent
through `ActionExecutor.command`, which checks ownership just before the send. Against a real
nats-server and a real agent with simulated GPUs; the takeover is the lease's holder changing
under the stale replica (what its ownership watch shows once it runs again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordinator.state import records
from coordinator.state.ownership import Lease
from tests.shell.coordinator_kit import (
    bound_energy_job,
    collect,
    feed_steps,
    limits_are,
    stall,
    start,
    stop,
    wait_for,
)
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire.messages import JobStatus


def taken_over(coord: Any, job_id: str) -> None:
    """The job's lease now names another replica (as the stale replica's watch shows it)."""
    job_hash = records.job_hash(job_id)
    held = coord.book.leases[job_hash]
    coord.book.leases[job_hash] = Lease("another-replica", held.until + 60, held.revision + 1,
                                        job_id)


async def test_a_stale_replica_back_from_a_pause_does_not_set_the_limit_again(
        nats_server, agent, nc, tmp_path, monkeypatch) -> None:
    stalled = stall(monkeypatch, "ownership")  # Its watch and renewals are "paused".
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=1.0, lease_idle_s=1.5)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 250))
        # Quiet: the GPU leases lapse and the agents restore the default (300 W).
        await wait_for(lambda: limits_are(sim_dir, 300), timeout_s=10)
        stalled.set()
        taken_over(coord, job_id)
        assert job_id in coord.optimisers  # The stale replica still holds its optimiser.
        fenced = coord.fenced_commands
        await feed_steps(nc, job_id, range(1))  # The trainer goes on: "events again".
        seen = set()
        for _ in range(50):  # (A stale 250 W would lapse again after the 1 s lease: watch.)
            seen.add(tuple(SimGPU.open(sim_dir, i).get_power_limit_w() for i in (0, 1)))
            await asyncio.sleep(0.02)
        await wait_for(lambda: coord.fenced_commands > fenced)
        assert seen == {(300, 300)}, seen  # Never the stale replica's 250 W.
        assert not any(s.state == "reconciled" for s in statuses if s.job_id == job_id)
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_every_command_path_is_fenced(nats_server, agent, nc, tmp_path,
                                            monkeypatch) -> None:
    """Power limits, schedules (first and again) and clears: none is sent once another
    replica holds the job; each is counted."""
    from coordinator.optimizer import DesiredSchedule, InstallSchedules

    stalled = stall(monkeypatch, "ownership")
    coord, task = await start(nats_server, tmp_path / "state", lease_s=5.0)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 250))
        stalled.set()
        taken_over(coord, job_id)
        record = coord.registry.jobs[job_id]
        job = coord.optimisers[job_id]
        sent: list[Any] = []

        async def request_all(requests: list[tuple[str, bytes]]) -> list[Any]:
            sent.extend(requests)
            return []

        monkeypatch.setattr(coord.commands, "request_all", request_all)
        schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1740)])
        await coord.actions.apply_power_limit(record, 200)
        await coord.actions.reapply(record, job, "events again after a quiet spell")
        await coord.actions.install_schedules(record, InstallSchedules((schedule,), 1, None))
        await coord.actions.install_again(record, [DesiredSchedule(schedule, 1)])
        await coord.actions.clear_schedules(record)
        assert sent == []
        assert coord.fenced_commands >= 2 + 2 + 2  # (Two GPUs each; the schedule: one.)
        assert limits_are(sim_dir, 250)
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_a_replica_paused_between_its_check_and_the_send_sends_nothing(
        nats_server, agent, nc, tmp_path, monkeypatch) -> None:
    """The soak's `stale_owner` from a paused owner: the ownership check passed, the process
    was stopped before its messages went out (awaiting the reply inbox's subscription) and
    another replica took the job meanwhile. Ownership is asked again right before each
    message is handed to NATS."""
    stalled = stall(monkeypatch, "ownership")
    coord, task = await start(nats_server, tmp_path / "state", lease_s=5.0)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 250))
        stalled.set()
        bus = coord.commands.link.nc
        subscribe = bus.subscribe

        async def paused_here(*args: Any, **kw: Any) -> Any:
            taken_over(coord, job_id)  # (What the replica finds once it runs again.)
            return await subscribe(*args, **kw)

        monkeypatch.setattr(bus, "subscribe", paused_here)
        fenced = coord.fenced_commands
        await coord.actions.apply_power_limit(coord.registry.jobs[job_id], 200)
        assert coord.fenced_commands == fenced + 2
        await asyncio.sleep(0.3)
        assert limits_are(sim_dir, 250)
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_actions_fenced_while_the_lease_lapsed_are_caught_up_once_it_is_back(
        nats_server, agent, nc, tmp_path, monkeypatch, caplog) -> None:
    """Regression (`bench/cluster_scale.py`, 25,000 GPUs): during the registration burst a
    replica's late renewal of its own lease failed just as a job's ranks were all in, so the
    job's first limit was fenced; the replica kept the lease, and nothing sent the limit again
    until the job's next transition (312 GPUs waited 160 s). Once the lease is this replica's
    again, the job's current limit goes out, then the fenced statuses."""
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=3.0)
    real = coord.leases.owns_now
    lapsing = True

    async def owns_now(job_id: str) -> bool:
        return False if lapsing else await real(job_id)

    monkeypatch.setattr(coord.leases, "owns_now", owns_now)
    try:
        with caplog.at_level(logging.INFO, "coordinator.service"):
            job_id = await bound_energy_job(nc)
            sim_dir = agent.settings.sim_state_dir
            await wait_for(lambda: coord.jobs.driver(job_id).fenced != [])
            done = [s for s in statuses if s.job_id == job_id and s.state == "done"]
            assert done == [] and limits_are(sim_dir, 300)  # Fenced: nothing went out.
            lapsing = False  # The renewal lands: the lease is this replica's again.
            await wait_for(lambda: limits_are(sim_dir, 250), timeout_s=5)
            await wait_for(lambda: any(s.job_id == job_id and s.state == "done"
                                       for s in statuses))
        assert coord.jobs.driver(job_id).fenced == []
        assert any("not carried out while this replica's lease was lapsing" in r.getMessage()
                   for r in caplog.records)
    finally:
        await stop(coord, task)


async def test_fenced_actions_are_dropped_once_another_replica_holds_the_job(
        nats_server, agent, nc, tmp_path, monkeypatch) -> None:
    """The new owner sets everything again: the stale replica sends none of what it fenced."""
    coord, task = await start(nats_server, tmp_path / "state", lease_s=3.0)

    async def never(job_id: str) -> bool:
        return False

    monkeypatch.setattr(coord.leases, "owns_now", never)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: coord.jobs.driver(job_id).fenced != [])
        taken_over(coord, job_id)
        await wait_for(lambda: coord.jobs.driver(job_id).fenced == [], timeout_s=5)
        await asyncio.sleep(0.5)
        assert limits_are(agent.settings.sim_state_dir, 300)
    finally:
        await stop(coord, task)
