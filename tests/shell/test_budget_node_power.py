"""Power budgets read one `NodePower` per node, and an older agent's per-GPU samples.

On a real nats-server: a replica's budget service takes each GPU's latest draw from the
node's `NodePower` and follows no per-GPU sample subject for it; for a node whose agent sends
no `NodePower` (older) it follows that node's samples from its second announcement, and stops
once the node sends one. Bad readings are dropped, counted, and change nothing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import CoordinatorService
from tests.shell.agent_kit import running_agent
from tests.shell.coordinator_kit import start, stop, wait_for
from tests.shell.node_power_kit import hello, samples
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.node_power import NodePower


def power_of(coord: CoordinatorService, node: str, gpu: int) -> float | None:
    return coord.budgets.cluster.power_w.get((node, gpu))


@pytest.mark.timeout(60)
async def test_a_current_agents_node_power_is_read_and_no_sample_subject_followed(
        nats_server, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        async with running_agent(nats_server.url, sim_count=2, heartbeat_s=0.2) as agent:
            node = agent.settings.node
            await wait_for(lambda: power_of(coord, node, 1) is not None, 10)
            await asyncio.sleep(1.0)  # several announcements: none makes it follow samples
            assert subjects.token(node) not in coord.budgets.sample_subs
            assert coord.budgets.hellos.get(subjects.token(node)) is None
            # What it holds is the GPU's latest sampled draw.
            latest = agent.agents[1].last_sample
            assert latest is not None
            await wait_for(lambda: abs((power_of(coord, node, 1) or 0) - latest.power_w) < 60, 5)
    finally:
        await stop(coord, task)


@pytest.mark.timeout(60)
async def test_an_older_agents_samples_are_followed_until_it_sends_node_power(
        nats_server, nc, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    node = f"old{os.getpid()}"
    try:
        await nc.publish(subjects.agent_hello(node), hello(node))
        await nc.publish(subjects.gpu_samples(node, 0), samples(node, 0, 111.0))
        await nc.flush()
        await wait_for(lambda: node in coord.budgets.cluster.labels, 5)
        await asyncio.sleep(0.3)
        assert power_of(coord, node, 0) is None  # one announcement: not followed yet
        await nc.publish(subjects.agent_hello(node), hello(node))  # the second: followed
        await wait_for(lambda: subjects.token(node) in coord.budgets.sample_subs, 5)

        async def sampled(watts: float) -> bool:
            await nc.publish(subjects.gpu_samples(node, 0), samples(node, 0, watts))
            return power_of(coord, node, 0) == watts

        await wait_for_true(lambda: sampled(123.0))
        # The agent is upgraded: its first NodePower ends the per-GPU subscription.
        upgraded = NodePower(node=node, gpus=[0, 1], power_w=[150.0, 160.0])
        await nc.publish(subjects.agent_power(node), codec.encode(upgraded))
        await wait_for(lambda: subjects.token(node) not in coord.budgets.sample_subs, 5)
        assert (power_of(coord, node, 0), power_of(coord, node, 1)) == (150.0, 160.0)
        await nc.publish(subjects.gpu_samples(node, 0), samples(node, 0, 99.0))
        await nc.publish(subjects.agent_hello(node), hello(node))
        await nc.flush()
        await asyncio.sleep(0.5)
        assert power_of(coord, node, 0) == 150.0  # its samples are no longer read
        assert subjects.token(node) not in coord.budgets.sample_subs
    finally:
        await stop(coord, task)


@pytest.mark.timeout(60)
async def test_bad_power_readings_are_dropped_counted_and_change_nothing(
        nats_server, nc, tmp_path: Path) -> None:
    coord, task = await start(nats_server, tmp_path / "coord")
    node, other = f"pw{os.getpid()}", f"pv{os.getpid()}"
    try:
        await nc.publish(subjects.agent_hello(node), hello(node))  # (Only announced GPUs count.)
        await wait_for(lambda: node in coord.budgets.cluster.labels, 5)
        good = NodePower(node=node, gpus=[0], power_w=[200.0])
        await nc.publish(subjects.agent_power(node), codec.encode(good))
        await wait_for(lambda: power_of(coord, node, 0) == 200.0, 5)
        dropped = coord.link.dropped
        bad: list[Any] = [
            {"v": 1, "node": node, "gpus": [0, 1], "power_w": [1.0]},  # lengths differ
            {"v": 1, "node": node, "gpus": [0, 0], "power_w": [1.0, 2.0]},  # a GPU twice
            {"v": 1, "node": node, "gpus": [0], "power_w": [-5.0]},  # negative
            {"v": 1, "node": node, "gpus": [0], "power_w": [1e9]},  # absurd
            {"v": 1, "node": node, "gpus": [0], "power_w": ["x"]},
            {"v": 2, "node": node, "gpus": [0], "power_w": [1.0]},  # unknown version
        ]
        before = dropped["malformed"]
        for payload in bad:
            await nc.publish(subjects.agent_power(node), codec.encode(payload))
        await nc.publish(subjects.agent_power(node), b"\xc1 not msgpack")
        await wait_for(lambda: dropped["malformed"] == before + len(bad) + 1, 5)
        # Another node's readings on this node's subject (what a compromised agent could try).
        forged = NodePower(node=other, gpus=[0], power_w=[1.0])
        wrong = dropped["wrong_node"]
        await nc.publish(subjects.agent_power(node), codec.encode(forged))
        await wait_for(lambda: dropped["wrong_node"] == wrong + 1, 5)
        assert power_of(coord, node, 0) == 200.0 and power_of(coord, other, 0) is None
        again = NodePower(node=node, gpus=[0], power_w=[180.0])  # still serving
        await nc.publish(subjects.agent_power(node), codec.encode(again))
        await wait_for(lambda: power_of(coord, node, 0) == 180.0, 5)
    finally:
        await stop(coord, task)


async def wait_for_true(check: Any, timeout_s: float = 5.0) -> None:
    """Await `check()` every 50 ms until it gives True."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await check():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)
