"""`CoordinatorService` against a real nats-server with a simulated-GPU agent: registration
through NATS requests, coded errors, queries, status events, lease renewals, idle collection,
restart from the state directory and loaded profiles. The service keeps serving throughout."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from coordinator.service.durable import DurableState
from coordinator.service.replicas import Replicas
from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    bind_trainers,
    bound_energy_job,
    collect,
    feed_steps,
    gpu_info,
    job_request,
    limits_are,
    measurements,
    rank_request,
    register_job,
    stall,
    start,
    start_agent,
    state_keys,
    state_values,
    stop,
    wait_for,
)
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    ErrorEvent,
    GpuBinding,
    GpuDescription,
    JobQuery,
    JobStatus,
    LeaseRenewal,
    PowerLimitOptions,
    Reply,
    join_token_digest,
)
from zeus_demo.cluster import wait_for_async


async def test_register_job_and_ranks_query_and_status(coord, nc):
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=2, job_metadata="shell")
    assert job_id.endswith("+dp2+pp1+tp1+InstructionProfiler+shell")  # a pipeline job
    uuid0 = (await gpu_info(nc, 0))["gpu"]["uuid"]
    first = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0, uuid=uuid0))
    assert first.ok and first.result["registered"] == 1 and first.result["world_size"] == 2
    # A retry is idempotent.
    again = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0, uuid=uuid0))
    assert again.ok and again.result["registered"] == 1
    second = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 1))
    assert second.ok and second.result["registered"] == 2

    one = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert one.ok and one.result["complete"] is True
    assert one.result["ranks"]["0"] == {"node": NODE, "gpu_index": 0, "gpu_uuid": uuid0}
    assert one.result["job"]["dp_degree"] == 2
    listing = await ask(nc, subjects.coord_job_query(), JobQuery())
    assert job_id in listing.result["jobs"]

    await wait_for(lambda: len([s for s in statuses if s.job_id == job_id]) >= 3)
    states = [s.state for s in statuses if s.job_id == job_id]
    assert states[:3] == ["registered", "rank_registered", "rank_registered"]
    assert "waiting for 2 rank(s)" in statuses[0].message
    assert "(2/2 ranks registered)" in [s for s in statuses if s.job_id == job_id][2].message


@pytest.mark.parametrize(
    ("subject", "payload", "code", "words"),
    [
        (subjects.coord_register_job(NODE), b"\xc1not msgpack", "bad_request",
         ["not valid msgpack"]),
        (subjects.coord_register_job(NODE), msgpack.packb([1, 2]), "bad_request",
         ["must be a map"]),
        (subjects.coord_register_job(NODE),
         {**job_request().model_dump(), "v": 2}, "bad_request", ["schema version 2"]),
        (subjects.coord_register_job(NODE),
         {"v": 1, "job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 3}},
         "bad_request", ["job.world_size", "must equal"]),
        (subjects.coord_register_job(NODE), {"v": 1, "job": {}, "extra": 1}, "bad_request",
         ["field"]),
        (subjects.coord_register_rank(NODE), rank_request("no-such-job", 0), "unknown_job",
         ["unknown job 'no-such-job'", "register it first"]),
        (subjects.coord_job_query(), JobQuery(job_id="no-such-job"), "unknown_job",
         ["no-such-job"]),
        (subjects.coord_job_query(), {"v": 1, "job_id": 5}, "bad_request", ["job_id"]),
    ],
)
async def test_bad_input_gets_a_coded_error(coord, nc, subject, payload, code, words):
    data = payload if isinstance(payload, bytes) else codec.encode(payload)
    reply = await ask(nc, subject, data)
    assert not reply.ok and reply.code == code, reply
    for word in words:
        assert word in reply.error
    # Still serving.
    assert (await ask(nc, subjects.coord_job_query(), JobQuery())).ok


async def test_a_rank_relayed_with_its_gpu_description_needs_no_info_request(coord, nc):
    """The agent relaying a registration attaches its GPU's description: the coordinator takes
    the power-limit range from it and asks no agent (4,096 `info` requests were a fifth of a
    big registration's time). Without it, the coordinator asks (GPU 7 has no agent here)."""
    job_id = await register_job(nc, dp=2, job_metadata="described")
    info_requests: list[str] = []

    async def count(msg: Any) -> None:
        info_requests.append(msg.subject)

    sub = await nc.subscribe(subjects.gpu_command(NODE, 7), cb=count)
    await confirm_subscriptions(nc)
    gpu7 = GpuDescription(
        index=7, uuid="GPU-seven", name="NVIDIA A40", architecture="Ampere",
        min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
        supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
        has_energy_counter=True, power_limit_w=300)
    described = rank_request(job_id, 0, gpu=7).model_copy(update={"gpu_info": gpu7})
    reply = await ask(nc, subjects.coord_register_rank(NODE), described)
    assert reply.ok and reply.result["registered"] == 1, reply
    assert info_requests == []
    assert coord.gpus.limits[NODE, 7] == (100, 300)
    # Its uuid is checked against the description, as against an agent's answer.
    wrong = rank_request(job_id, 1, gpu=6, uuid="GPU-other").model_copy(
        update={"gpu_info": gpu7.model_copy(update={"index": 6})})
    reply = await ask(nc, subjects.coord_register_rank(NODE), wrong)
    assert (reply.ok, reply.code) == (False, "conflict")
    await sub.unsubscribe()


async def test_rank_errors(coord, nc):
    job_id = await register_job(nc, dp=2)
    rank = subjects.coord_register_rank(NODE)
    assert (await ask(nc, rank, rank_request(job_id, 0))).ok
    cases = [
        (rank_request(job_id, 0, gpu=1), "duplicate", "already registered"),
        (rank_request(job_id, 1, gpu=0), "duplicate", "already drives rank 0"),
        (rank_request(job_id, 2, gpu=1), "out_of_range", "rank 2 is out of range"),
        (rank_request(job_id, 1, gpu=7), "unavailable", "no agent answers for GPU 7"),
        (rank_request(job_id, 1, node="ghost-node"), "forbidden", "through that node's agent"),
        (rank_request(job_id, 1, uuid="GPU-not-this-one"), "conflict", "not GPU-not-this-one"),
        # Knowing the job id is not enough: every rank presents the job's join token.
        (rank_request(job_id, 1).model_copy(update={"join_token": None}), "forbidden",
         "rank 1 of job " + job_id + " presented no join token"),
        (rank_request(job_id, 1).model_copy(update={"join_token": "x" * 24}), "forbidden",
         "presented a wrong join token"),
    ]
    for request, code, words in cases:
        reply = await ask(nc, rank, request)
        assert (reply.ok, reply.code) == (False, code), (request, reply)
        assert words in reply.error
    # Through its own node's subject, a node without an agent is unavailable.
    ghost = await ask(nc, subjects.coord_register_rank("ghost-node"),
                      rank_request(job_id, 1, node="ghost-node"))
    assert (ghost.code, "zeus-agent run" in ghost.error) == ("unavailable", True)
    one = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert list(one.result["ranks"]) == ["0"] and one.result["complete"] is False
    assert (await ask(nc, rank, rank_request(job_id, 1))).ok


async def test_leases_renewed_while_active_and_idle_jobs_collected(nats_server, agent, nc,
                                                                   tmp_path):
    coord, task = await start(nats_server, tmp_path / "c", lease_s=0.3, max_job_idle_time=1)
    try:
        renewals = await collect(nc, "zeus.lease.*", LeaseRenewal)
        statuses = await collect(nc, "zeus.job.*.status", JobStatus)
        job_id = await register_job(nc, dp=1)
        await wait_for(lambda: len([r for r in renewals if r.holder == job_id]) >= 2, 3)
        assert all(r.lease_s == 0.3 for r in renewals)
        await wait_for(lambda: any(s.state == "removed" and s.job_id == job_id
                                   for s in statuses), 4)
        removed = [s for s in statuses if s.state == "removed"][0]
        assert "max_job_idle_time" in removed.message
        reply = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
        assert reply.code == "unknown_job"
        # No more renewals for a removed job.
        await asyncio.sleep(0.15)
        count = len(renewals)
        await asyncio.sleep(0.3)
        assert len(renewals) == count
        # Gone from the durable state too (the job's key deleted, its ranks purged).
        assert await state_keys(coord) == set()
    finally:
        await stop(coord, task)


async def test_state_survives_a_restart(nats_server, agent, nc, tmp_path):
    state = tmp_path / "state"
    coord, task = await start(nats_server, state)
    job_id = await register_job(nc, dp=2, job_metadata="restart")
    assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 1))).ok
    await stop(coord, task)

    coord, task = await start(nats_server, state)
    try:
        one = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
        assert one.ok and list(one.result["ranks"]) == ["1"]
        # Registration continues where it stopped, duplicates are still refused.
        dup = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0, gpu=1))
        assert dup.code == "duplicate"
        # The join token outlives the restart (its digest is in the state; never the token).
        tokenless = rank_request(job_id, 0).model_copy(update={"join_token": None})
        refused = await ask(nc, subjects.coord_register_rank(NODE), tokenless)
        assert (refused.code, "no join token" in refused.error) == ("forbidden", True)
        assert not any(JOIN_TOKENS[job_id] in str(v) for v in (await state_values(coord)))
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))).ok
    finally:
        await stop(coord, task)


