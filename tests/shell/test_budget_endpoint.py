"""The budget endpoint on a real nats-server: set, show, lift, refusals, kept across restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator.service import CoordinatorService
from tests.shell.coordinator_kit import ask, start, stop, wait_for
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.wire import subjects
from zeus_agent.wire.budget import Budget, BudgetGroup, BudgetRequest

NODE = "budget-node"


async def labelled_agent(nats_server: Any, tmp: Path) -> tuple[AgentServer, asyncio.Task]:
    server = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=0, sim_state_dir=str(tmp / "gpus"),
        socket_path=str(tmp / "agent.sock"), node=NODE, sample_hz=20,
        publish_interval_s=0.1, heartbeat_s=0.3, labels=["rack=a7"],
    ))  # fmt: skip
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.started.wait(), 10)
    return server, task


def knows_node(coord: CoordinatorService) -> bool:
    cluster = coord.budgets.cluster
    return (NODE, 1) in cluster.power_w and cluster.labels.get(NODE) == {"rack": "a7"}


async def budget(nc: Any, **kw: Any) -> Any:
    return await ask(nc, subjects.coord_budget(), BudgetRequest(**kw))


@pytest.mark.timeout(60)
async def test_set_show_lift_and_refusals_survive_a_restart(nats_server, nc, tmp_path):
    agent, agent_task = await labelled_agent(nats_server, tmp_path / "agent")
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        await wait_for(lambda: knows_node(coord), 10)
        mine = BudgetGroup(kind="nodes", nodes=[NODE])
        below = Budget(budget_id="tight", cap_w=150.0, group=mine)
        reply = await budget(nc, action="set", budget=below)
        assert not reply.ok and reply.code == "bad_request"
        assert "floor" in reply.error and "200 W" in reply.error  # two A40s at 100 W
        nobody = Budget(budget_id="x", cap_w=1e4, group=BudgetGroup(kind="label", label="rack=b9"))
        reply = await budget(nc, action="set", budget=nobody)
        assert not reply.ok and "no node is labelled rack=b9" in reply.error
        ghost = Budget(budget_id="x", cap_w=1e4, group=BudgetGroup(kind="nodes", nodes=["ghost"]))
        assert "unknown node" in (await budget(nc, action="set", budget=ghost)).error

        # Idle A40s draw ~30 W each: a 25 % cut of that is far below the floor.
        cut = Budget(budget_id="grid", cut_pct=25.0)
        reply = await budget(nc, action="set", budget=cut)
        assert not reply.ok and "below the floor of the whole cluster: 200 W" in reply.error
        grid = Budget(budget_id="grid", cap_w=300.0, note="utility call")
        reply = await budget(nc, action="set", budget=grid)
        assert reply.ok, reply
        cap = reply.result["budget"]["cap_w"]
        assert cap == 300.0 and reply.result["budget"]["state"] == "active"
        assert reply.result["budget"]["floor_w"] == 200.0 and reply.result["budget"]["gpus"] == 2
        assert reply.result["budget"]["draw_w"] > 0
        rack = Budget(budget_id="rack-a7", cap_w=400.0,
                      group=BudgetGroup(kind="label", label="rack=a7"))
        reply = await budget(nc, action="set", budget=rack)
        assert reply.ok and reply.result["overlaps"] == ["grid"]
        shown = await budget(nc, action="show")
        assert [b["budget_id"] for b in shown.result["budgets"]] == ["grid", "rack-a7"]
    finally:
        await stop(coord, task)
    # Another replica (here: the same one restarted) finds the budgets in the state bucket.
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        shown = await budget(nc, action="show")
        assert [b["budget_id"] for b in shown.result["budgets"]] == ["grid", "rack-a7"]
        assert shown.result["budgets"][0]["cap_w"] == cap
        assert (await budget(nc, action="lift", budget_id="grid")).ok
        again = await budget(nc, action="lift", budget_id="grid")
        assert not again.ok and "no budget 'grid'" in again.error
        shown = await budget(nc, action="show")
        assert [b["budget_id"] for b in shown.result["budgets"]] == ["rack-a7"]
    finally:
        await stop(coord, task)
        agent.handle_exit()
        await agent_task


async def test_malformed_requests_are_refused(nats_server, nc, tmp_path):
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        for bad in (
            {"v": 1, "action": "set", "budget": {"budget_id": "a", "cap_w": -5.0}},
            {"v": 1, "action": "set", "budget": {"budget_id": "a", "cap_w": float("nan")}},
            {"v": 1, "action": "set", "budget": {"budget_id": "a", "cap_w": 1e12}},
            {"v": 1, "action": "set",
             "budget": {"budget_id": "a", "cap_w": 1e3, "start_s": 10.0, "end_s": 5.0}},
            {"v": 1, "action": "lift"},
        ):
            reply = await ask(nc, subjects.coord_budget(), _pack(bad))
            assert not reply.ok and reply.code == "bad_request", bad
        assert (await budget(nc, action="show")).result["budgets"] == []
    finally:
        await stop(coord, task)


def _pack(data: dict[str, Any]) -> bytes:
    import msgpack

    return msgpack.packb(data)
