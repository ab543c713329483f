"""The coordinator sends a job's commands one request per node, and falls back per GPU.

Over a real nats-server: a node of >= 2 commands gets one batch and each GPU its own reply
back; a node whose agent does not take batches (no responder on the node subject, a refusal of
the whole batch, no answer) gets its per-GPU requests at once and per GPU for a while after;
a fence that says no sends nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coordinator.service.commands import GpuCommands
from tests.shell.agent_kit import running_agent
from tests.shell.coordinator_kit import bound_energy_job, limits_are, wait_for
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.fencing import LEASE_HEADER
from zeus_agent.wire.messages import CommandEnvelope, Reply, SetPowerLimitCmd

LIMIT = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=200, holder="j",
                                                          lease_s=30)))


def commands(nc: Any, timeout_s: float = 2.0) -> GpuCommands:
    return GpuCommands(SimpleNamespace(command_timeout_s=timeout_s),  # type: ignore[arg-type]
                       SimpleNamespace(nc=nc), None)  # type: ignore[arg-type]


async def spy(nc: Any) -> list[str]:
    """The subjects of every command request sent, node batches and per-GPU ones."""
    seen: list[str] = []

    async def note(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe(subjects.all_node_commands(), cb=note)
    await nc.subscribe(subjects.all_gpu_commands(), cb=note)
    await confirm_subscriptions(nc)
    return seen


async def old_agent(nc: Any, node: str, on_batch: bytes | None = None) -> None:
    """An agent that serves its GPUs' subjects only (and, given `on_batch`, answers a batch
    with it: a refusal; b"": never answers)."""

    async def gpu(msg: Any) -> None:
        await msg.respond(codec.encode(Reply.success(gpu=subjects.parse_gpu_subject(
            msg.subject).gpu_index)))  # type: ignore[union-attr]

    async def batch(msg: Any) -> None:
        if on_batch:
            await msg.respond(on_batch)

    await nc.subscribe(f"zeus.gpu.{node}.*.cmd", cb=gpu)
    if on_batch is not None:
        await nc.subscribe(subjects.node_command(node), cb=batch)
    await confirm_subscriptions(nc)


async def test_a_node_gets_one_batch_and_each_gpu_its_reply(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=3) as agent:
        node = agent.settings.node
        seen = await spy(nc)
        cmds = commands(nc, timeout_s=0.5)
        requests = [(subjects.gpu_command(node, g), LIMIT) for g in (2, 0, 1)]
        requests.append((subjects.gpu_command("nobody", 0), LIMIT))
        replies = await cmds.request_grouped(requests)
        assert replies is not None
        assert [r.result["power_limit_w"]  # type: ignore[union-attr]
                for r in replies[:3]] == [200] * 3
        assert isinstance(replies[3], str) and "no reply" in replies[3]  # (The spy hears it.)
        assert sorted(seen) == sorted([subjects.node_command(node),
                                       subjects.gpu_command("nobody", 0)])
        assert cmds.per_gpu_until == {} and cmds.batch_fallbacks == 0
        assert all(a.gpu.get_power_limit_w() == 200 for a in agent.agents.values())


async def test_an_agent_without_batches_gets_per_gpu_requests_at_once_and_after(
        nats_server, nc) -> None:
    for node, on_batch in (("old-a", None),  # no responders
                           ("old-b", codec.encode(Reply.failure("bad_request", "?"))),
                           ("old-c", b"")):  # subscribed, never answers: a timeout
        await old_agent(nc, node, on_batch)
        seen = await spy(nc)
        cmds = commands(nc, timeout_s=0.5)
        requests = [(subjects.gpu_command(node, g), LIMIT) for g in range(3)]
        replies = await cmds.request_grouped(requests)
        assert replies is not None, node
        assert [r.result["gpu"] for r in replies] == [0, 1, 2], node  # type: ignore[union-attr]
        assert cmds.batch_fallbacks == 1 and subjects.node_command(node) in cmds.per_gpu_until
        assert await cmds.request_grouped(requests) is not None
        node_sent = [s for s in seen if s == subjects.node_command(node)]
        assert len(node_sent) == 1, node  # (The second time: per GPU only.)
        assert len(seen) == 1 + 3 + 3, node


async def test_a_fence_that_says_no_sends_nothing(nats_server, nc) -> None:
    await old_agent(nc, "fenced")
    seen = await spy(nc)
    requests = [(subjects.gpu_command("fenced", g), LIMIT) for g in range(2)]
    assert await commands(nc).request_grouped(requests, fence=lambda: False) is None
    await nc.flush()
    assert seen == []


async def test_a_jobs_limit_reaches_a_node_as_one_fenced_batch(nats_server, agent, coord,
                                                                 nc) -> None:
    """The coordinator's own path: the job's two GPUs on one node get one batch, under the
    replica's lease (the `Zeus-Lease` header), and nothing falls back."""
    sent: list[tuple[str, bool]] = []

    async def note(msg: Any) -> None:
        if b"set_power_limit" in msg.data:
            sent.append((msg.subject, bool(msg.headers and LEASE_HEADER in msg.headers)))

    await nc.subscribe(subjects.all_node_commands(), cb=note)
    await nc.subscribe(subjects.all_gpu_commands(), cb=note)
    await confirm_subscriptions(nc)
    await bound_energy_job(nc)
    await wait_for(lambda: limits_are(agent.settings.sim_state_dir, 250))
    assert sent and all(s == (subjects.node_command(agent.settings.node), True) for s in sent)
    assert coord.commands.batch_fallbacks == 0