async def test_a_profile_sent_with_the_job_pins_the_optimum_on_every_gpu(coord, nc, agent):
    profile = measurements([(300, 1000.0, 10.0), (250, 700.0, 10.5), (200, 800.0, 13.0)])
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(
        nc, dp=2, power_limit=PowerLimitOptions(selector="Energy", profile=profile))
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: any(s.job_id == job_id and s.state == "done" for s in statuses))
    done = [s for s in statuses if s.job_id == job_id and s.state == "done"][0]
    assert "loaded profile: optimal power limit 250 W" in done.message
    for index in (0, 1):
        info = await gpu_info(nc, index)
        assert info["gpu"]["power_limit_w"] == 250
        assert any(lease["holder"] == job_id for lease in info["leases"])
        sim_dir = agent.settings.sim_state_dir
        assert SimGPU.open(sim_dir, index).get_power_limit_w() == 250
    query = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert query.result["power_limit"]["optimal_power_limit_w"] == 250
    # Give the GPUs back for the other tests.
    for index in (0, 1):
        await ask(nc, subjects.gpu_command(NODE, index),
                  {"v": 1, "cmd": {"op": "reset_power_limit"}})


async def test_a_profile_path_is_refused_and_never_opened(coord, nc, tmp_path):
    """Defect: a trainer's `profile_path` was read and written on the coordinator's host."""
    secret = tmp_path / "secret.txt"
    secret.write_text("head of a private file\n" * 10)
    target = tmp_path / "new" / "dir" / "p.json"
    for path in (secret, target):
        reply = await ask(nc, subjects.coord_register_job(NODE), {
            "v": 1, "job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1},
            "power_limit": {"profile_path": str(path)}})
        assert (reply.ok, reply.code) == (False, "bad_request")
        assert "profile_path" in reply.error
    assert not target.parent.exists()
    # The coordinator's own copies are named by it, under its state directory.
    record_path = coord.profile_path(next(iter(coord.registry.jobs.values()))) \
        if coord.registry.jobs else coord.state_dir / "profiles"
    assert str(record_path).startswith(str(coord.state_dir))


