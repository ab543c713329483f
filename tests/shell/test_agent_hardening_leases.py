"""Bounded leases, applied only together with the setting, over a real nats-server.

A lease that is not a finite number of seconds in (0, MAX_LEASE_S] is refused before anything
touches the GPU, whether it comes on the bus (raw msgpack, so no client-side model stands in
the way) or through `GpuAgent`'s own API; a command without a lease gets the agent's default
one; an out-of-range limit or clock is refused before anything is applied; and when applying
fails, the lease granted for it is dropped again.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request

import msgpack
import pytest

from tests.shell.agent_kit import command, running_agent, wait_for
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.errors import GPUUnavailableError, PayloadError
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.threaded import GPUCaller
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    MAX_LEASE_S,
    MAX_TEXT_CHARS,
    InfoCmd,
    LeaseRenewal,
    SetPowerLimitCmd,
)

BAD_LEASES = [math.nan, math.inf, -math.inf, 1e300, MAX_LEASE_S + 1, -1.0, 0.0]
BAD_IDS = ["nan", "inf", "-inf", "1e300", "max+1", "negative", "zero"]


@pytest.fixture
async def agent(nats_server):
    async with running_agent(nats_server.url) as server:
        yield server


def _raw(cmd: dict) -> bytes:
    return msgpack.packb({"v": 1, "cmd": cmd}, use_bin_type=True)


async def _unchanged(nc, agent) -> None:
    """The GPU is at its defaults and no lease is held."""
    gpu = agent.agents[0].gpu
    assert gpu.get_power_limit_w() == 300
    assert gpu.get_locked_sm_clocks_mhz() is None
    assert agent.agents[0].cursor.installed is False
    info = (await command(nc, agent.settings.node, 0, InfoCmd())).result
    assert info["leases"] == []
    assert len(agent.agents[0].leases) == 0


@pytest.mark.parametrize("lease_s", BAD_LEASES, ids=BAD_IDS)
@pytest.mark.parametrize(
    "cmd",
    [
        {"op": "set_power_limit", "power_limit_w": 200, "holder": "h"},
        {"op": "lock_clocks", "min_mhz": 900, "max_mhz": 900, "holder": "h"},
        {"op": "install_schedule", "job_id": "j", "holder": "h",
         "schedule": {"rank": 0, "frequencies": [["forward", 1200]]}},
    ],  # fmt: skip
    ids=["power_limit", "clocks", "schedule"],
)
async def test_a_bad_lease_on_the_bus_is_refused_and_nothing_is_applied(agent, nc, cmd, lease_s):
    reply = await command(nc, agent.settings.node, 0, _raw({**cmd, "lease_s": lease_s}))
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "lease_s" in reply.error
    await _unchanged(nc, agent)


@pytest.mark.parametrize("lease_s", BAD_LEASES, ids=BAD_IDS)
async def test_a_bad_lease_through_the_agent_api_is_refused_before_the_gpu(agent, nc, lease_s):
    gpu_agent = agent.agents[0]
    schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1200)])
    for attempt in (
        gpu_agent.set_power_limit(200, "h", lease_s),
        gpu_agent.lock_clocks(900, 900, "h", lease_s),
        gpu_agent.install_schedule("j", schedule, "h", lease_s),
    ):
        with pytest.raises(PayloadError, match="lease_s|ttl_s"):
            await attempt
    await _unchanged(nc, agent)


async def test_a_bad_lease_keeps_the_setting_and_lease_held_before(agent, nc):
    node, gpu_agent = agent.settings.node, agent.agents[0]
    good = SetPowerLimitCmd(power_limit_w=250, holder="first", lease_s=30)
    assert (await command(nc, node, 0, good)).ok
    bad = _raw({"op": "set_power_limit", "power_limit_w": 150, "holder": "second",
                "lease_s": math.inf})  # fmt: skip
    assert not (await command(nc, node, 0, bad)).ok
    with pytest.raises(PayloadError):
        await gpu_agent.set_power_limit(150, "second", math.inf)
    assert gpu_agent.gpu.get_power_limit_w() == 250
    leases = (await command(nc, node, 0, InfoCmd())).result["leases"]
    assert [(lease["holder"], lease["kind"]) for lease in leases] == [("first", "power_limit")]


@pytest.mark.parametrize(
    ("cmd", "needle"),
    [
        ({"op": "set_power_limit", "power_limit_w": 99, "lease_s": 30}, "[100, 300] W"),
        ({"op": "set_power_limit", "power_limit_w": 301, "lease_s": 30}, "[100, 300] W"),
        ({"op": "lock_clocks", "min_mhz": 1201, "max_mhz": 1500, "lease_s": 30}, "1201 MHz"),
        ({"op": "lock_clocks", "min_mhz": 210, "max_mhz": 1741, "lease_s": 30}, "1741 MHz"),
        ({"op": "lock_clocks", "min_mhz": 1500, "max_mhz": 1200}, "must not exceed"),
        ({"op": "install_schedule", "job_id": "j", "lease_s": 30,
          "schedule": {"rank": 0, "frequencies": [["forward", 1741]]}}, "does not support"),
    ],  # fmt: skip
)
async def test_an_out_of_range_setting_is_refused_before_anything_is_applied(agent, nc, cmd,
                                                                             needle):  # fmt: skip
    reply = await command(nc, agent.settings.node, 0, _raw(cmd))
    assert (reply.ok, reply.code) == (False, "out_of_range")
    assert needle in reply.error
    await _unchanged(nc, agent)


async def test_a_limit_no_gpu_has_is_a_bad_request_before_anything_is_applied(agent, nc):
    """Outside the contract's physical bounds (1..10,000 W) the payload itself is refused."""
    reply = await command(nc, agent.settings.node, 0,
                          _raw({"op": "set_power_limit", "power_limit_w": -5}))
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "power_limit_w" in reply.error
    await _unchanged(nc, agent)


