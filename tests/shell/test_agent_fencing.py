"""An agent refuses a command sent under an ownership lease that is over, over a real nats-server.

The chaos soak (issue 38) found GPUs taking commands seconds after their sender's lease had
ended (`stale_owner`): a command held in a TCP connection through a partition, or queued in
a paused replica, arrives after the heal. Every coordinator command carries its lease in the
`Zeus-Lease` header; the agent refuses (`stale_lease`, through `reply_for`) one whose lease has
ended by its clock, or that an owner with a newer lease has overtaken, and the GPU is not
touched. A command without the header is taken as before. The histories the checker reads
record the refusal, and every restore of defaults, whatever path restored it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
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

JOB = "job-7"
KEY = "9b1f0c2d"


async def send(nc: Any, agent: AgentServer, cmd: GpuCommand, lease: SenderLease | None) -> Reply:
    headers = None if lease is None else {LEASE_HEADER: lease.header()}
    msg = await nc.request(subjects.gpu_command(agent.settings.node, 0),
                           codec.encode(CommandEnvelope(cmd=cmd)), timeout=2, headers=headers)
    return codec.decode(msg.data, Reply)


def limit(watts: int) -> SetPowerLimitCmd:
    return SetPowerLimitCmd(power_limit_w=watts, holder=JOB, lease_s=60)


def history(agent: AgentServer) -> list[dict[str, Any]]:
    assert agent.settings.history is not None
    return [json.loads(line) for line in Path(agent.settings.history).read_text().splitlines()]


async def test_a_command_whose_lease_ended_is_refused_and_changes_nothing(
        nats_server, nc, tmp_path) -> None:
    async with running_agent(nats_server.url, history=str(tmp_path / "a.history")) as agent:
        gpu = agent.agents[0].gpu
        ended = SenderLease("r2", "inc2", 12, time.time() - 3.0, KEY)
        reply = await send(nc, agent, limit(150), ended)
        assert (reply.ok, reply.code) == (False, "stale_lease")
        assert "r2, revision 12" in reply.error and "ago" in reply.error
        assert gpu.get_power_limit_w() == 300
        assert (await send(nc, agent, InfoCmd(), ended)).ok  # (A read is not fenced.)
        assert agent.agents[0].counters["fenced"] == 1
        recorded = [r for r in history(agent) if r["kind"] == "command"]
        assert [(r["op"], r["ok"], r["code"], r["owner"]) for r in recorded] == [
            ("set_power_limit", False, "stale_lease", "r2")]
        live = SenderLease("r2", "inc2", 12, time.time() + 10.0, KEY)
        assert (await send(nc, agent, limit(150), live)).ok
        assert gpu.get_power_limit_w() == 150


async def test_a_newer_owner_fences_the_older_one_off_whatever_the_clock_says(
        nats_server, nc) -> None:
    async with running_agent(nats_server.url) as agent:
        gpu = agent.agents[0].gpu
        until = time.time() + 30.0
        assert (await send(nc, agent, limit(200), SenderLease("r1", "a", 5, until, KEY))).ok
        assert (await send(nc, agent, limit(250), SenderLease("r2", "b", 9, until, KEY))).ok
        late = await send(nc, agent, limit(120), SenderLease("r1", "a", 5, until, KEY))
        assert (late.ok, late.code) == (False, "stale_lease")
        assert "older than r2, revision 9" in late.error
        assert gpu.get_power_limit_w() == 250
        # Another job's lease on the same GPU is its own: not fenced by this one's revisions.
        other = SetPowerLimitCmd(power_limit_w=220, holder="job-8", lease_s=60)
        assert (await send(nc, agent, other, SenderLease("r1", "a", 3, until, "other"))).ok


async def test_a_command_without_the_header_is_taken_as_before(nats_server, nc) -> None:
    async with running_agent(nats_server.url) as agent:
        until = time.time() + 30.0
        assert (await send(nc, agent, limit(250), SenderLease("r2", "b", 9, until, KEY))).ok
        assert (await send(nc, agent, limit(180), None)).ok
        assert agent.agents[0].gpu.get_power_limit_w() == 180


async def test_a_restore_the_expiry_loop_did_not_make_is_recorded(nats_server, nc,
                                                                  tmp_path) -> None:
    """The soak's `stuck_away`: a pipeline rank's instruction after its lease lapsed restores
    the GPU through the schedule's own expiry check (a trainer's death through the gateway),
    not the agent's expiry loop, which alone recorded restores: the GPU was back at its
    defaults on time, and its history said it stayed away until the next command."""
    async with running_agent(nats_server.url, history=str(tmp_path / "a.history")) as agent:
        assert (await send(nc, agent, limit(150), None)).ok
        await agent.agents[0].restore(reason="trainer gone")
        states = [(r["kind"], r["away"]) for r in history(agent) if r["kind"] != "renew"]
        assert states == [("command", True), ("restore", False)]
