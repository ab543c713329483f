"""The trainers' gateway over a real nats-server: events, requests, bad datagrams, schedules."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import pytest

from tests.shell.agent_kit import Inbox, RawTrainer, command, running_agent, wait_for
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.models import FrequencySchedule, JobInfo, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    ErrorEvent,
    GpuBinding,
    GpuDescription,
    InfoCmd,
    InstallScheduleCmd,
    RegisterJob,
    RegisterRank,
    Reply,
    TrainerEventBatch,
)
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.rank_columns import decode_registration
from zeus_agent.wire.trainer import Kind, WindowRequest

K = Kind


@pytest.fixture
async def agent(nats_server):
    async with running_agent(nats_server.url, sim_count=2, recording=True) as server:
        yield server


@pytest.fixture
def trainer(agent):
    t = RawTrainer(agent.settings.socket_path)
    yield t
    t.close()


async def test_socket_has_the_configured_mode(nats_server):
    async with running_agent(nats_server.url, socket_mode="0660") as server:
        assert os.stat(server.settings.socket_path).st_mode & 0o777 == 0o660


async def test_hello_binds_the_pid_to_a_rank_and_gpu(agent, trainer, nc):
    reply = await trainer.hello("jobA", rank=2, gpu_index=1)
    assert reply.ok, reply.error
    assert reply.result["node"] == agent.settings.node
    assert reply.result["gpu_index"] == 1
    assert reply.result["gpu_uuid"] == agent.agents[1].info.uuid
    assert reply.result["supported_graphics_clocks_mhz"][0] == 1740
    binding = (await command(nc, agent.settings.node, 1, InfoCmd())).result["binding"]
    assert binding == {"job_id": "jobA", "rank": 2, "pid": os.getpid(), "uid": os.getuid()}


async def test_hello_for_an_unknown_gpu_is_refused(agent, trainer):
    reply = await trainer.hello("jobA", gpu_index=7)
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "GPU 7 is not managed" in reply.error
    reply = await trainer.request(K.HELLO, {"job_id": "j", "rank": -1, "gpu_index": 0})
    assert (reply.ok, reply.code) == (False, "bad_request")


async def test_events_are_forwarded_to_the_job_subject_in_batches(agent, trainer, nc):
    inbox = await Inbox.open(nc, subjects.job_events("jobE", 3, agent.settings.node))
    assert (await trainer.hello("jobE", rank=3, gpu_index=0)).ok
    trainer.event(K.EPOCH_BEGIN, 0)
    for step in range(3):
        trainer.event(K.STEP_BEGIN, step, 0)
        trainer.event(K.STEP_END, step, 0)
    trainer.event(K.EPOCH_END, 0)
    events = []
    while len(events) < 8:
        batch = await inbox.next(TrainerEventBatch)
        assert (batch.job_id, batch.rank, batch.node, batch.gpu) == (
            "jobE",
            3,
            agent.settings.node,
            0,
        )
        events += batch.events
    kinds = [e.kind for e in events]
    assert kinds == ["epoch_begin"] + ["step_begin", "step_end"] * 3 + ["epoch_end"]
    assert [e.step for e in events[1:7]] == [0, 0, 1, 1, 2, 2]
    assert all(a.t_ns <= b.t_ns for a, b in zip(events, events[1:], strict=False))


async def test_step_and_instruction_measurements_are_published(agent, trainer, nc):
    inbox = await Inbox.open(nc, f"zeus.job.jobM.meas.{agent.settings.node}")
    assert (await trainer.hello("jobM", rank=0, gpu_index=0)).ok
    trainer.event(K.STEP_BEGIN, 0, 0)
    trainer.event(K.INSTRUCTION_BEGIN, 0, 0, "forward")
    await asyncio.sleep(0.05)
    trainer.event(K.INSTRUCTION_END, 0, 0, "forward")
    await asyncio.sleep(0.05)
    trainer.event(K.STEP_END, 0, 0)
    measurements, marks = [], []
    while not any(m.kind == "step" for m in measurements):
        node_batch = await inbox.next(NodeMeasurementBatch)
        (batch,) = node_batch.per_gpu()
        assert (batch.job_id, batch.rank, batch.gpu) == ("jobM", 0, 0)
        measurements += batch.measurements
        marks += batch.marks
    (instr,) = [m for m in measurements if m.kind == "instruction"]
    (step,) = [m for m in measurements if m.kind == "step"]
    assert (instr.name, instr.index, instr.step) == ("forward", 0, 0)
    assert 0.045 < instr.time_s < 0.5 and instr.energy_j > 0
    assert 0.09 < step.time_s < 0.6 and step.energy_j > instr.energy_j
    assert [m.kind for m in marks] == ["step_begin", "step_end"]
    assert marks[1].energy_j - marks[0].energy_j == pytest.approx(step.energy_j, rel=1e-6)


async def test_malformed_datagrams_are_counted_reported_and_survived(agent, trainer, nc):
    inbox = await Inbox.open(nc, f"zeus.agent.{agent.settings.node}.error")
    bad = [
        b"\xc1not msgpack",
        msgpack.packb({"a": 1}),
        msgpack.packb([9, 3, 1, 2, 0, 0, ""]),  # protocol version 9
        msgpack.packb([1, 99, 1, 2, 0, 0, ""]),  # unknown kind
        msgpack.packb([1, 3, "pid", 2, 0, 0, ""]),  # pid not an int
        msgpack.packb([1, 3, 1, 2, 0, 0]),  # too short
        msgpack.packb([1, 20, 1, 1, "not a map"]),  # request without a payload map
    ]
    for data in bad:
        trainer.send(data)
    event = await inbox.until(ErrorEvent, lambda e: e.code == "malformed_datagram")
    assert event.source == f"agent:{agent.settings.node}"
    assert "malformed datagram" in event.message
    gateway = agent.gateway
    await wait_for(lambda: gateway.counters["malformed"] == len(bad), what="malformed counted")
    # still serving: a proper hello is answered and events flow
    assert (await trainer.hello("jobOK", gpu_index=0)).ok
    assert (await command(nc, agent.settings.node, 0, InfoCmd())).ok


async def test_a_bad_request_payload_gets_a_bad_request_reply(agent, trainer):
    reply = await trainer.request(K.WINDOW, {"t0_ns": "soon"})
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "WINDOW" in reply.error


async def test_events_from_a_pid_that_never_said_hello_are_dropped_and_reported(agent, nc):
    inbox = await Inbox.open(nc, f"zeus.agent.{agent.settings.node}.error")
    events = await Inbox.open(nc, "zeus.job.>")
    stranger = RawTrainer(agent.settings.socket_path)  # this process, which said no hello
    try:
        stranger.event(K.STEP_BEGIN, 0, 0)
        stranger.event(K.STEP_END, 0, 0)
        event = await inbox.until(ErrorEvent, lambda e: e.code == "unbound_trainer")
        assert f"pid {os.getpid()}" in event.message and "hello" in event.message
        await wait_for(lambda: agent.gateway.counters["unbound"] == 2, what="unbound counted")
        with pytest.raises(asyncio.TimeoutError):
            await events.sub.next_msg(timeout=0.3)
    finally:
        stranger.close()


async def test_window_energy_of_several_gpus(agent, trainer):
    t0 = time.monotonic_ns()
    await asyncio.sleep(0.1)
    t1 = time.monotonic_ns()
    reply = await trainer.request(K.WINDOW, WindowRequest(t0_ns=t0, t1_ns=t1, gpus=[0, 1]))
    assert reply.ok, reply.error
    e0, e1 = reply.result["energy_j"]
    assert 0.5 < e0 < 30 and 0.5 < e1 < 30
    assert reply.result["time_s"] == pytest.approx((t1 - t0) / 1e9)
    # nested windows: the inner one has less energy
    inner = await trainer.request(
        K.WINDOW, WindowRequest(t0_ns=t0 + (t1 - t0) // 4, t1_ns=t1 - (t1 - t0) // 4, gpus=[0])
    )
    assert 0 < inner.result["energy_j"][0] < e0


@pytest.mark.parametrize(
    ("window", "code"),
    [
        ({"t0_ns": 2, "t1_ns": 1, "gpus": [0]}, "bad_request"),
        ({"t0_ns": 1, "t1_ns": 2, "gpus": [5]}, "bad_request"),
        ({"t0_ns": 1, "t1_ns": 2, "gpus": [0]}, "out_of_range"),  # long before the ring
    ],
)
async def test_window_errors(agent, trainer, window, code):
    reply = await trainer.request(K.WINDOW, window)
    assert (reply.ok, reply.code) == (False, code)


async def test_registrations_are_relayed_to_the_coordinator(agent, trainer, nc):
    seen = []
    uids: list[int | None] = []
    relayed_ranks: list[RegisterRank] = []

    async def coordinator(msg):
        seen.append(msg.subject)
        if ".jobs.register." in msg.subject:
            job = codec.decode(msg.data, RegisterJob)
            uids.append(job.uid)
            reply = Reply.success(job_id=f"{job.job.job_metadata}-0001")
        else:
            rank = codec.decode(msg.data, RegisterRank)
            relayed_ranks.append(rank)
            uids.append(rank.uid)
            reply = Reply.success(rank=rank.rank_info.rank)
        await msg.respond(codec.encode(reply))

    sub = await nc.subscribe("zeus.coord.*.register.*", cb=coordinator)
    await confirm_subscriptions(nc)
    job = JobInfo(job_metadata="relay", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    forged = RegisterJob(job=job, uid=4242)  # the agent stamps the kernel's uid instead
    reply = await trainer.request(K.REGISTER_JOB, forged)
    assert reply.ok and reply.result == {"job_id": "relay-0001"}
    assert (await trainer.hello("relay-0001", rank=0, gpu_index=0)).ok
    rank = RegisterRank(
        job_id="relay-0001",
        rank_info=RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1740]),
        gpu=GpuBinding(node=agent.settings.node, gpu_index=0),
    )
    # A description the trainer made up is replaced by the agent's own.
    forged_gpu = GpuDescription(
        index=0, uuid="GPU-forged", name="x", architecture="x", min_power_limit_w=1,
        max_power_limit_w=10_000, default_power_limit_w=10_000, supported_memory_clocks_mhz=[],
        supported_graphics_clocks_mhz=[], has_energy_counter=False, power_limit_w=1)
    reply = await trainer.request(K.REGISTER_RANK, rank.model_copy(update={"gpu_info": forged_gpu}))
    assert reply.ok and reply.result == {"rank": 0}
    node = agent.settings.node
    assert seen == [subjects.coord_register_job(node), subjects.coord_register_rank(node)]
    assert uids == [os.getuid(), os.getuid()]
    relayed = relayed_ranks[0].gpu_info
    described = agent.agents[0].info
    assert relayed is not None and (relayed.index, relayed.uuid) == (0, described.uuid)
    assert (relayed.min_power_limit_w, relayed.max_power_limit_w) == (
        described.min_power_limit_w, described.max_power_limit_w)
    await sub.unsubscribe()


async def test_registration_without_a_coordinator_is_unavailable(agent, trainer):
    job = JobInfo(job_metadata="alone", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    reply = await trainer.request(K.REGISTER_JOB, RegisterJob(job=job))
    assert (reply.ok, reply.code) == (False, "unavailable")
    assert "zeus-coordinator" in reply.error
    assert agent.gateway.counters["relay_failed"] == 1


async def _install(nc, agent, frequencies):
    schedule = FrequencySchedule(rank=0, frequencies=frequencies)
    cmd = InstallScheduleCmd(job_id="jobS", schedule=schedule, holder="coord", lease_s=30)
    reply = await command(nc, agent.settings.node, 0, cmd)
    assert reply.ok, reply.error


async def test_schedule_is_executed_in_order_on_each_instruction_begin(agent, trainer, nc):
    plan = [("forward", 1740), ("forward", 1500), ("backward", 1200), ("backward", 900)]
    await _install(nc, agent, plan)
    assert (await trainer.hello("jobS", rank=0, gpu_index=0)).ok
    gpu = agent.agents[0].gpu
    gpu.locks = []
    for step in range(2):
        trainer.event(K.STEP_BEGIN, step, 0)
        for i, (name, _) in enumerate(plan):
            trainer.event(K.INSTRUCTION_BEGIN, step * len(plan) + i, step, name)
            trainer.event(K.INSTRUCTION_END, step * len(plan) + i, step, name)
            await asyncio.sleep(0.002)  # the agent shares this loop; Linux queues 10 datagrams
        trainer.event(K.STEP_END, step, 0)
    await wait_for(lambda: len(gpu.locks) == 2 * len(plan), what="all frequencies applied")
    assert [lo for lo, _, _ in gpu.locks] == [f for _, f in plan] * 2
    assert all(lo == hi for lo, hi, _ in gpu.locks)
    assert agent.agents[0].counters["mismatches"] == 0
    assert gpu.get_locked_sm_clocks_mhz() == (900, 900)


async def test_schedule_mismatch_is_an_error_event(agent, trainer, nc):
    errors = await Inbox.open(nc, f"zeus.gpu.{agent.settings.node}.0.error")
    await _install(nc, agent, [("forward", 1740), ("backward", 1200)])
    assert (await trainer.hello("jobS", rank=0, gpu_index=0)).ok
    trainer.event(K.STEP_BEGIN, 0, 0)
    trainer.event(K.INSTRUCTION_BEGIN, 0, 0, "backward")  # expected forward
    event = await errors.until(ErrorEvent, lambda e: e.code == "schedule_mismatch")
    assert "'forward'" in event.message and "'backward'" in event.message
    assert (event.job_id, event.rank) == ("jobS", 0)
    assert event.detail == {"instruction": "backward", "index": 0}
    # the step ends early: the leftover pair is reported too
    trainer.event(K.STEP_END, 0, 0)
    event = await errors.until(ErrorEvent, lambda e: e.code == "schedule_mismatch")
    assert "more frequencies than expected" in event.message
    await wait_for(lambda: agent.agents[0].counters["mismatches"] == 2, what="mismatches counted")


async def test_bye_releases_the_gpu(agent, trainer, nc):
    await _install(nc, agent, [("forward", 1500)])
    assert (await trainer.hello("jobS", rank=0, gpu_index=0)).ok
    trainer.event(K.STEP_BEGIN, 0, 0)
    trainer.event(K.INSTRUCTION_BEGIN, 0, 0, "forward")
    gpu = agent.agents[0].gpu
    await wait_for(lambda: gpu.get_locked_sm_clocks_mhz() == (1500, 1500), what="applied")
    reply = await trainer.request(K.BYE, {})
    assert reply.ok
    assert set(reply.result["restored"]) == {"gpu0:schedule", "gpu0:sm_clocks"}
    assert gpu.get_locked_sm_clocks_mhz() is None
    assert (await command(nc, agent.settings.node, 0, InfoCmd())).result["binding"] is None


async def test_a_nodes_ranks_registering_together_go_in_one_request(agent, nc):
    """Both GPUs' registrations waiting: the agent sends them at once, in one request (in
    columns: `RegisterRankColumns`), and each trainer gets its own rank's reply."""
    requests: list[dict] = []

    async def coordinator(msg):
        requests.append(codec.unpack(msg.data))
        decoded = decode_registration(msg.data)
        ranks = decoded if isinstance(decoded, list) else [decoded]
        replies = [Reply.success(rank=r.rank_info.rank, gpu=r.gpu.gpu_index) for r in ranks]
        reply = (Reply.success(replies=[r.model_dump() for r in replies])
                 if isinstance(decoded, list) else replies[0])
        await msg.respond(codec.encode(reply))

    sub = await nc.subscribe(subjects.coord_register_rank(agent.settings.node), cb=coordinator)
    await confirm_subscriptions(nc)
    trainers = [RawTrainer(agent.settings.socket_path) for _ in range(2)]
    try:
        for i, t in enumerate(trainers):
            assert (await t.hello("together", rank=i, gpu_index=i)).ok
        ranks = [RegisterRank(job_id="together",
                              rank_info=RankInfo(rank=i, dp_rank=i, pp_rank=0, tp_rank=0,
                                                 available_frequencies=[1740]),
                              gpu=GpuBinding(node=agent.settings.node, gpu_index=i))
                 for i in range(2)]
        replies = await asyncio.gather(*(t.request(K.REGISTER_RANK, rank)
                                         for t, rank in zip(trainers, ranks, strict=True)))
    finally:
        for t in trainers:
            t.close()
        await sub.unsubscribe()
    assert [(r.ok, r.result) for r in replies] == [(True, {"rank": 0, "gpu": 0}),
                                                   (True, {"rank": 1, "gpu": 1})]
    assert len(requests) == 1 and requests[0]["columns"] == 1 and requests[0]["rank"] == [0, 1]
    assert requests[0]["power_limit_w"] == [300, 300]  # described, as alone