async def test_a_setting_without_a_lease_gets_the_default_lease_and_lapses(nats_server, nc):
    async with running_agent(nats_server.url, default_lease_s=0.5) as agent:
        node, gpu = agent.settings.node, agent.agents[0].gpu
        assert (await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=180))).ok
        assert gpu.get_power_limit_w() == 180
        (lease,) = (await command(nc, node, 0, InfoCmd())).result["leases"]
        assert lease["kind"] == "power_limit" and 0 < lease["remaining_s"] <= 0.5
        await wait_for(lambda: gpu.get_power_limit_w() == 300, 3, "default lease lapsed")
        assert (await command(nc, node, 0, InfoCmd())).result["leases"] == []


async def test_a_valid_lease_restores_the_default_when_it_lapses(agent, nc):
    node, gpu = agent.settings.node, agent.agents[0].gpu
    cmd = SetPowerLimitCmd(power_limit_w=220, holder="h", lease_s=0.3)
    assert (await command(nc, node, 0, cmd)).ok
    assert gpu.get_power_limit_w() == 220
    await wait_for(lambda: gpu.get_power_limit_w() == 300, 3, "lease lapsed")
    await _unchanged(nc, agent)


async def test_when_applying_fails_the_lease_is_dropped_again(agent, nc, monkeypatch):
    node, gpu_agent = agent.settings.node, agent.agents[0]

    def unplugged(*_args):
        raise GPUUnavailableError("GPU fell off the bus")

    monkeypatch.setattr(gpu_agent.gpu, "set_power_limit_w", unplugged)
    monkeypatch.setattr(gpu_agent.gpu, "lock_sm_clocks_mhz", unplugged)
    reply = await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=200, holder="h", lease_s=60))
    assert (reply.ok, reply.code) == (False, "unavailable")
    reply = await command(nc, node, 0, _raw({"op": "lock_clocks", "min_mhz": 900,
                                             "max_mhz": 900, "lease_s": 60}))  # fmt: skip
    assert (reply.ok, reply.code) == (False, "unavailable")
    monkeypatch.undo()
    await _unchanged(nc, agent)


async def test_bad_renewals_are_refused_and_change_nothing(agent, nc):
    node, gpu_agent = agent.settings.node, agent.agents[0]
    assert (await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=250, holder="h",
                                                        lease_s=30))).ok  # fmt: skip
    before = gpu_agent.leases.get("power_limit")
    for lease_s in BAD_LEASES:
        reply = await command(nc, node, 0, _raw({"op": "renew", "holder": "h", "lease_s": lease_s}))
        assert (reply.ok, reply.code) == (False, "bad_request")
        with pytest.raises(PayloadError):
            gpu_agent.renew_leases("h", lease_s)
        raw = msgpack.packb({"v": 1, "holder": "h", "lease_s": lease_s})
        await nc.publish(subjects.lease_renewal("h"), raw)
    good = LeaseRenewal(holder="h", lease_s=40)
    await nc.publish(subjects.lease_renewal("h"), codec.encode(good))
    await wait_for(lambda: gpu_agent.leases.get("power_limit") != before, 3, "renewed")
    assert gpu_agent.leases.get("power_limit").deadline_ns < before.deadline_ns + 11 * 10**9