async def test_bad_profile_is_an_error_status_not_a_crash(coord, nc):
    words = "outside this GPU's range"
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=1, power_limit=PowerLimitOptions(
        profile=measurements([(400, 1000.0, 10.0), (300, 900.0, 11.0)])))
    assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))).ok
    # The job fails once (quarantined: never retried), the replica serves on.
    await wait_for(lambda: any(s.job_id == job_id and s.state == "failed" for s in statuses))
    error = [s for s in statuses if s.job_id == job_id and s.state == "failed"][0]
    assert words in error.message
    assert (await gpu_info(nc, 0))["gpu"]["power_limit_w"] == 300  # Nothing was applied.
    assert (await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))).ok


async def test_measured_windows_survive_a_restart(nats_server, agent, nc, tmp_path):
    state = tmp_path / "state"
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, state)
    options = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2)
    job_id = await register_job(nc, dp=2, job_metadata="resume", power_limit=options)
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok

    async def measured() -> int:
        reply = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
        return reply.result["power_limit"]["measured"] if reply.result["power_limit"] else 0

    await wait_for(lambda: job_id in coord.optimisers)
    # Steps 0..6: windows at 300 W (steps 1-3) and 275 W (steps 4-6) are measured.
    await feed_steps(nc, job_id, range(7))
    async def both_measured() -> bool:
        return await measured() == 2

    await wait_for_async(both_measured, 5, interval_s=0.05, fail=False)  # (100 x 0.05 s before)
    assert await measured() == 2
    await stop(coord, task)

    coord, task = await start(nats_server, state)
    try:
        await wait_for(lambda: any("resuming after 2 measured window(s)" in s.message
                                   for s in statuses if s.job_id == job_id))
        assert await measured() == 2
        first = coord.optimisers[job_id].machine.measurements
        assert [m.power_limit for m in first] == [300, 275]
        # 300 W window: 2 s, 2 steps x 100 J x (1 + 2) ranks' energy; time is the max over ranks.
        assert (first[0].time, first[0].energy) == (2.0, 600.0)
    finally:
        await stop(coord, task)


async def test_forgetting_a_job_drops_its_driver_and_every_index_entry(nats_server, agent, nc,
                                                                         tmp_path):
    """Issue 24: per-job state lives in one `JobDriver`; a removed job leaves nothing behind
    (the service kept ~21 per-job maps that forgetting a job had to clear by hand). Issue 35:
    every index of the job table leads to that one driver, and forgetting drops them all."""
    coord, task = await start(nats_server, tmp_path / "c", lease_s=0.3, max_job_idle_time=2)
    try:
        statuses = await collect(nc, "zeus.job.*.status", JobStatus)
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: job_id in coord.optimisers)
        driver = coord.jobs.get(job_id)
        assert driver is not None and driver.optimiser is coord.optimisers[job_id]
        assert driver.record is coord.registry.jobs[job_id]
        gpus = sorted(driver.gpus)
        assert len(gpus) == 2 and all(coord.jobs.on_gpu(*g) is driver for g in gpus)
        assert coord.jobs.by_hash(driver.hash) is driver
        assert coord.jobs.by_token(driver.token) is driver
        await wait_for(lambda: any(s.state == "removed" and s.job_id == job_id
                                   for s in statuses), 6)
        assert coord.jobs.get(job_id) is None and job_id not in coord.optimisers
        assert coord.jobs.by_hash(driver.hash) is None
        assert coord.jobs.by_token(driver.token) is None
        assert all(coord.jobs.on_gpu(*g) is None for g in gpus)
        assert job_id not in coord.registry.jobs and job_id not in coord.jobs
    finally:
        await stop(coord, task)


