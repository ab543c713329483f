"""The shipped NATS users, against a real nats-server: an agent commands only its own node.

The server runs with `deploy/nats/auth.conf` byte for byte (its passwords from the
environment, as in production) on a free loopback port. Raw nats-py clients connect as each
role with its inbox prefix (`permissions.inbox`); the last tests run the real `zeus-agent run
--backend sim` and `zeus-coordinator run` processes with those credentials.

How a refusal is proven: nats-server answers a publish or a subscription outside a user's
permissions with `-ERR 'Permissions Violation ...'` (delivered to nats-py's `error_cb`; the
connection stays up) and drops the message. Each test waits for that error, then shows that a
legitimate subscriber got nothing: a control message published after the refusal is the
first (and only) thing it receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats import micro

from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import (
    AgentHello,
    CommandEnvelope,
    GpuBinding,
    InfoCmd,
    JobQuery,
    RegisterRank,
    Reply,
)
from zeus_agent.wire.trainer import TrainerHello
from zeus_demo.cluster import NatsServer, Processes, wait_for_async

pytestmark = pytest.mark.timeout(90)

AUTH_CONF = REPO_ROOT / "deploy" / "nats" / "auth.conf"
A, B = "gpu-node-1", "gpu-node-2"  # the example nodes of the shipped auth.conf
P = subjects.DEFAULT_PREFIX
QUIET_S = 0.3  # how long "receives nothing" is watched, after the refusal is confirmed


class Server:
    """nats-server with the shipped users, and the passwords it read from its environment."""

    def __init__(self, port: int, passwords: dict[str, str]) -> None:
        self.port = port
        self.passwords = passwords

    def url(self, user: str) -> str:
        var = next(u.password_variable for u in permissions.users([A, B]) if u.name == user)
        return f"nats://{user}:{self.passwords[var]}@127.0.0.1:{self.port}"

    @property
    def anonymous_url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    tmp = Path(tempfile.mkdtemp(prefix="zeus-nats-auth-"))
    procs = Processes(tmp)
    try:
        shutil.copyfile(AUTH_CONF, tmp / "auth.conf")
        (tmp / "server.conf").write_text(
            'listen: "127.0.0.1:-1"\ninclude ./auth.conf\n'
            'jetstream { store_dir: "' + str(tmp / "js") + '" }\n')
        passwords = {
            u.password_variable: f"z{os.urandom(12).hex()}" for u in permissions.users([A, B])
        }
        nats_server = NatsServer(tmp / "server.conf", procs, env=passwords).start()
        assert nats_server.port is not None
        yield Server(nats_server.port, passwords)
    finally:
        procs.close(grace_s=5)
        shutil.rmtree(tmp, ignore_errors=True)


class Client:
    """A nats-py connection as one user, with the permission errors the server sent it."""

    def __init__(self, nc: Any, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def refused(self, kind: str, subject: str, timeout_s: float = 3.0) -> None:
        """Wait for the server's refusal to publish to / subscribe to `subject`."""
        want = f'permissions violation for {kind} to "{subject.lower()}"'
        await wait_for_async(lambda: any(want in e for e in self.errors), timeout_s,
                             lambda: f"no {want!r}; errors: {self.errors}", interval_s=0.01)

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e]


@contextlib.asynccontextmanager
async def client(server: Server, user: str, inbox: str) -> AsyncIterator[Client]:
    errors: list[str] = []

    async def error_cb(e: Exception) -> None:
        errors.append(str(e).lower())

    nc = await nats.connect(
        server.url(user), name=f"test-{user}", inbox_prefix=inbox, error_cb=error_cb,
        allow_reconnect=False, connect_timeout=3,
    )  # fmt: skip
    try:
        yield Client(nc, errors)
    finally:
        await nc.close()


def agent_client(server: Server, node: str) -> Any:
    return client(server, permissions.agent_user(node), permissions.inbox("agent", node))


