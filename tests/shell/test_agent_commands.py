"""GPU commands over a real nats-server: every op, every error code, and the agent survives."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from tests.shell.agent_kit import Inbox, command, running_agent, stop_agent
from zeus_agent.models import FrequencySchedule, PowerLimitMeasurement
from zeus_agent.wire import codec
from zeus_agent.wire.messages import (
    AgentHello,
    BindRankCmd,
    ClearScheduleCmd,
    EnergyCmd,
    InfoCmd,
    InstallScheduleCmd,
    LockClocksCmd,
    RenewLeasesCmd,
    ResetClocksCmd,
    ResetPowerLimitCmd,
    SelectCmd,
    SetPowerLimitCmd,
    UnbindRankCmd,
)


@pytest.fixture
async def agent(nats_server):
    async with running_agent(nats_server.url) as server:
        yield server


async def test_announces_its_gpus_and_heartbeats(nats_server, nc):
    inbox = await Inbox.open(nc, "zeus.agent.*.hello")
    async with running_agent(nats_server.url, sim_count=2, heartbeat_s=0.2) as server:
        first = await inbox.until(AgentHello, lambda h: h.node == server.settings.node)
        assert [g.index for g in first.gpus] == [0, 1]
        assert first.gpus[0].name == "NVIDIA A40"
        assert first.gpus[0].supported_graphics_clocks_mhz[0] == 1740
        assert first.gpus[0].power_limit_w == first.gpus[0].default_power_limit_w == 300
        again = await inbox.until(AgentHello, lambda h: h.node == server.settings.node)
        assert again.agent_id == first.agent_id


async def test_info(agent, nc):
    reply = await command(nc, agent.settings.node, 0, InfoCmd())
    assert reply.ok, reply.error
    assert reply.result["gpu"]["uuid"].startswith("GPU-")
    assert reply.result["leases"] == []
    assert reply.result["binding"] is None
    assert reply.result["schedule_installed"] is False


async def test_set_and_reset_power_limit(agent, nc):
    node, gpu = agent.settings.node, agent.agents[0].gpu
    reply = await command(
        nc, node, 0, SetPowerLimitCmd(power_limit_w=200, holder="job1", lease_s=30)
    )
    assert reply.ok, reply.error
    assert reply.result == {"power_limit_w": 200, "previous_w": 300}
    assert gpu.get_power_limit_w() == 200
    leases = (await command(nc, node, 0, InfoCmd())).result["leases"]
    assert [(lease["kind"], lease["holder"]) for lease in leases] == [("power_limit", "job1")]
    assert 29 < leases[0]["remaining_s"] <= 30

    reply = await command(nc, node, 0, ResetPowerLimitCmd())
    assert reply.ok and reply.result == {"power_limit_w": 300}
    assert gpu.get_power_limit_w() == 300
    assert (await command(nc, node, 0, InfoCmd())).result["leases"] == []


@pytest.mark.parametrize("limit_w", [99, 301])
async def test_power_limit_out_of_range_is_refused(agent, nc, limit_w):
    reply = await command(nc, agent.settings.node, 0, SetPowerLimitCmd(power_limit_w=limit_w))
    assert not reply.ok
    assert reply.code == "out_of_range"
    assert "[100, 300] W" in reply.error
    assert agent.agents[0].gpu.get_power_limit_w() == 300


@pytest.mark.parametrize("limit_w", [-5, 0, 10_001, 2**63 - 1])
async def test_power_limit_outside_physical_bounds_is_a_bad_request(agent, nc, limit_w):
    """No GPU has such a limit: the contract refuses it before the GPU is asked."""
    raw = codec.encode({"v": 1, "cmd": {"op": "set_power_limit", "power_limit_w": limit_w}})
    reply = await command(nc, agent.settings.node, 0, raw)
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "power_limit_w" in reply.error
    assert agent.agents[0].gpu.get_power_limit_w() == 300


async def test_lock_and_reset_clocks(agent, nc):
    node, gpu = agent.settings.node, agent.agents[0].gpu
    reply = await command(nc, node, 0, LockClocksCmd(min_mhz=1200, max_mhz=1500, holder="j"))
    assert reply.ok, reply.error
    assert gpu.get_locked_sm_clocks_mhz() == (1200, 1500)  # type: ignore[attr-defined]
    assert (await command(nc, node, 0, ResetClocksCmd())).ok
    assert gpu.get_locked_sm_clocks_mhz() is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("lo", "hi", "needle"),
    [
        (1201, 1500, "1201 MHz is not supported"),
        (1200, 1741, "1741 MHz is not supported"),
        (1500, 1200, "must not exceed"),
    ],
)
async def test_unsupported_clock_is_refused(agent, nc, lo, hi, needle):
    reply = await command(nc, agent.settings.node, 0, LockClocksCmd(min_mhz=lo, max_mhz=hi))
    assert not reply.ok
    assert reply.code == "out_of_range"
    assert needle in reply.error
    assert agent.agents[0].gpu.get_locked_sm_clocks_mhz() is None  # type: ignore[attr-defined]


async def test_install_and_clear_schedule(agent, nc):
    node = agent.settings.node
    schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1740), ("backward", 1200)])
    reply = await command(nc, node, 0, InstallScheduleCmd(job_id="j", schedule=schedule))
    assert reply.ok and reply.result == {"instructions": 2}
    info = (await command(nc, node, 0, InfoCmd())).result
    assert info["schedule_installed"] is True
    assert [lease["kind"] for lease in info["leases"]] == ["schedule"]
    reply = await command(nc, node, 0, ClearScheduleCmd())
    assert reply.ok and "schedule" in reply.result["restored"]
    assert (await command(nc, node, 0, InfoCmd())).result["schedule_installed"] is False


@pytest.mark.parametrize(
    ("frequencies", "needle"),
    [
        ([("forward", 1741)], "does not support"),
        ([], "is empty"),
        ([("", 1740)], "empty or non-string name"),
    ],
)
async def test_bad_schedule_is_refused(agent, nc, frequencies, needle):
    schedule = FrequencySchedule(rank=0, frequencies=frequencies)
    reply = await command(
        nc, agent.settings.node, 0, InstallScheduleCmd(job_id="j", schedule=schedule)
    )
    assert not reply.ok
    assert reply.code == "out_of_range"
    assert needle in reply.error
    assert agent.agents[0].cursor.installed is False


async def test_bind_and_unbind(agent, nc):
    node = agent.settings.node
    reply = await command(nc, node, 0, BindRankCmd(job_id="job7", rank=3))
    assert reply.ok and reply.result == {"job_id": "job7", "rank": 3}
    binding = (await command(nc, node, 0, InfoCmd())).result["binding"]
    assert binding == {"job_id": "job7", "rank": 3, "pid": None, "uid": None}
    assert (await command(nc, node, 0, UnbindRankCmd())).ok
    assert (await command(nc, node, 0, InfoCmd())).result["binding"] is None


async def test_energy_of_a_window(agent, nc):
    node = agent.settings.node
    t0 = time.monotonic_ns()
    await asyncio.sleep(0.1)
    t1 = time.monotonic_ns()
    reply = await command(nc, node, 0, EnergyCmd(t0_ns=t0, t1_ns=t1))
    assert reply.ok, reply.error
    # An idle A40 draws tens of watts: some joules over 0.1 s, far less than at 300 W.
    assert 0.5 < reply.result["energy_j"] < 30
    assert reply.result["time_s"] == pytest.approx((t1 - t0) / 1e9)


async def test_energy_errors(agent, nc):
    node = agent.settings.node
    now = time.monotonic_ns()
    reply = await command(nc, node, 0, EnergyCmd(t0_ns=now, t1_ns=now - 1))
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert "t1_ns" in reply.error
    # (Before what the ring keeps: an hour ago, or the boot of a machine up for less.)
    reply = await command(nc, node, 0, EnergyCmd(t0_ns=max(0, now - 3_600 * 10**9), t1_ns=now))
    assert (reply.ok, reply.code) == (False, "out_of_range")


async def test_renew_leases_by_command(agent, nc):
    node = agent.settings.node
    await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=250, holder="h", lease_s=5))
    reply = await command(nc, node, 0, RenewLeasesCmd(holder="h", lease_s=50))
    assert reply.ok and reply.result == {"renewed": ["power_limit"]}
    reply = await command(nc, node, 0, RenewLeasesCmd(holder="nobody", lease_s=50))
    assert reply.ok and reply.result == {"renewed": []}
    leases = (await command(nc, node, 0, InfoCmd())).result["leases"]
    assert leases[0]["remaining_s"] > 40


def _raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xc1garbage", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (_raw([1, 2, 3]), "must be a map"),
        (_raw({"v": 2, "cmd": {"op": "info"}}), "schema version 2 is not supported"),
        (_raw({"v": 1, "cmd": {"op": "explode"}}), "cmd"),
        (_raw({"v": 1, "cmd": {"op": "set_power_limit"}}), "power_limit_w"),
        (_raw({"v": 1, "cmd": {"op": "set_power_limit", "power_limit_w": "x"}}), "power_limit_w"),
        (_raw({"v": 1, "cmd": {"op": "info", "extra": 1}}), "extra"),
        (
            _raw({"v": 1, "cmd": {"op": "set_power_limit", "power_limit_w": 200, "lease_s": -1}}),
            "lease_s",
        ),
    ],
    ids=[
        "bad-msgpack",
        "empty",
        "not-a-map",
        "schema-version",
        "unknown-op",
        "missing-field",
        "wrong-type",
        "extra-field",
        "negative-lease",
    ],
)
async def test_malformed_commands_get_bad_request_and_the_agent_keeps_serving(
    agent, nc, payload, needle
):
    node = agent.settings.node
    reply = await command(nc, node, 0, payload)
    assert not reply.ok
    assert reply.code == "bad_request"
    assert needle in reply.error
    assert agent.agents[0].gpu.get_power_limit_w() == 300
    assert (await command(nc, node, 0, InfoCmd())).ok


async def test_unexpected_failure_is_an_internal_error_without_internals(agent, nc, monkeypatch):
    def boom(*_a):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(agent.agents[0].gpu, "get_power_limit_w", boom)
    reply = await command(nc, agent.settings.node, 0, SetPowerLimitCmd(power_limit_w=200))
    assert (reply.ok, reply.code) == (False, "internal")
    assert "secret" not in reply.error
    monkeypatch.undo()
    assert (await command(nc, agent.settings.node, 0, InfoCmd())).ok


async def test_each_gpu_has_its_own_endpoint(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as server:
        node = server.settings.node
        assert (await command(nc, node, 1, SetPowerLimitCmd(power_limit_w=150))).ok
        assert server.agents[1].gpu.get_power_limit_w() == 150
        assert server.agents[0].gpu.get_power_limit_w() == 300
        # nats.micro discovery: the agent answers $SRV.PING.
        msg = await nc.request("$SRV.PING.zeus-agent", b"", timeout=2)
        assert b"zeus-agent" in msg.data
        await stop_agent(server)
        assert server.agents[1].gpu.get_power_limit_w() == 300  # restored on the way out


async def test_a_question_for_a_trainer_no_longer_here_is_answered_trainer_left(agent, nc):
    measured = [PowerLimitMeasurement(power_limit=200, energy=10.0, time=1.0)]
    reply = await command(nc, agent.settings.node, 0,
                          SelectCmd(job_id="gone", request=1, measurements=measured))
    assert (reply.ok, reply.code) == (False, "trainer_left")
    assert reply.error.startswith("no trainer of job 'gone' is bound to GPU 0")