async def test_a_job_back_from_a_quiet_spell_gets_its_limit_again(nats_server, agent, nc, tmp_path):
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    # Leases of 1 s (the ownership lease is capped at half of it): shorter ones lapse on a
    # loaded machine for reasons this test is not about.
    coord, task = await start(nats_server, tmp_path / "state", lease_s=1.0, lease_idle_s=1.5)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: SimGPU.open(sim_dir, 0).get_power_limit_w() == 250)
        # Quiet: renewals stop after lease_idle_s, the agents' leases lapse, defaults return.
        await wait_for(lambda: SimGPU.open(sim_dir, 0).get_power_limit_w() == 300, timeout_s=10)
        await feed_steps(nc, job_id, range(1))
        await wait_for(lambda: limits_are(sim_dir, 250))
        assert any(s.state == "resumed" and s.job_id == job_id for s in statuses)
    finally:
        await stop(coord, task)


async def test_a_lease_lapsed_while_the_job_is_active_is_set_again(nats_server, agent, nc,
                                                                   tmp_path, monkeypatch):
    """Defect (CI, a loaded machine): renewals ran late, the agents' leases lapsed while the
    trainers kept going, and the job stayed at the default limit until it next went quiet. The
    agents' `lease_expired` events now bring an active job's settings back."""
    stalled = stall(monkeypatch, "renew_gpu_leases")
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=0.5, lease_idle_s=60)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 250))
        stalled.set()
        await wait_for(lambda: sum("lapsed while the job was active" in s.message
                                   for s in statuses) >= 2)
        stalled.clear()
        await wait_for(lambda: limits_are(sim_dir, 250))
        await asyncio.sleep(1.0)  # two lease periods of renewals: it is set (a loaded machine
        # may delay a renewal past a lease again: then it is set again at once)
        await wait_for(lambda: limits_are(sim_dir, 250))
        assert all(s.state == "reconciled" and s.job_id == job_id for s in statuses
                   if "lapsed while the job was active" in s.message)
    finally:
        await stop(coord, task)


async def test_a_lease_that_lapsed_with_the_replicas_own_lease_is_set_again_once_it_is_back(
        nats_server, agent, nc, tmp_path, monkeypatch):
    """Defect (CI, a loaded machine): the stall that made the GPU lease renewals late also let
    the replica's ownership lease lapse, so the agents' one `lease_expired` event came while
    the replica did not own the job and was dropped: the GPUs stayed at the default limit until
    their agent's next heartbeat (`heartbeat_s`, 5 s by default) showed the difference. The
    event is now kept and acted on as soon as the ownership loop has taken the lease back."""
    stalled = stall(monkeypatch, "ownership")
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    lapses = await collect(nc, subjects.all_gpu_errors(), ErrorEvent)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=1.0, lease_idle_s=60)
    try:
        job_id = await bound_energy_job(nc)
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 250))
        stalled.set()  # The ownership lease lapses, then the GPU leases (not renewed unowned).
        await wait_for(lambda: sum(e.code == "lease_expired" for e in lapses) == 2)
        await asyncio.sleep(0.3)  # The coordinator has had the events (and kept them).
        assert not coord.owns(job_id)
        assert limits_are(sim_dir, 300)
        stalled.clear()
        await wait_for(lambda: limits_are(sim_dir, 250))
        again = [s for s in statuses if "lapsed while the job was active" in s.message]
        assert len(again) >= 2 and all(s.state == "reconciled" and s.job_id == job_id
                                       for s in again)
    finally:
        await stop(coord, task)