def coordinator_client(server: Server) -> Any:
    return client(server, permissions.COORDINATOR_USER, permissions.inbox("coordinator"))


def observer_client(server: Server) -> Any:
    return client(server, permissions.OBSERVER_USER, permissions.inbox("observer"))


async def serve_gpu(agent: Client, node: str, gpu: int = 0) -> Any:
    """Serve `gpu`'s command subject as the real agent does (nats.micro), replying ok."""

    async def handler(req: Any) -> None:
        await req.respond(codec.encode(Reply(ok=True, result={"node": node, "gpu": gpu})))

    service = await micro.add_service(agent.nc, name=permissions.AGENT_SERVICE, version="0.0.0")
    await service.add_endpoint(
        name=f"gpu{gpu}", subject=subjects.gpu_command(node, gpu), handler=handler,
        queue_group=f"agent-{node}",
    )  # fmt: skip
    await confirm_subscriptions(agent.nc)
    return service


async def info(coord: Client, node: str, gpu: int = 0, timeout_s: float = 2.0) -> Reply:
    msg = await coord.nc.request(
        subjects.gpu_command(node, gpu), codec.encode(CommandEnvelope(cmd=InfoCmd())),
        timeout=timeout_s,
    )  # fmt: skip
    return codec.decode(msg.data, Reply)


async def only_control_arrives(sub: Any, control: bytes) -> None:
    """`sub`'s first message is `control` and nothing follows it."""
    msg = await sub.next_msg(timeout=3)
    assert msg.data == control, f"received {msg.subject}: {msg.data!r} before the control"
    with pytest.raises(nats.errors.TimeoutError):
        extra = await sub.next_msg(timeout=QUIET_S)
        pytest.fail(f"received {extra.subject} too")


# --- what an agent may do ---------------------------------------------------------------------


async def test_anonymous_and_wrong_password_are_refused(server):
    for url in (server.anonymous_url, server.url(permissions.agent_user(A)).replace(":z", ":y")):
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=2)  # fmt: skip


async def test_agent_publishes_its_own_nodes_samples_measurements_and_events(server):
    async with agent_client(server, A) as agent, coordinator_client(server) as coord:
        streams = [
            subjects.gpu_samples(A, 0), subjects.job_measurements("job-x", A),
            subjects.gpu_errors(A, 1), subjects.agent_hello(A), subjects.agent_errors(A),
            subjects.job_events("job-x", 0, A), subjects.agent_power(A),
        ]  # fmt: skip
        subs = {s: await coord.nc.subscribe(s) for s in streams}
        await confirm_subscriptions(coord.nc)
        for s in streams:
            await agent.nc.publish(s, s.encode())
        for s, sub in subs.items():
            assert (await sub.next_msg(timeout=3)).data == s.encode()
        assert agent.violations() == [] and coord.violations() == []


async def test_agent_registers_through_its_own_nodes_subjects(server):
    async with agent_client(server, A) as agent, coordinator_client(server) as coord:
        service = await micro.add_service(
            coord.nc, name=permissions.COORDINATOR_SERVICE, version="0.0.0", queue_group="coord"
        )

        async def handler(req: Any) -> None:
            await req.respond(subjects.last_token(req.subject).encode())

        for name, subject in (
            ("register_job", subjects.all_coord_register_job()),
            ("register_rank", subjects.all_coord_register_rank()),
        ):
            await service.add_endpoint(name=name, subject=subject, handler=handler)
        await confirm_subscriptions(coord.nc)
        for subject in (subjects.coord_register_job(A), subjects.coord_register_rank(A)):
            reply = await agent.nc.request(subject, b"{}", timeout=3)
            assert reply.data == A.encode()
            assert reply.subject.startswith(permissions.inbox("agent", A) + ".")
        await service.stop()
        assert agent.violations() == [] and coord.violations() == []


