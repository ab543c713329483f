"""Review of `NodePower` in the budgets: no flapping subscription, no readings of unknown GPUs.

On a real nats-server, with the budget service's wall clock driven by the test:

* an agent whose publish interval is longer than three heartbeats (and 10 s) is not taken for
  an older agent every interval: its per-GPU samples were followed at the second heartbeat
  after each `NodePower` and left at the next one, a subscribe and an unsubscribe per interval
  and per node;
* readings of GPU indices a node never announced (a `NodePower` or, for an older agent, a
  sample batch) are not kept: each index was a new entry kept forever, so an agent could grow
  a replica's memory by 1,024 entries a message;
* older nodes beyond `MAX_NODE_SUBSCRIPTIONS` share one subscription to every GPU's samples
  (a subscription each, never dropped for a departed node, grew without bound);
* an agent restarted (a new agent id) without NodePower, i.e. downgraded, is followed from its
  second announcement, not 10 s (3 heartbeats) after the last NodePower of the agent before.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.budget import service
from coordinator.service import CoordinatorService
from tests.shell import node_power_kit as kit
from tests.shell.coordinator_kit import start, stop, wait_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import Sample, SampleBatch
from zeus_agent.wire.node_power import NodePower


def hello(node: str, gpus: int = 2, heartbeat_s: float = 1.0, agent_id: str = "") -> bytes:
    return kit.hello(node, gpus, heartbeat_s, agent_id)


class Clock:
    """The budget service's wall clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def heard(nc, coord: CoordinatorService, seq: int) -> None:
    """Wait until the hellos published before this are handled (a probe hello after them)."""
    probe = f"probe{os.getpid()}"
    msg = kit.hello_msg(probe, gpus=1, heartbeat_s=1.0, agent_id="probe",
                        labels={"seq": str(seq)})
    await nc.publish(subjects.agent_hello(probe), codec.encode(msg))
    await wait_for(lambda: coord.budgets.cluster.labels.get(probe) == {"seq": str(seq)}, 5)