async def test_a_tiny_lease_is_still_live_when_its_setting_is_applied(agent, nc, monkeypatch):
    gpu_agent = agent.agents[0]
    live_at_call: list[bool] = []
    lock = gpu_agent.gpu.lock_sm_clocks_mhz

    def recording_lock(lo: int, hi: int) -> None:
        lease = gpu_agent.leases.get("sm_clocks")
        live_at_call.append(lease is not None and lease.deadline_ns > time.monotonic_ns())
        lock(lo, hi)

    monkeypatch.setattr(gpu_agent.gpu, "lock_sm_clocks_mhz", recording_lock)
    cmd = _raw({"op": "lock_clocks", "min_mhz": 1740, "max_mhz": 1740, "lease_s": 5e-324})
    assert (await command(nc, agent.settings.node, 0, cmd)).ok
    assert live_at_call == [True]
    await wait_for(lambda: gpu_agent.gpu.get_locked_sm_clocks_mhz() is None, 3, "lapsed")


async def test_malformed_lease_renewals_are_counted_in_metrics(nats_server, nc):
    async with running_agent(nats_server.url, metrics_port=0, metrics_host="127.0.0.1") as agent:
        # (The agent hears the renewals of the holders of its leases only.)
        hold = SetPowerLimitCmd(power_limit_w=250, holder="h", lease_s=30)
        assert (await command(nc, agent.settings.node, 0, hold)).ok
        await nc.publish(subjects.lease_renewal("h"), b"\xc1 not msgpack")
        await nc.publish(subjects.lease_renewal("h"), msgpack.packb({"v": 1, "holder": "h"}))
        await wait_for(lambda: agent.counters["bad_lease_renewal"] == 2, 3, "counted")
        url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
        assert 'zeus_agent_bus_messages_dropped_total{reason="bad_lease_renewal"} 2.0' in text


async def test_an_error_echoing_a_huge_value_still_gets_a_reply(agent, nc):
    reply = await command(nc, agent.settings.node, 0, _raw({"op": "z" * 60_000}))
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert len(reply.error) <= MAX_TEXT_CHARS


class ThreadedSlowGPU(SimGPU):
    """A simulated GPU called as NVML is (in the GPU's thread), whose resets take 0.2 s."""

    calls_block = True

    def reset_power_limit(self) -> None:
        time.sleep(0.2)
        super().reset_power_limit()


async def _no_publish(subject: str, payload: bytes) -> None:
    return None


async def test_a_set_during_a_lapsed_leases_restore_keeps_its_new_lease(tmp_path, monkeypatch):
    """Defect (blocking backends, NVML): the expiry tick removed the lapsed lease and awaited
    the reset in the GPU's thread; a set_power_limit arriving meanwhile granted a new lease,
    which the restore then released. The GPU was left at the new limit with no lease, so the
    next tick reset it as an orphan and the job's renewals had nothing to renew. Settings are
    now applied and restored one at a time per GPU."""
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = ThreadedSlowGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", _no_publish)
    try:
        await agent.start()
        await agent.set_power_limit(250, "job", 0.05)
        await asyncio.sleep(0.1)
        expiry = asyncio.create_task(agent.expire_leases())
        await asyncio.sleep(0.05)  # the restore's reset is under way in its thread
        await agent.set_power_limit(250, "job", 30.0)
        await expiry
        for _ in range(3):  # the expiry loop's next ticks
            await agent.expire_leases()
        assert gpu.get_power_limit_w() == 250
        lease = agent.leases.get("power_limit")
        assert lease is not None and lease.holder == "job"
        assert agent.renew_leases("job", 30.0) == ["power_limit"]
    finally:
        agent.caller.close()


async def test_a_clock_change_queued_behind_a_restore_is_dropped(tmp_path):
    """With a blocking backend a schedule's clock change runs in the GPU's setters' thread;
    applied after the restore that cleared the schedule it would lock the clocks with no lease
    and nothing left to unlock them (the restore's reset runs after it on the same lane)."""
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = ThreadedSlowGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", _no_publish)
    try:
        await agent.start()
        mhz = agent.info.supported_graphics_clocks_mhz[3]
        await agent.install_schedule("job", FrequencySchedule(rank=0, frequencies=[
            ("forward", mhz)]), "job", 30.0)
        agent.schedule.apply_frequency(mhz)  # as on an instruction_begin: queued, maybe not yet run
        assert await agent.restore({"schedule"}, reason="clear command") == ["schedule",
                                                                             "sm_clocks"]
        await agent.clocks.drained()
        assert gpu.get_locked_sm_clocks_mhz() is None
        assert agent.leases.get("schedule") is None
    finally:
        agent.caller.close()