async def test_agent_serves_its_gpus_commands_and_discovery_to_the_coordinator(server):
    async with agent_client(server, A) as agent, coordinator_client(server) as coord:
        service = await serve_gpu(agent, A)
        reply = await info(coord, A)
        assert reply.ok and reply.result == {"node": A, "gpu": 0}
        # The coordinator's batched requests: one inbox, replies on <inbox>.<i>.
        inbox = coord.nc.new_inbox()
        assert inbox.startswith(permissions.inbox("coordinator") + ".")
        replies = await coord.nc.subscribe(f"{inbox}.*")
        await confirm_subscriptions(coord.nc)
        await coord.nc.publish(subjects.gpu_command(A, 0), b"{}", reply=f"{inbox}.7")
        assert (await replies.next_msg(timeout=3)).subject == f"{inbox}.7"
        # nats.micro discovery ($SRV), answered through allow_responses.
        msg = await coord.nc.request(f"$SRV.INFO.{permissions.AGENT_SERVICE}", b"", timeout=3)
        assert json.loads(msg.data)["endpoints"][0]["subject"] == subjects.gpu_command(A, 0)
        await service.stop()
        assert agent.violations() == [] and coord.violations() == []


# --- what an agent may not do -----------------------------------------------------------------


async def test_agent_cannot_command_another_nodes_gpu(server):
    async with (
        agent_client(server, A) as agent_a,
        agent_client(server, B) as agent_b,
        coordinator_client(server) as coord,
    ):
        target = subjects.gpu_command(B, 0)
        sub = await agent_b.nc.subscribe(target)  # B's own command subject, as B's agent
        await confirm_subscriptions(agent_b.nc)
        await agent_a.nc.publish(target, b"set power limit 100 W")
        await agent_a.refused("publish", target)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await agent_a.nc.request(target, b"info", timeout=QUIET_S)
        await coord.nc.publish(target, b"control")
        await only_control_arrives(sub, b"control")
        # Not its own node's commands either: only the coordinator commands GPUs.
        await agent_a.nc.publish(subjects.gpu_command(A, 0), b"x")
        await agent_a.refused("publish", subjects.gpu_command(A, 0))
        assert agent_a.nc.is_connected  # refused, not disconnected
        assert agent_b.violations() == [] and coord.violations() == []


async def test_only_the_coordinator_touches_the_durable_state(server):
    """The jobs live in JetStream KV: an agent's or an observer's credentials can neither read
    nor write them (no JetStream API, no bucket subjects); the coordinator can."""
    state, owners = subjects.state_buckets()
    async with (
        agent_client(server, A) as agent,
        observer_client(server) as observer,
        coordinator_client(server) as coord,
    ):
        for client in (agent, observer):
            for subject in (f"$KV.{state}.job.x", f"$KV.{owners}.x",
                            f"$JS.API.STREAM.INFO.KV_{state}"):
                await client.nc.publish(subject, b"{}")
                await client.refused("publish", subject)
        kv = await coord.nc.jetstream().create_key_value(bucket=state)
        assert await kv.put("probe", b"1") >= 1
        assert coord.violations() == []


async def test_agent_cannot_speak_for_another_node_or_the_coordinator(server):
    async with (
        agent_client(server, A) as agent,
        agent_client(server, B) as agent_b,
        coordinator_client(server) as coord,
        observer_client(server) as obs,
    ):
        # (subject A's agent forges, who legitimately hears it, who legitimately sends it)
        forbidden = [
            (subjects.coord_register_rank(B), coord, agent_b),
            (subjects.coord_register_job(B), coord, agent_b),
            (subjects.job_events("job-x", 0, B), coord, agent_b),
            (subjects.gpu_samples(B, 0), coord, agent_b),
            (subjects.job_measurements("job-x", B), coord, agent_b),
            (subjects.agent_hello(B), coord, agent_b),
            (subjects.agent_power(B), coord, agent_b),  # (forged power: a budget's draw)
            (subjects.lease_renewal("job-x"), agent_b, coord),
            (subjects.agent_ping(), agent_b, coord),
            (subjects.job_status("job-x"), obs, coord),
        ]
        subs = [(await hearer.nc.subscribe(s), sender, s) for s, hearer, sender in forbidden]
        for c in (agent_b, coord, obs):
            await confirm_subscriptions(c.nc)
        for s, _, _ in forbidden:
            await agent.nc.publish(s, b"forged")
            await agent.refused("publish", s)
        for sub, sender, s in subs:
            await sender.nc.publish(s, b"control")
            await only_control_arrives(sub, b"control")
        assert [c.violations() for c in (agent_b, coord, obs)] == [[], [], []]