async def test_leases_that_keep_lapsing_are_set_again_only_a_few_times(nats_server, agent, nc,
                                                                        tmp_path, monkeypatch):
    """Adversarial review: when renewals never reach an agent (its permissions forget the
    lease subject) every lapse was set again, once per lease, for as long as the job ran: the
    GPU flapped and each of the agent's events cost a command. Now `REAPPLY_LIMIT` times per
    rank in `REAPPLY_WINDOW_LEASES` leases, then one error status that says what to check."""
    from coordinator.service.streams import REAPPLY_LIMIT

    async def no_renewals(self: Replicas) -> None:
        return None

    monkeypatch.setattr(Replicas, "renew_gpu_leases", no_renewals)
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=0.3, lease_idle_s=60)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: sum("renewals do not reach" in s.message for s in statuses) == 2)
        errors = [s for s in statuses if "renewals do not reach" in s.message]
        assert {s.state for s in errors} == {"error"} and all(
            "zeus.lease.*" in s.message and s.job_id == job_id for s in errors)
        again = sum("lapsed while the job was active" in s.message for s in statuses)
        assert again == 2 * REAPPLY_LIMIT  # both ranks
        sim_dir = agent.settings.sim_state_dir
        await wait_for(lambda: limits_are(sim_dir, 300))
        await agent.announce()  # A heartbeat shows 300 W, not 250 W: not set again either.
        await asyncio.sleep(1.0)  # three more leases: nothing is set again, nothing said again
        assert sum("lapsed while the job was active" in s.message for s in statuses) == again
        assert not any("its agent restarted?" in s.message for s in statuses)
        assert sum("renewals do not reach" in s.message for s in statuses) == 2
        assert limits_are(sim_dir, 300)
    finally:
        await stop(coord, task)


async def test_a_restarted_agent_gets_the_settings_the_lapse_throttle_held_back(
        nats_server, nc, tmp_path, monkeypatch):
    """Adversarial review: the error status says lapsed settings stay at the defaults "until
    its agent restarts", but the throttle outlived a real restart: the new agent's first
    announcement shows no trainer bound yet, and by the heartbeat that shows the job again the
    restart was no longer news, so its GPUs stayed at the default for the whole window."""
    import coordinator.service.streams as streams

    async def no_renewals(self: Replicas) -> None:
        return None

    monkeypatch.setattr(Replicas, "renew_gpu_leases", no_renewals)
    monkeypatch.setattr(streams, "REAPPLY_WINDOW_LEASES", 1000)  # 300 s, as with 30 s leases
    agent, agent_task = await start_agent(nats_server, tmp_path)
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", lease_s=0.3, lease_idle_s=60)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: sum("renewals do not reach" in s.message for s in statuses) == 2)
        await wait_for(lambda: limits_are(tmp_path / "gpus", 300))
        old_id = agent.agent_id
        await agent.announce()  # A heartbeat of the old agent: throttled, nothing set again.
        await wait_for(lambda: old_id in coord.streams.agent_ids.values())
        agent.handle_exit()  # The operator mends its permissions and restarts it.
        await agent_task
        agent, agent_task = await start_agent(nats_server, tmp_path)
        await asyncio.sleep(0.2)  # Its start-up announcement: no trainer bound yet.
        await bind_trainers(nc, job_id)  # The trainers say HELLO to the new agent.
        for _ in range(100):  # Heartbeats, until one finds this replica owning the job (a
            await agent.announce()  # loaded machine may fence a 0.15 s ownership lease).
            await asyncio.sleep(0.05)
            if sum("its agent restarted?" in s.message for s in statuses) >= 2:
                break
        assert sum("its agent restarted?" in s.message for s in statuses) >= 2
    finally:
        await stop(coord, task)
        agent.handle_exit()
        await agent_task


async def test_a_schedule_installed_again_switches_at_the_step_it_was_sent_for(coord, nc,
                                                                               monkeypatch):
    """Adversarial review: a schedule installed again (its lease lapsed, its agent restarted)
    was installed at once, so a rank whose schedule was still waiting for its `from_step`
    switched iterations before the other ranks. The desired schedule carries its switch step
    (`DesiredSchedule.from_step`, kept by the optimiser: tests/core/test_pipeline_job.py), and
    installing it again sends that step."""
    from coordinator.optimizer import DesiredSchedule, InstallSchedules
    from zeus_agent.models import FrequencySchedule

    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    await wait_for(lambda: job_id in coord.registry.jobs)
    record = coord.registry.jobs[job_id]
    sent: list[InstallSchedules] = []

    async def capture(record: Any, action: InstallSchedules) -> None:
        sent.append(action)

    monkeypatch.setattr(coord.actions, "install_schedules", capture)
    schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1740)])
    await coord.actions.install_again(record, [DesiredSchedule(schedule, 3, 120)])
    await coord.actions.install_again(record, [DesiredSchedule(schedule, 4)])  # after a takeover
    assert [(a.version, a.from_step, a.schedules) for a in sent] == [
        (3, 120, (schedule,)), (4, None, (schedule,))]


RESET = {"v": 1, "cmd": {"op": "reset_power_limit"}}


