"""A budget's node cap on a real agent (sim GPUs) over a real nats-server.

The cap clamps every limit the agent applies: a job's set, a reset to default, the restore
when the job's lease lapses (its coordinator is gone). It is renewed by its holder, kept when
the job's lease lapses, and when it is lifted or its own lease ends the job's limit (or the
default) comes back. Bad caps are refused and change nothing; a clean shutdown leaves the GPU
at its defaults.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from tests.shell.agent_kit import command, running_agent, stop_agent, wait_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    MAX_LEASE_S,
    InfoCmd,
    LeaseRenewal,
    ResetPowerLimitCmd,
    SetPowerLimitCmd,
)
from zeus_agent.wire.node_cap import MAX_CAP_LEASE_S, NodeCapCmd

HOLDER = "budget:grid"


@pytest.fixture
async def agent(nats_server):
    async with running_agent(nats_server.url) as server:
        yield server


def _limit(agent) -> int:
    return agent.agents[0].gpu.get_power_limit_w()


async def _cap(nc, agent, cap_w: int | None, lease_s: float = 30.0, holder: str = HOLDER):
    reply = await command(nc, agent.settings.node, 0,
                          NodeCapCmd(holder=holder, cap_w=cap_w, lease_s=lease_s))
    assert reply.ok, reply.error
    return reply.result


def test_the_caps_lease_is_bounded_like_every_other() -> None:
    assert MAX_CAP_LEASE_S == MAX_LEASE_S


async def test_every_limit_is_clamped_and_the_jobs_comes_back_when_lifted(agent, nc) -> None:
    node = agent.settings.node
    assert _limit(agent) == 300
    result = await _cap(nc, agent, 220)
    assert result["node_cap"]["cap_w"] == 220 and result["power_limit_w"] == 220
    assert _limit(agent) == 220  # no job: the default is clamped too

    reply = await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=260, holder="job"))
    assert reply.ok and reply.result["capped_w"] == 220
    assert _limit(agent) == 220
    await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=180, holder="job"))
    assert _limit(agent) == 180  # under the cap: the job's own
    assert (await command(nc, node, 0, ResetPowerLimitCmd())).result["power_limit_w"] == 220
    assert _limit(agent) == 220  # a reset to default stays under the cap

    await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=260, holder="job"))
    other = await _cap(nc, agent, None, holder="budget:other")
    assert other["lifted"] is False and _limit(agent) == 220  # not its cap
    lifted = await _cap(nc, agent, None)
    assert lifted["lifted"] is True and lifted["node_cap"] is None
    assert _limit(agent) == 260  # the job's limit is back
    info = (await command(nc, node, 0, InfoCmd())).result
    assert info["node_cap"] is None


async def test_the_cap_outlives_the_jobs_lease_and_ends_with_its_own(agent, nc) -> None:
    node = agent.settings.node
    await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=250, holder="job", lease_s=0.5))
    await _cap(nc, agent, 200, lease_s=1.5)
    assert _limit(agent) == 200
    # The job's coordinator is gone: its lease lapses, the GPU stays at the cap, not 300 W.
    await wait_for(lambda: not agent.agents[0].leases.held(), 3, "the job's lease lapsed")
    assert _limit(agent) == 200
    # The budget's holder renews on the lease subject, as it does for a job.
    for _ in range(3):
        await nc.publish(subjects.lease_renewal(HOLDER),
                         codec.encode(LeaseRenewal(holder=HOLDER, lease_s=1.5)))
        await asyncio.sleep(0.5)
    info = (await command(nc, node, 0, InfoCmd())).result
    assert info["node_cap"]["cap_w"] == 200 and info["node_cap"]["remaining_s"] > 0.5
    await wait_for(lambda: _limit(agent) == 300, 4, "the default back once the cap's lease ended")
    assert agent.agents[0].cap.holder.cap is None


@pytest.mark.parametrize("cmd", [
    {"op": "node_cap", "holder": HOLDER, "cap_w": 0},
    {"op": "node_cap", "holder": HOLDER, "cap_w": -5},
    {"op": "node_cap", "holder": HOLDER, "cap_w": 200, "lease_s": float("nan")},
    {"op": "node_cap", "holder": HOLDER, "cap_w": 200, "lease_s": 0},
    {"op": "node_cap", "holder": HOLDER, "cap_w": 200, "lease_s": MAX_LEASE_S + 1},
    {"op": "node_cap", "holder": "", "cap_w": 200},
    {"op": "node_cap", "holder": HOLDER, "cap_w": 200, "extra": 1},
], ids=["zero", "negative", "nan_lease", "zero_lease", "long_lease", "no_holder", "extra"])
async def test_a_bad_cap_is_refused_and_changes_nothing(agent, nc, cmd) -> None:
    raw = msgpack.packb({"v": 1, "cmd": cmd}, use_bin_type=True)
    reply = await command(nc, agent.settings.node, 0, raw)
    assert (reply.ok, reply.code) == (False, "bad_request")
    assert _limit(agent) == 300 and agent.agents[0].cap.holder.cap is None


async def test_a_cap_under_the_minimum_holds_the_minimum(agent, nc) -> None:
    minimum = agent.agents[0].info.min_power_limit_w
    result = await _cap(nc, agent, max(1, minimum - 50))
    assert result["node_cap"]["cap_w"] == minimum and _limit(agent) == minimum


async def test_a_clean_shutdown_leaves_the_defaults(nats_server, nc) -> None:
    async with running_agent(nats_server.url) as server:
        await _cap(nc, server, 200)
        gpu = server.agents[0].gpu
        assert gpu.get_power_limit_w() == 200
        await stop_agent(server)
        assert gpu.get_power_limit_w() == 300