@pytest.mark.parametrize(
    "subject",
    [
        subjects.gpu_command(B, 0),
        f"{P}.gpu.{B}.>",
        f"{P}.gpu.>",
        f"{P}.gpu.*.*.cmd",
        f"{P}.>",
        ">",
        "_INBOX.>",
        permissions.inbox("coordinator") + ".>",
        permissions.inbox("agent", B) + ".>",
        permissions.inbox("observer") + ".>",
        subjects.all_job_events(),
        subjects.all_coord_register_rank(),
        subjects.all_agent_power(),  # (another node's power draws)
        subjects.agent_power(B),
        f"$SRV.INFO.{permissions.COORDINATOR_SERVICE}",
    ],
)
async def test_agent_cannot_subscribe_outside_its_node(server, subject):
    async with agent_client(server, A) as agent:
        await agent.nc.subscribe(subject)
        await agent.refused("subscription", subject)
        assert agent.nc.is_connected


async def test_agent_cannot_read_replies_meant_for_others(server):
    async with (
        agent_client(server, A) as spy,
        agent_client(server, B) as agent_b,
        coordinator_client(server) as coord,
    ):
        service = await serve_gpu(agent_b, B)
        spies = []
        for subject in ("_INBOX.>", permissions.inbox("coordinator") + ".>"):
            spies.append(await spy.nc.subscribe(subject))
            await spy.refused("subscription", subject)
        reply = await info(coord, B)  # B's reply travels to the coordinator's inbox
        assert reply.ok and reply.result["node"] == B
        for sub in spies:
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=QUIET_S)
        await service.stop()


async def test_agent_cannot_reply_twice_or_unasked(server):
    """allow_responses is one reply per request received, not a right on _INBOX."""
    async with agent_client(server, A) as agent, coordinator_client(server) as coord:
        inbox = coord.nc.new_inbox()
        replies = await coord.nc.subscribe(inbox)
        await confirm_subscriptions(coord.nc)
        await agent.nc.publish(inbox, b"unasked")
        await agent.refused("publish", inbox)
        await coord.nc.publish(inbox, b"control")
        await only_control_arrives(replies, b"control")


# --- the coordinator and the observer ----------------------------------------------------------


async def test_coordinator_reaches_every_node_and_serves_every_node(server):
    async with (
        agent_client(server, A) as agent_a,
        agent_client(server, B) as agent_b,
        coordinator_client(server) as coord,
    ):
        services = [await serve_gpu(agent_a, A), await serve_gpu(agent_b, B)]
        for node in (A, B):
            assert (await info(coord, node)).result["node"] == node
        leases = [await a.nc.subscribe(subjects.all_lease_renewals()) for a in (agent_a, agent_b)]
        pings = [await a.nc.subscribe(subjects.agent_ping()) for a in (agent_a, agent_b)]
        for a in (agent_a, agent_b):
            await confirm_subscriptions(a.nc)
        await coord.nc.publish(subjects.lease_renewal("job-x"), b"renew")
        await coord.nc.publish(subjects.agent_ping(), b"")
        for sub in leases + pings:
            await sub.next_msg(timeout=3)
        for s in services:
            await s.stop()
        assert [c.violations() for c in (agent_a, agent_b, coord)] == [[], [], []]