async def test_clock_changes_behind_a_hung_gpu_do_not_pile_up(tmp_path, monkeypatch):
    """Adversarial review: each instruction's clock change waited its turn on the GPU's lock and
    then its full call timeout, so behind a hung GPU they queued faster than they drained, and
    the GPU's lease expiry and shutdown restore waited behind all of them. Only the latest
    wanted clock is kept: the hung call, then at most one more."""
    monkeypatch.setitem(GPUCaller.call.__kwdefaults__, "timeout_s", 0.2)

    class HangingClocksGPU(SimGPU):
        calls_block = True
        calls: list[tuple[int, int]] = []

        def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
            self.calls.append((min_mhz, max_mhz))
            time.sleep(0.3)  # longer than the call timeout: NVML stuck on the driver lock
            super().lock_sm_clocks_mhz(min_mhz, max_mhz)

    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = HangingClocksGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", _no_publish)
    try:
        await agent.start()
        clocks = agent.info.supported_graphics_clocks_mhz
        await agent.install_schedule("job", FrequencySchedule(rank=0, frequencies=[
            ("forward", clocks[3])]), "job", 30.0)
        gpu.calls.clear()
        agent.schedule.apply_frequency(clocks[0])
        await asyncio.sleep(0.05)  # its call hangs
        for i in range(1, 20):  # the trainer's next instruction_begin events meanwhile
            agent.schedule.apply_frequency(clocks[i % 4])
        await agent.clocks.drained()
        # The hung call, then only the latest wanted clock (none stale, none queued).
        assert gpu.calls == [(clocks[0],) * 2, (clocks[19 % 4],) * 2]
    finally:
        agent.caller.close()


async def test_a_set_waiting_for_a_dead_trainers_restore_is_refused(tmp_path):
    """Adversarial review: the gateway restored a dead trainer's GPU, then awaited publishing
    `trainer_gone`, then unbound it. A set of the job waiting for the restore (the GPU's lock)
    ran in that gap and leased the limit to a job whose other ranks keep renewing it: a GPU
    throttled with no trainer. The GPU is unbound as soon as its restore returns, and the
    holder is checked again under the lock."""
    from zeus_agent.agent.gateway import Gateway
    from zeus_agent.errors import SettingRefusedError
    from zeus_agent.wire.messages import ErrorEvent

    published: list[tuple[str, bytes]] = []

    async def publish(subject: str, payload: bytes) -> None:
        published.append((subject, payload))

    async def request(subject: str, payload: bytes, timeout: float) -> bytes:
        raise AssertionError("no request expected")

    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = ThreadedSlowGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", publish)
    gateway = Gateway({0: agent}, "n", "zeus", request, publish)
    try:
        await agent.start()
        agent.bind("job", 0, pid=4242)
        gateway.by_pid[4242] = [agent]
        await agent.set_power_limit(250, "job", 30.0)
        release = asyncio.create_task(gateway.release_pid(4242, reason="process exited"))
        await asyncio.sleep(0.05)  # the restore's reset is under way in its thread
        with pytest.raises(SettingRefusedError):
            await agent.set_power_limit(250, "job", 30.0)  # the coordinator's, just too late
        assert await release == ["gpu0:power_limit"]
        assert gpu.get_power_limit_w() == 300 and agent.leases.get("power_limit") is None
        gone = [codec.decode(p, ErrorEvent) for s, p in published if s.endswith(".error")]
        assert [(e.code, e.job_id, e.rank) for e in gone] == [("trainer_gone", "job", 0)]
        # Through the command path the refusal has its own code, which the coordinator does not
        # report as the job's failure (a reapply may cross the goodbye).
        from zeus_agent.agent.commands import handle_command
        from zeus_agent.wire.messages import CommandEnvelope, SetPowerLimitCmd

        reply = await handle_command(agent, codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(
            power_limit_w=250, holder="job", lease_s=30.0))))
        assert (reply.ok, reply.code) == (False, "trainer_left") and "has left" in reply.error
    finally:
        agent.caller.close()