@pytest.mark.timeout(60)
async def test_a_publish_interval_longer_than_three_heartbeats_does_not_flap(
        nats_server, nc, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    clock = Clock()
    coord.budgets.wall = clock
    node = f"slow{os.getpid()}"
    tok = subjects.token(node)
    followed = []
    try:
        await nc.publish(subjects.agent_hello(node), hello(node))
        for cycle in range(4):  # publish_interval_s=30, heartbeat_s=1
            power = NodePower(node=node, gpus=[0, 1], power_w=[150.0 + cycle, 160.0])
            await nc.publish(subjects.agent_power(node), codec.encode(power))
            await wait_for(lambda c=cycle: coord.budgets.cluster.power_w.get((node, 0))
                           == 150.0 + c, 5)
            assert tok not in coord.budgets.sample_subs
            clock.now += 11.0  # two heartbeats past 10 s without a NodePower
            await nc.publish(subjects.agent_hello(node), hello(node))
            clock.now += 1.0
            await nc.publish(subjects.agent_hello(node), hello(node))
            await heard(nc, coord, cycle)
            followed.append(tok in coord.budgets.sample_subs)
            clock.now += 18.0
        # Before its second NodePower its interval is unknown: at most that once.
        assert followed[1:] == [False, False, False], followed
        # An agent that then stops sending them (downgraded) is followed again.
        for _ in range(3):
            clock.now += 31.0
            await nc.publish(subjects.agent_hello(node), hello(node))
        await wait_for(lambda: tok in coord.budgets.sample_subs, 5)
    finally:
        await stop(coord, task)


@pytest.mark.timeout(60)
async def test_readings_of_gpus_a_node_never_announced_are_not_kept(
        nats_server, nc, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    node = f"few{os.getpid()}"
    power_w = coord.budgets.cluster.power_w
    try:
        await nc.publish(subjects.agent_hello(node), hello(node, gpus=2))
        await wait_for(lambda: node in coord.budgets.cluster.labels, 5)
        for first in range(2, 2 + 3 * 1000, 1000):  # 1,000 new indices a message
            extra = list(range(first, first + 1000))
            power = NodePower(node=node, gpus=[0, 1, *extra],
                              power_w=[200.0, 210.0, *[1.0] * len(extra)])
            await nc.publish(subjects.agent_power(node), codec.encode(power))
        last = NodePower(node=node, gpus=[0, 1], power_w=[220.0, 230.0])
        await nc.publish(subjects.agent_power(node), codec.encode(last))
        await wait_for(lambda: power_w.get((node, 0)) == 220.0, 5)
        assert sorted(k for k in power_w if k[0] == node) == [(node, 0), (node, 1)]
        # The agent restarts with one GPU: GPU 1's readings are no longer kept.
        await nc.publish(subjects.agent_hello(node), hello(node, gpus=1))
        again = NodePower(node=node, gpus=[0, 1], power_w=[240.0, 250.0])
        await nc.publish(subjects.agent_power(node), codec.encode(again))
        await wait_for(lambda: power_w.get((node, 0)) == 240.0, 5)
        assert (node, 1) not in power_w
        # An older agent's followed samples: the same.
        old = f"oldfew{os.getpid()}"
        for _ in range(2):
            await nc.publish(subjects.agent_hello(old), hello(old, gpus=1))
        await wait_for(lambda: subjects.token(old) in coord.budgets.sample_subs, 5)
        sample = Sample(t_ns=1, energy_j=1.0, power_w=120.0, power_limit_w=300,
                        sm_clock_mhz=1000, memory_clock_mhz=1000)
        for gpu in (7, 0):
            batch = SampleBatch(node=old, gpu=gpu, uuid=f"{old}-u{gpu}", samples=[sample])
            await nc.publish(subjects.gpu_samples(old, gpu), codec.encode(batch))
        await wait_for(lambda: power_w.get((old, 0)) == 120.0, 5)
        assert (old, 7) not in power_w
    finally:
        await stop(coord, task)


@pytest.mark.timeout(60)
async def test_older_nodes_beyond_a_bound_share_one_subscription(
        nats_server, nc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "MAX_NODE_SUBSCRIPTIONS", 3)
    coord, task = await start(nats_server, tmp_path / "coord")
    budgets = coord.budgets
    olds = [f"old{i}x{os.getpid()}" for i in range(6)]
    sample = Sample(t_ns=1, energy_j=1.0, power_w=130.0, power_limit_w=300,
                    sm_clock_mhz=1000, memory_clock_mhz=1000)
    try:
        for node in olds:  # older agents: announced twice, no NodePower
            for _ in range(2):
                await nc.publish(subjects.agent_hello(node), hello(node, gpus=1))
        await wait_for(lambda: len(budgets.followed) == len(olds), 5)
        assert len(budgets.sample_subs) + (budgets.all_samples is not None) <= 3 + 1
        for node in olds:
            batch = SampleBatch(node=node, gpu=0, uuid=f"{node}-u0", samples=[sample])
            await nc.publish(subjects.gpu_samples(node, 0), codec.encode(batch))
        await wait_for(lambda: all(budgets.cluster.power_w.get((n, 0)) == 130.0
                                   for n in olds), 5)
        # A node not followed (it sends NodePower) has its samples ignored, even so.
        new = f"new{os.getpid()}"
        await nc.publish(subjects.agent_hello(new), hello(new, gpus=1))
        power = NodePower(node=new, gpus=[0], power_w=[250.0])
        await nc.publish(subjects.agent_power(new), codec.encode(power))
        await wait_for(lambda: budgets.cluster.power_w.get((new, 0)) == 250.0, 5)
        batch = SampleBatch(node=new, gpu=0, uuid=f"{new}-u0", samples=[sample])
        await nc.publish(subjects.gpu_samples(new, 0), codec.encode(batch))
        # Every older node upgraded: the shared subscription ends too.
        for node in olds:
            power = NodePower(node=node, gpus=[0], power_w=[140.0])
            await nc.publish(subjects.agent_power(node), codec.encode(power))
        await wait_for(lambda: not budgets.followed and budgets.all_samples is None, 5)
        assert budgets.sample_subs == {}
        assert budgets.cluster.power_w[(new, 0)] == 250.0
    finally:
        await stop(coord, task)


@pytest.mark.timeout(60)
async def test_a_restarted_agent_that_sends_no_node_power_is_followed_from_its_second_hello(
        nats_server, nc, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    clock = Clock()
    coord.budgets.wall = clock
    node = f"down{os.getpid()}"
    tok = subjects.token(node)
    try:
        await nc.publish(subjects.agent_hello(node), hello(node))
        power = NodePower(node=node, gpus=[0, 1], power_w=[250.0, 260.0])
        await nc.publish(subjects.agent_power(node), codec.encode(power))
        await wait_for(lambda: coord.budgets.cluster.power_w.get((node, 0)) == 250.0, 5)
        # Downgraded: restarted (a new agent id) 1 s later, as old as it gets: no NodePower.
        for _ in range(2):
            clock.now += 1.0
            await nc.publish(subjects.agent_hello(node),
                             hello(node, agent_id=f"{node}-older"))
        # (Before: its draws were read from its last NodePower 10 s and 2 heartbeats more.)
        await wait_for(lambda: tok in coord.budgets.sample_subs, 5)
    finally:
        await stop(coord, task)