async def test_observer_reads_status_and_asks_queries_only(server):
    async with observer_client(server) as obs, coordinator_client(server) as coord:
        service = await micro.add_service(
            coord.nc, name=permissions.COORDINATOR_SERVICE, version="0.0.0"
        )

        async def handler(req: Any) -> None:
            await req.respond(b"jobs")

        await service.add_endpoint(
            name="query", subject=subjects.coord_job_query(), handler=handler
        )
        status = await obs.nc.subscribe(subjects.all_job_status())
        await confirm_subscriptions(coord.nc)
        await confirm_subscriptions(obs.nc)
        assert (await obs.nc.request(subjects.coord_job_query(), b"", timeout=3)).data == b"jobs"
        await coord.nc.publish(subjects.job_status("job-x"), b"status")
        assert (await status.next_msg(timeout=3)).data == b"status"
        for s in (subjects.gpu_command(A, 0), subjects.lease_renewal("x"),
                  subjects.job_status("x"), subjects.coord_register_job(A),
                  subjects.agent_power(A)):  # fmt: skip
            await obs.nc.publish(s, b"x")
            await obs.refused("publish", s)
        for s in (subjects.gpu_command(A, 0), subjects.all_job_events(), "_INBOX.>"):
            await obs.nc.subscribe(s)
            await obs.refused("subscription", s)
        await service.stop()


# --- the real services with these credentials -------------------------------------------------


async def _stop(procs: Processes, name: str) -> None:
    """SIGTERM process `name` and wait for it (10 s, then SIGKILL)."""
    await asyncio.to_thread(procs.stop, name, 10.0)


def _start_agent(procs: Processes, server: Server, node: str, tmp: Path) -> Any:
    """`zeus-agent run` of `node` with its credentials, as process "agent" of `procs`."""
    args = [
        "run", "--nats-url", server.url(permissions.agent_user(node)), "--backend", "sim",
        "--node", node, "--sim-state-dir", str(tmp / "sim"), "--socket-path",
        str(tmp / "agent.sock"), "--heartbeat-s", "1", "--log-level", "INFO",
    ]  # fmt: skip
    return procs.spawn("agent", [sys.executable, "-m", "zeus_agent.cli", *args])