async def test_a_gpu_reset_behind_the_coordinators_back_is_reconciled(coord, nc, agent):
    """Defect: a restarted agent (GPUs reset at start) was never brought back to the job's limit."""
    profile = measurements([(300, 1000.0, 10.0), (250, 700.0, 10.5), (200, 800.0, 13.0)])
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions(selector="Energy",
                                                                        profile=profile))
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    sim_dir = agent.settings.sim_state_dir
    await wait_for(lambda: SimGPU.open(sim_dir, 1).get_power_limit_w() == 250)
    # The trainers (here: bind commands) drive the GPUs, as after their HELLO to an agent.
    for r in (0, 1):
        await ask(nc, subjects.gpu_command(NODE, r),
                  {"v": 1, "cmd": {"op": "bind", "job_id": job_id, "rank": r,
                                   "join_digest": join_token_digest(JOIN_TOKENS[job_id])}})
    # What a restarted agent does at start: every GPU back to its default.
    for index in (0, 1):
        await ask(nc, subjects.gpu_command(NODE, index), RESET)
    assert SimGPU.open(sim_dir, 1).get_power_limit_w() == 300
    await nc.publish(subjects.agent_ping(), b"")  # the agent announces itself (as at start)
    await wait_for(lambda: limits_are(sim_dir, 250))
    assert any(s.state == "reconciled" and s.job_id == job_id for s in statuses)
    # A GPU whose trainer left stays at its default, whatever the job's limit.
    for index in (0, 1):
        await ask(nc, subjects.gpu_command(NODE, index), {"v": 1, "cmd": {"op": "unbind"}})
        await ask(nc, subjects.gpu_command(NODE, index), RESET)
    reconciled = sum(s.state == "reconciled" for s in statuses)
    await nc.publish(subjects.agent_ping(), b"")
    await asyncio.sleep(0.5)
    assert SimGPU.open(sim_dir, 0).get_power_limit_w() == 300
    assert sum(s.state == "reconciled" for s in statuses) == reconciled


async def test_events_and_marks_from_another_node_are_dropped(coord, nc):
    """A node's agent can only speak for ranks bound to its own GPUs."""
    from zeus_agent.wire.messages import Mark, TrainerEvent, TrainerEventBatch
    from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch

    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    events = TrainerEventBatch(job_id=job_id, rank=0, node="evil", gpu=0, events=[
        TrainerEvent(kind="step_begin", t_ns=1, epoch=0, step=s) for s in range(50)])
    await nc.publish(subjects.job_events(job_id, 0, "evil"), codec.encode(events))
    spoofed = events.model_copy(update={"node": NODE})  # claims the right node, wrong subject
    await nc.publish(subjects.job_events(job_id, 0, "evil"), codec.encode(spoofed))
    marks = NodeMeasurementBatch(node="evil", job_id=job_id, gpus=[GpuMeasurements(
        gpu=0, rank=0, marks=[Mark(kind="step_begin", epoch=0, step=1, t_ns=1, energy_j=1.0)])])
    await nc.publish(subjects.job_measurements(job_id, "evil"), codec.encode(marks))
    await wait_for(lambda: coord.dropped["wrong_node"] >= 3)
    assert coord.optimisers[job_id].last_step is None  # nothing paced the machine


async def test_events_and_marks_of_a_trainer_without_the_join_token_are_dropped(coord, nc):
    """The right node and GPU are not enough: the agent sends the digest of the join token
    the bound trainer's HELLO presented, and a job counts only its own (a process that knows
    the job id took a departed rank's GPU after that node's agent restarted and forgot the
    job's token)."""
    from zeus_agent.wire.messages import Mark, TrainerEvent, TrainerEventBatch
    from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch

    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    before = coord.dropped["no_join_token"]
    for digest in (None, join_token_digest("a-guessed-join-token-0000")):
        events = TrainerEventBatch(job_id=job_id, rank=0, node=NODE, gpu=0, join_digest=digest,
                                   events=[TrainerEvent(kind="step_begin", t_ns=1, epoch=0,
                                                        step=s) for s in range(50)])
        await nc.publish(subjects.job_events(job_id, 0, NODE), codec.encode(events))
        marks = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=[GpuMeasurements(
            gpu=0, rank=0, join_digest=digest,
            marks=[Mark(kind="step_begin", epoch=0, step=1, t_ns=1, energy_j=1.0)])])
        await nc.publish(subjects.job_measurements(job_id, NODE), codec.encode(marks))
    await wait_for(lambda: coord.dropped["no_join_token"] >= before + 4)
    assert coord.optimisers[job_id].last_step is None  # nothing paced the machine
    await feed_steps(nc, job_id, range(1, 3))  # with the token: counted
    await wait_for(lambda: coord.optimisers[job_id].last_step is not None)


async def test_an_unavailable_state_store_refuses_without_half_registering(coord, nc):
    """Defect: with an unwritable state a failed registration stayed, and a retry made a
    second job. Now JetStream refusing the write leaves nothing behind."""
    before = set(coord.registry.jobs)
    keys = await state_keys(coord)
    original = coord.link.state._create  # (Every create of the state bucket goes through it.)

    async def broken(*args: Any, **kw: Any) -> int:
        raise TimeoutError("JetStream did not answer")

    coord.link.state._create = broken  # type: ignore[method-assign]
    coord.link.state.retry_s = 0.3  # (It retries a JetStream that does not answer, for a while.)
    try:
        for _ in range(2):
            reply = await ask(nc, subjects.coord_register_job(NODE), job_request(dp=1))
            assert (reply.ok, reply.code) == (False, "unavailable")
            assert "could not record" in reply.error and "retry" in reply.error
        assert set(coord.registry.jobs) == before
        assert await state_keys(coord) == keys
    finally:
        coord.link.state._create = original  # type: ignore[method-assign]
        coord.link.state.retry_s = 10.0
    job_id = await register_job(nc, dp=1)
    assert set(coord.registry.jobs) == before | {job_id}


