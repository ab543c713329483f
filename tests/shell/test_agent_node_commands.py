"""An agent serves its node's command batches over a real nats-server.

Each item of a `NodeCommandBatch` takes the path of its GPU's own request (fencing, holders,
caps): the replies are those the per-GPU subjects give, a GPU the agent lacks gets an error in
its slot, a stale lease is refused item by item, and a batch that does not validate is refused
whole with nothing applied.
"""

from __future__ import annotations

import time
from typing import Any

from tests.shell.agent_kit import running_agent
from zeus_agent.agent.server import AgentServer
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.fencing import LEASE_HEADER, SenderLease
from zeus_agent.wire.messages import (
    CommandEnvelope,
    GpuCommand,
    InfoCmd,
    Reply,
    SetPowerLimitCmd,
)
from zeus_agent.wire.node_cap import NodeCapCmd
from zeus_agent.wire.node_command import NodeCommandReply

KEY = "9b1f0c2d"


def limit(watts: int) -> SetPowerLimitCmd:
    return SetPowerLimitCmd(power_limit_w=watts, holder="job-1", lease_s=60)


def batch(*items: tuple[int, GpuCommand]) -> bytes:
    return codec.encode({"v": 1, "items": [
        {"gpu": gpu, "envelope": CommandEnvelope(cmd=cmd).model_dump()} for gpu, cmd in items]})


def headers(lease: SenderLease | None) -> dict[str, str] | None:
    return None if lease is None else {LEASE_HEADER: lease.header()}


async def send_batch(nc: Any, agent: AgentServer, data: bytes,
                     lease: SenderLease | None = None) -> NodeCommandReply | Reply:
    msg = await nc.request(subjects.node_command(agent.settings.node), data, timeout=3,
                           headers=headers(lease))
    return codec.decode_either(msg.data, Reply, NodeCommandReply, "replies")


async def send_one(nc: Any, agent: AgentServer, gpu: int, cmd: GpuCommand,
                   lease: SenderLease | None = None) -> Reply:
    msg = await nc.request(subjects.gpu_command(agent.settings.node, gpu),
                           codec.encode(CommandEnvelope(cmd=cmd)), timeout=3,
                           headers=headers(lease))
    return codec.decode(msg.data, Reply)


def limits(agent: AgentServer) -> list[int]:
    return [agent.agents[i].gpu.get_power_limit_w() for i in sorted(agent.agents)]


async def test_a_batch_answers_as_the_gpus_own_subjects_do(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=3) as agent:
        cap = NodeCapCmd(holder="budget:b", cap_w=180, lease_s=60)
        assert (await send_one(nc, agent, 2, cap)).ok
        got = await send_batch(nc, agent, batch((0, limit(200)), (2, limit(250))))
        assert isinstance(got, NodeCommandReply)
        assert [(r.ok, r.result) for r in got.replies] == [
            (True, {"power_limit_w": 200, "previous_w": 300}),
            (True, {"power_limit_w": 250, "previous_w": 180, "capped_w": 180})]
        assert limits(agent) == [200, 300, 180]
        one = [await send_one(nc, agent, 0, limit(200)), await send_one(nc, agent, 2, limit(250))]
        again = await send_batch(nc, agent, batch((0, limit(200)), (2, limit(250))))
        assert isinstance(again, NodeCommandReply)
        assert [r.model_dump() for r in again.replies] == [r.model_dump() for r in one]
        info = await send_batch(nc, agent, batch((1, InfoCmd())))
        assert isinstance(info, NodeCommandReply) and info.replies[0].result["gpu"]["index"] == 1


async def test_a_gpu_the_agent_lacks_gets_its_own_error_and_the_rest_run(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        got = await send_batch(nc, agent, batch((7, limit(200)), (1, limit(210))))
        assert isinstance(got, NodeCommandReply)
        assert (got.replies[0].ok, got.replies[0].code) == (False, "out_of_range")
        assert "no GPU 7" in got.replies[0].error and "0, 1" in got.replies[0].error
        assert got.replies[1].ok and limits(agent) == [300, 210]


async def test_a_malformed_batch_is_one_bad_request_and_nothing_is_applied(
        nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        for data in (batch((0, limit(200)), (0, limit(210))),  # a GPU twice
                     batch((0, limit(200))) + b"\x00",  # not one msgpack value
                     codec.encode({"v": 1, "items": [{"gpu": 0}]}),  # no envelope
                     b"\xc1"):
            got = await send_batch(nc, agent, data)
            assert isinstance(got, Reply) and (got.ok, got.code) == (False, "bad_request"), data
        assert limits(agent) == [300, 300]


async def test_a_stale_lease_is_refused_item_by_item(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        until = time.time() + 30.0
        newer = SenderLease("r2", "b", 9, until, KEY)
        assert (await send_one(nc, agent, 0, limit(250), newer)).ok
        older = SenderLease("r1", "a", 5, until, KEY)
        got = await send_batch(nc, agent, batch((0, limit(120)), (1, limit(130))), older)
        assert isinstance(got, NodeCommandReply)
        assert (got.replies[0].ok, got.replies[0].code) == (False, "stale_lease")
        assert got.replies[1].ok  # GPU 1 never saw r2: r1's lease is its newest
        assert limits(agent) == [250, 130]
        ended = SenderLease("r2", "b", 9, time.time() - 3.0, KEY)
        got = await send_batch(nc, agent, batch((0, limit(100)), (1, InfoCmd())), ended)
        assert isinstance(got, NodeCommandReply)
        assert [(r.ok, r.code) for r in got.replies] == [(False, "stale_lease"), (True, "")]
        assert limits(agent) == [250, 130] and agent.agents[0].counters["fenced"] == 2


async def test_the_per_gpu_subjects_still_serve(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        assert (await send_one(nc, agent, 1, limit(220))).ok
        assert limits(agent) == [300, 220]