async def test_real_agent_serves_info_to_the_coordinator_with_node_credentials(server):
    tmp = Path(tempfile.mkdtemp(prefix="zeus-perm-agent-", dir="/tmp"))
    procs = Processes(tmp)
    try:
        async with coordinator_client(server) as coord:
            hello = await coord.nc.subscribe(subjects.agent_hello(A))
            await confirm_subscriptions(coord.nc)
            proc = _start_agent(procs, server, A, tmp)
            try:
                try:
                    msg = await hello.next_msg(timeout=20)
                except nats.errors.TimeoutError:
                    pytest.fail(f"no hello from the agent:\n{procs.text('agent')}")
                assert codec.decode(msg.data, AgentHello).node == A
                reply = await info(coord, A, timeout_s=5)
                assert reply.ok and reply.result["gpu"]["name"] == "NVIDIA A40", reply
            finally:
                await _stop(procs, "agent")
        text = procs.text("agent")
        assert "permissions violation" not in text.lower(), text
        assert proc.returncode == 0, text
    finally:
        procs.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_real_agent_and_coordinator_register_a_rank_with_their_credentials(server):
    """Trainer -> agent -> `coord.*.register.<node>` -> coordinator -> `info` -> agent."""
    from zeus_agent.emit import Publisher

    tmp = Path(tempfile.mkdtemp(prefix="zeus-perm-both-", dir="/tmp"))
    procs = Processes(tmp)
    try:
        async with coordinator_client(server) as probe:
            hello = await probe.nc.subscribe(subjects.agent_hello(A))
            await confirm_subscriptions(probe.nc)
            procs.spawn("coordinator", [
                sys.executable, "-m", "coordinator.cli", "run",
                "--nats-url", server.url(permissions.COORDINATOR_USER),
                "--state-dir", str(tmp / "state"),
            ])  # fmt: skip
            _start_agent(procs, server, A, tmp)
            try:
                try:
                    await hello.next_msg(timeout=20)
                except nats.errors.TimeoutError:
                    pytest.fail(f"no hello from the agent:\n{procs.text('agent')}")

                def trainer() -> tuple[str | None, Reply | None]:
                    pub = Publisher(socket_path=str(tmp / "agent.sock"), gpu_index=0, timeout_s=10)
                    try:
                        job = JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1)
                        for _ in range(40):  # until the coordinator is up
                            try:
                                job_id = pub.register_job(job)
                                break
                            except Exception:  # noqa: BLE001 - no coordinator yet
                                time.sleep(0.25)
                        else:
                            return None, None
                        if job_id is None:
                            return None, None
                        hello = pub.hello(TrainerHello(job_id=job_id, rank=0, gpu_index=0))
                        assert hello is not None and hello.ok, hello
                        rank = RegisterRank(
                            job_id=job_id,
                            join_token=pub.join_token,
                            rank_info=RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                                               available_frequencies=[]),
                            gpu=GpuBinding(node=A, gpu_index=0),
                        )  # fmt: skip
                        return job_id, pub.register_rank(rank)
                    finally:
                        pub.close()

                job_id, reply = await asyncio.to_thread(trainer)
                assert job_id, f"{procs.text('agent')}\n{procs.text('coordinator')}"
                assert reply is not None and reply.ok, reply
                async with observer_client(server) as obs:
                    msg = await obs.nc.request(
                        subjects.coord_job_query(), codec.encode(JobQuery(job_id=job_id)), timeout=5
                    )
                    assert codec.decode(msg.data, Reply).ok
            finally:
                await _stop(procs, "agent")
                await _stop(procs, "coordinator")
        logs = procs.text("agent") + procs.text("coordinator")
        assert "permissions violation" not in logs.lower(), logs
    finally:
        procs.close()
        shutil.rmtree(tmp, ignore_errors=True)


# --- node command batches (one request per node) -----------------------------------------------


async def test_node_command_batches_go_from_the_coordinator_to_their_own_node_only(server):
    """The coordinator may send a node's batch; the agent serves its own node's subject only;
    another agent, and the observer, may neither serve nor send one."""
    async with (
        agent_client(server, A) as agent_a,
        agent_client(server, B) as agent_b,
        coordinator_client(server) as coord,
        observer_client(server) as obs,
    ):
        served = await agent_a.nc.subscribe(subjects.node_command(A))
        await confirm_subscriptions(agent_a.nc)

        async def answer() -> None:
            msg = await served.next_msg(timeout=3)
            await msg.respond(b"batch-reply")

        answering = asyncio.create_task(answer())
        reply = await coord.nc.request(subjects.node_command(A), b"batch", timeout=3)
        await answering
        assert reply.data == b"batch-reply"
        await agent_b.nc.subscribe(subjects.node_command(A))
        await agent_b.refused("subscription", subjects.node_command(A))
        await agent_b.nc.subscribe(subjects.all_node_commands())
        await agent_b.refused("subscription", subjects.all_node_commands())
        await obs.nc.subscribe(subjects.node_command(A))
        await obs.refused("subscription", subjects.node_command(A))
        for sender in (agent_b, obs):
            await sender.nc.publish(subjects.node_command(A), b"forged")
            await sender.refused("publish", subjects.node_command(A))
        await coord.nc.publish(subjects.node_command(A), b"control")
        await only_control_arrives(served, b"control")
        assert [c.violations() for c in (agent_a, coord)] == [[], []]