async def test_quota_per_node(nats_server, nc, tmp_path):
    """Defect: registrations were unbounded; now a node gets a clear `quota` error."""
    coord, task = await start(nats_server, tmp_path / "state", max_jobs_per_node=3)
    try:
        for _ in range(3):
            assert (await ask(nc, subjects.coord_register_job(NODE), job_request(dp=1))).ok
        reply = await ask(nc, subjects.coord_register_job(NODE), job_request(dp=1))
        assert (reply.ok, reply.code) == (False, "quota")
        assert "max_jobs_per_node" in reply.error
        assert (await ask(nc, subjects.coord_register_job("other-node"), job_request(dp=1))).ok
    finally:
        await stop(coord, task)


async def test_a_4kb_job_id_is_refused_and_the_coordinator_stays_on_the_bus(coord, nc):
    """Defect: a 4,100-character `job_metadata` made a subject over nats-server's control-line
    limit; the server closed the coordinator's connection and it stayed up deaf."""
    reply = await ask(nc, subjects.coord_register_job(NODE), {
        "v": 1, "job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1,
                        "job_metadata": "m" * 4100}})
    assert (reply.ok, reply.code) == (False, "bad_request") and "job_metadata" in reply.error
    # The longest accepted id still makes short subjects; the coordinator publishes on them.
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=1, job_metadata="m" * 128,
                                power_limit=PowerLimitOptions())
    assert len(job_id) > 150 and len(subjects.job_status(job_id)) < 120
    assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))).ok
    await wait_for(lambda: any(s.job_id == job_id and s.state == "profiling" for s in statuses))
    await asyncio.sleep(0.2)
    assert not coord.nc.is_closed
    query = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert query.ok and query.result["job_id"] == job_id
    await ask(nc, subjects.gpu_command(NODE, 0), RESET)


async def test_when_nothing_can_be_measured_the_gpus_go_back_to_the_maximum(coord, nc, agent):
    """Defect: with every window at 0 J the optimiser gave up and left the GPUs at the minimum
    limit (renewed for as long as the job ran)."""
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    options = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=0, profile_steps=2,
                                pl_step_w=100)  # 300, 200, 100 W
    job_id = await register_job(nc, dp=2, power_limit=options)
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    sim_dir = agent.settings.sim_state_dir
    await feed_steps(nc, job_id, range(7), joules_per_step=0.0)
    await wait_for(lambda: any(s.job_id == job_id and s.state == "gave_up" for s in statuses))
    gave_up = next(s for s in statuses if s.job_id == job_id and s.state == "gave_up")
    assert "maximum limit 300 W" in gave_up.message
    await wait_for(lambda: limits_are(sim_dir, 300))
    query = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert query.result["power_limit"]["gave_up"]
    assert coord.optimisers[job_id].desired_power_limit == 300


async def test_a_missing_tls_file_is_named_at_start(nats_server, tmp_path):
    """The coordinator takes the agent's TLS options; a CA file that is not there stops the
    start with a message naming the file and its flag (exit 3 from the command line)."""
    from zeus_agent.errors import BrokerError

    settings = CoordinatorSettings(nats_url=nats_server.url, state_dir=str(tmp_path / "s"),
                                   nats_tls_ca=str(tmp_path / "no-ca.pem"))
    assert settings.tls_options() == {"tls_ca_file": str(tmp_path / "no-ca.pem")}
    with pytest.raises(BrokerError, match=r"no-ca\.pem.*--nats-tls-ca|--nats-tls-ca.*no-ca\.pem"):
        await CoordinatorService(settings).serve()


