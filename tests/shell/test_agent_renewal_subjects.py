"""An agent follows the lease renewals of the holders of its leases only (a real nats-server).

Every agent subscribed to `<p>.lease.*` used to receive every job's renewals: deliveries grew
with jobs x nodes. Now each follows `<p>.lease.<holder>` for the holders of its GPUs' leases
(settings and node caps), subscribed before the command that granted the lease is answered,
and left once the holder holds nothing on the node.
"""

from __future__ import annotations

import asyncio

from tests.shell.agent_kit import command, running_agent, wait_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import LeaseRenewal, ResetPowerLimitCmd, SetPowerLimitCmd
from zeus_agent.wire.node_cap import NodeCapCmd


def followed(agent) -> set[str]:
    return set(agent.renewals.subs)


async def test_a_renewal_sent_as_soon_as_the_grant_is_answered_renews_it(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        gpu = agent.agents[0]
        set_pl = SetPowerLimitCmd(power_limit_w=200, holder="job-a", lease_s=0.4)
        assert (await command(nc, agent.settings.node, 0, set_pl)).ok
        # No pause: the subscription was in place before the reply.
        granted = gpu.leases.get("power_limit").deadline_ns
        await nc.publish(subjects.lease_renewal("job-a"),
                         codec.encode(LeaseRenewal(holder="job-a", lease_s=5)))
        await wait_for(lambda: gpu.leases.get("power_limit").deadline_ns > granted + 10**9, 2,
                       "renewed by the first renewal")
        assert followed(agent) == {"job-a"}


async def test_only_the_holders_of_leases_here_are_followed_and_dropped_when_they_go(
    nats_server, nc
):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        assert followed(agent) == set()
        for i in (0, 1):
            cmd = SetPowerLimitCmd(power_limit_w=200, holder="job-a", lease_s=30)
            assert (await command(nc, node, i, cmd)).ok
        cap = NodeCapCmd(holder="budget:b1", cap_w=250, lease_s=30)
        assert (await command(nc, node, 1, cap)).ok
        assert followed(agent) == {"job-a", "budget:b1"}
        # Another holder's renewals (here: malformed) never reach this agent; its holders' do.
        await nc.publish(subjects.lease_renewal("job-elsewhere"), b"\xc1 not msgpack")
        await nc.publish(subjects.lease_renewal("job-a"), b"\xc1 not msgpack")
        await wait_for(lambda: agent.counters["bad_lease_renewal"] == 1, 2, "counted")
        await asyncio.sleep(0.2)
        assert agent.counters["bad_lease_renewal"] == 1
        # One GPU's lease released: the holder still holds the other's.
        assert (await command(nc, node, 0, ResetPowerLimitCmd())).ok
        assert followed(agent) == {"job-a", "budget:b1"}
        assert (await command(nc, node, 1, ResetPowerLimitCmd())).ok
        assert followed(agent) == {"budget:b1"}
        lift = NodeCapCmd(holder="budget:b1", cap_w=None, lease_s=30)
        assert (await command(nc, node, 1, lift)).ok
        assert followed(agent) == set()


async def test_a_lapsed_lease_is_no_longer_followed(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        set_pl = SetPowerLimitCmd(power_limit_w=200, holder="job-a", lease_s=0.3)
        assert (await command(nc, agent.settings.node, 0, set_pl)).ok
        assert followed(agent) == {"job-a"}
        await wait_for(lambda: not followed(agent), 2, "left after the lease lapsed")
        assert agent.agents[0].gpu.get_power_limit_w() == 300