async def test_a_late_ownership_renewal_is_made_before_acting_not_fenced(nats_server, agent, nc,
                                                                          tmp_path, monkeypatch):
    """Defect (CI, a loaded machine): a burst of huge iterations kept the event loop busy, the
    ownership renewal ran late, and the job's actions were fenced ("this replica's lease on the
    job is lapsing") although no other replica held it: the job never went on. An action on a
    job whose lease is still this replica's renews it first; one another replica holds is still
    fenced."""
    from coordinator.optimizer import StatusUpdate
    from coordinator.state import records
    from coordinator.state.ownership import Lease

    stalled = stall(monkeypatch, "ownership")
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=3.0)
    try:
        job_id = await register_job(nc, dp=2)
        job_hash = records.job_hash(job_id)
        await wait_for(lambda: coord.owns(job_id))
        stalled.set()
        await wait_for(lambda: not coord.owns(job_id), 10)  # inside its fence (1 s), not renewed
        record = coord.registry.jobs[job_id]
        await coord.actions.execute(record, [StatusUpdate("profiling", "acted on a late lease")])
        await wait_for(lambda: any(s.message == "acted on a late lease" for s in statuses))
        assert coord.owns(job_id)  # renewed by the action

        held = coord.book.leases[job_hash]
        coord.book.leases[job_hash] = Lease("another-replica", held.until, held.revision + 1,
                                            job_id)
        await coord.actions.execute(record, [StatusUpdate("profiling", "acted on another's lease")])
        await asyncio.sleep(0.3)
        assert not any(s.message == "acted on another's lease" for s in statuses)
        assert coord.book.leases[job_hash].owner == "another-replica"  # nothing taken
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_a_gpu_whose_trainer_left_is_not_reported_as_a_failed_command(coord, nc):
    """Known defect (review): a lapsed lease set again just as the rank's trainer said goodbye
    was refused by the agent and published as the job's `error`. The agent's `trainer_left`
    refusal is no failure (its `trainer_gone` event says what happened); other refusals are."""
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    job_id = await register_job(nc, dp=2)
    record = coord.registry.jobs[job_id]
    gpus = [GpuBinding(node=NODE, gpu_index=i) for i in (0, 1)]
    left = Reply.failure("trainer_left", "the trainer of job x has left GPU 0")
    await coord.commands.report_failures(record, "setting 250 W", gpus, [left, Reply.success()])
    await coord.commands.report_failures(record, "setting 200 W", gpus,
                                         [left, Reply.failure("conflict", "held by another job")])
    await wait_for(lambda: any("200 W" in s.message for s in statuses))
    errors = [s.message for s in statuses if s.state == "error"]
    assert errors == [f"setting 200 W failed on {NODE}/gpu1: held by another job"], errors


async def test_a_slow_late_renewal_fences_the_actions_and_keeps_the_job(nats_server, agent, nc,
                                                                         tmp_path, monkeypatch):
    """Review: a late lease renewed on demand while JetStream did not answer (an election) ran
    out meanwhile, and the job was dropped as "taken by another replica" though none had it,
    then restarted from its recorded progress. Now the try is bounded by half the fence, the
    actions are fenced, and the job stays driven here (the ownership loop takes its lease
    again)."""
    from coordinator.optimizer import StatusUpdate

    stalled = stall(monkeypatch, "ownership")
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=3.0)
    try:
        job_id = await bound_energy_job(nc)
        await wait_for(lambda: job_id in coord.optimisers and coord.owns(job_id), 10)
        stalled.set()
        await wait_for(lambda: not coord.owns(job_id), 10)
        assert coord.link.state is not None
        take = coord.link.state.take

        async def jetstream_not_answering(*args: Any) -> int | None:
            await asyncio.sleep(coord.book.fence_s + 0.3)
            return None

        monkeypatch.setattr(coord.link.state, "take", jetstream_not_answering)
        record = coord.registry.jobs[job_id]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await coord.actions.execute(record,
                                    [StatusUpdate("profiling", "acted while JetStream slept")])
        assert loop.time() - t0 < coord.book.fence_s  # bounded, not JetStream's timeout
        assert job_id in coord.optimisers  # still driven here
        await asyncio.sleep(0.3)
        assert not any(s.message == "acted while JetStream slept" for s in statuses)
        monkeypatch.setattr(coord.link.state, "take", take)
        stalled.clear()  # the loop takes the lease again, the job goes on where it was
        await wait_for(lambda: coord.owns(job_id), 10)
        assert job_id in coord.optimisers
    finally:
        stalled.clear()
        await stop(coord, task)


async def test_a_failed_lease_write_reads_the_lease_when_the_watch_lags(nats_server, agent, nc,
                                                                         tmp_path, monkeypatch):
    """CI under load: a replica whose ownership watch stalled (its server restarting) kept a
    stale revision, so every compare-and-set failed and it never learnt who held the job (a
    job given up to it was never taken). A failed lease write reads the key."""
    import json
    import time

    from coordinator.state import records

    stalled = stall(monkeypatch, "on_owner_entry", DurableState)
    coord, task = await start(nats_server, tmp_path / "state", ownership_lease_s=0.9)
    try:
        job_id = await register_job(nc, dp=2)
        job_hash = records.job_hash(job_id)
        await wait_for(lambda: coord.owns(job_id))
        stalled.set()
        assert coord.link.state is not None
        other = {"v": 1, "owner": "another-replica", "until": time.time() + 60, "job_id": job_id}
        await coord.link.state.owners.put(job_hash, json.dumps(other).encode())
        await wait_for(lambda: coord.book.leases[job_hash].owner == "another-replica", 10)
        assert not coord.owns(job_id)
    finally:
        stalled.clear()
        await stop(coord, task)
