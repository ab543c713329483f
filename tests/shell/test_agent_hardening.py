"""Hardening of the agent over a real nats-server: bounded strings at the gateway, never deaf
on the bus (/healthz, a closed connection exits 4), trainers confined to their own GPUs, and
pids and uids taken from the kernel, never from the payload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.shell.agent_kit import (
    AuthNats,
    Inbox,
    RawTrainer,
    TrainerProcess,
    command,
    free_port,
    running_agent,
    wait_for,
)
from zeus_agent.agent.server import EXIT_BUS_LOST
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.models import RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    AgentHello,
    ErrorEvent,
    GpuBinding,
    InfoCmd,
    RegisterRank,
    Reply,
    SetPowerLimitCmd,
    TrainerEventBatch,
)
from zeus_agent.wire.trainer import Kind
from zeus_demo.cluster import Processes, wait_for_async

K = Kind


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    """GET /healthz: (status, JSON body)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def poll_health(port: int, status: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll /healthz (off the loop) until it answers `status`; return its body."""
    last: list[Any] = [None, None]

    async def answered() -> dict[str, Any] | None:
        last[:] = code, body = await asyncio.to_thread(healthz, port)
        return body if code == status else None

    return await wait_for_async(answered, timeout_s, lambda: f"/healthz stayed {last[0]} {last[1]}")


def rank_registration(node: str, gpu: int, job_id: str = "job-r", rank: int = 0) -> RegisterRank:
    return RegisterRank(
        job_id=job_id,
        rank_info=RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                           available_frequencies=[1740]),
        gpu=GpuBinding(node=node, gpu_index=gpu),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def coordinator_stub(nc: Any) -> Any:
    """Answer every registration ok, remembering the requests (subject, reply inbox)."""
    seen: list[tuple[str, str]] = []

    async def answer(msg: Any) -> None:
        seen.append((msg.subject, msg.reply))
        await msg.respond(codec.encode(Reply.success(relayed=True)))

    subs = [
        await nc.subscribe(subjects.all_coord_register_rank(), cb=answer),
        await nc.subscribe(subjects.all_coord_register_job(), cb=answer),
    ]
    await confirm_subscriptions(nc)
    try:
        yield seen
    finally:
        for sub in subs:
            await sub.unsubscribe()


# ------------------------------------------------------------------ 1. bounded, never deaf
async def test_a_huge_job_id_is_a_bad_request_a_long_one_works_and_the_agent_stays(
    nats_server, nc
):
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            reply = await trainer.hello("j" * 5000, gpu_index=0)
            assert (reply.ok, reply.code) == (False, "bad_request")
            assert "job_id" in reply.error and "256" in reply.error
            assert (await command(nc, node, 0, InfoCmd())).result["binding"] is None

            long_id = "job/with spaces*and>wildcards." * 8 + "x" * 16  # 256 characters
            assert len(long_id) == 256
            inbox = await Inbox.open(nc, subjects.job_events(long_id, 0, node))
            assert len(inbox.sub.subject) < 200  # the subject carries a short token
            assert (await trainer.hello(long_id, rank=0, gpu_index=0)).ok
            trainer.event(K.STEP_BEGIN, 0, 0)
            trainer.event(K.STEP_END, 0, 0)
            batch = await inbox.next(TrainerEventBatch, timeout_s=3)
            assert batch.job_id == long_id and batch.node == node
            assert [e.kind for e in batch.events][:1] == ["step_begin"]
            # still on the bus: commands are answered
            info = await command(nc, node, 0, InfoCmd())
            assert info.ok and info.result["binding"]["job_id"] == long_id
            assert not agent.nc.is_closed
        finally:
            trainer.close()


async def test_an_event_name_longer_than_a_name_is_dropped_as_malformed(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("job-n", gpu_index=0)).ok
            trainer.event(K.INSTRUCTION_BEGIN, 0, 0, "f" * 5000)
            await wait_for(lambda: agent.gateway.counters["malformed"] == 1, what="counted")
            assert (await command(nc, agent.settings.node, 0, InfoCmd())).ok
        finally:
            trainer.close()


async def test_healthz_follows_the_connection_through_a_server_restart():
    port = free_port()
    server = EmbeddedNats(port=port).start()
    try:
        async with running_agent(server.url, metrics_port=0, metrics_host="127.0.0.1") as agent:
            http = agent.metrics_port
            body = await poll_health(http, 200)
            assert body["ok"] is True and body["status"] == "ok"
            assert body["node"] == agent.settings.node and body["nats"]["state"] == "connected"

            await asyncio.to_thread(server.stop)
            body = await poll_health(http, 503)
            assert body["ok"] is False and body["status"] == "disconnected"
            assert "disconnected from NATS since" in body["reason"]
            assert body["nats"]["since"].startswith(time.strftime("%Y-", time.gmtime()))

            server = EmbeddedNats(port=port).start()
            body = await poll_health(http, 200, timeout_s=15)
            assert body["nats"]["reason"] == "reconnected to NATS"
            nc = await connect(server.url, "test-after-restart")
            try:
                reply = await command(nc, agent.settings.node, 0, InfoCmd())
                assert reply.ok  # reconnected, not deaf
            finally:
                await nc.close()
            assert agent.exit_code == 0
    finally:
        server.stop()


@pytest.fixture
def auth_nats(tmp_path: Path) -> Iterator[AuthNats]:
    server = AuthNats(tmp_path).start()
    yield server
    server.stop()


async def test_a_connection_the_server_closes_restores_the_gpus_and_exits_4(auth_nats):
    async with running_agent(
        auth_nats.url("first"), metrics_port=0, metrics_host="127.0.0.1"
    ) as agent:
        node = agent.settings.node
        nc = await connect(auth_nats.url("first"), "test-client")
        try:
            cmd = SetPowerLimitCmd(power_limit_w=150, holder="h", lease_s=600)
            assert (await command(nc, node, 0, cmd)).ok
        finally:
            await nc.close()
        gpu = agent.agents[0].gpu
        assert gpu.get_power_limit_w() == 150
        assert (await poll_health(agent.metrics_port, 200))["status"] == "ok"
        auth_nats.revoke()
        await asyncio.wait_for(agent.serve_task, 15)  # it exits by itself, not deaf
        assert agent.exit_code == EXIT_BUS_LOST == 4
        assert gpu.get_power_limit_w() == 300  # restored on the way out
        ok, detail = agent.health()
        assert not ok and detail["status"] == "closed"
        assert "closed the connection" in detail["reason"]
        assert "authorization" in detail["reason"].lower()


async def test_credentials_as_settings_and_the_node_inbox_prefix(auth_nats):
    url = f"nats://127.0.0.1:{auth_nats.port}"
    async with running_agent(url, nats_user="agent", nats_password="first") as agent:
        node = agent.settings.node
        nc = await connect(auth_nats.url("first"), "test-client")
        try:
            assert (await command(nc, node, 0, InfoCmd())).ok
            async with coordinator_stub(nc) as seen:
                trainer = RawTrainer(agent.settings.socket_path)
                try:
                    assert (await trainer.hello("job-i", gpu_index=0)).ok
                    reply = await trainer.request(K.REGISTER_RANK, rank_registration(node, 0,
                                                                                     "job-i"))
                    assert reply.ok, reply.error
                finally:
                    trainer.close()
            ((subject, inbox),) = seen
            assert subject == subjects.coord_register_rank(node)
            assert inbox.startswith(subjects.inbox_prefix("node", node) + ".")
        finally:
            await nc.close()


async def test_wrong_credentials_fail_at_start_with_the_url_and_no_password(auth_nats):
    with pytest.raises(Exception) as raised:
        async with running_agent(auth_nats.url("wrong")):
            pass
    text = str(raised.value)
    assert f"127.0.0.1:{auth_nats.port}" in text and "wrong" not in text
    assert "credentials" in text


# ---------------------------------------------------------------------------- 2. own GPUs only
async def test_register_rank_is_relayed_only_for_own_gpus_bound_by_the_sender(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        other = await TrainerProcess.start(agent.settings.socket_path)
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            async with coordinator_stub(nc) as seen:
                assert (await other.hello("job-r", rank=1, gpu_index=1)).ok
                assert (await trainer.hello("job-r", rank=0, gpu_index=0)).ok

                reply = await trainer.request(K.REGISTER_RANK, rank_registration("elsewhere", 0))
                assert (reply.ok, reply.code) == (False, "forbidden")
                assert f"node {node!r}, GPUs [0, 1]" in reply.error
                assert "only bindings to its own GPUs" in reply.error

                reply = await trainer.request(K.REGISTER_RANK, rank_registration(node, 7))
                assert (reply.ok, reply.code) == (False, "forbidden")

                # GPU 1 is the other process's: this one never said HELLO for it
                reply = await trainer.request(K.REGISTER_RANK, rank_registration(node, 1, rank=1))
                assert (reply.ok, reply.code) == (False, "forbidden")
                assert f"pid {other.pid}" in reply.error and f"pid {os.getpid()}" in reply.error

                reply = await trainer.request(K.REGISTER_RANK, rank_registration(node, 0, rank=5))
                assert (reply.ok, reply.code) == (False, "conflict")

                assert seen == []  # nothing reached the coordinator
                reply = await trainer.request(K.REGISTER_RANK, rank_registration(node, 0))
                assert reply.ok and reply.result == {"relayed": True}
                reply = await other.request(K.REGISTER_RANK, rank_registration(node, 1, rank=1))
                assert reply.ok, reply.error
                assert [s for s, _ in seen] == [subjects.coord_register_rank(node)] * 2
        finally:
            trainer.close()
            await other.kill()


async def test_a_hello_cannot_take_a_gpu_from_a_running_trainer(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        owner = await TrainerProcess.start(agent.settings.socket_path)
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await owner.hello("job-o", gpu_index=0)).ok
            reply = await trainer.hello("job-x", gpu_index=0)
            assert (reply.ok, reply.code) == (False, "conflict")
            assert f"pid {owner.pid}" in reply.error
            await owner.kill()  # once it is gone, the GPU is free again
            assert (await trainer.hello("job-x", gpu_index=0)).ok
        finally:
            trainer.close()
            await owner.kill()


# ---------------------------------------------------------------------------- 3. kernel pids
async def test_forged_pids_in_hello_events_and_bye_touch_only_the_sender(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        victim = await TrainerProcess.start(agent.settings.socket_path)
        forger = await TrainerProcess.start(agent.settings.socket_path)
        try:
            assert (await victim.hello("job-v", rank=1, gpu_index=1)).ok
            cmd = SetPowerLimitCmd(power_limit_w=150, holder="job-v", lease_s=600)
            assert (await command(nc, node, 1, cmd)).ok
            victim_events = await Inbox.open(nc, subjects.job_events("job-v", 1, node))
            forger_events = await Inbox.open(nc, subjects.job_events("job-f", 0, node))

            # HELLO claiming the victim's pid binds the forger's own process
            assert (await forger.hello("job-f", gpu_index=0, pid=victim.pid)).ok
            binding = (await command(nc, node, 0, InfoCmd())).result["binding"]
            assert (binding["pid"], binding["uid"]) == (forger.pid, os.getuid())

            # events claiming the victim's pid are the forger's
            await forger.event(K.STEP_BEGIN, 0, 0, pid=victim.pid)
            batch = await forger_events.next(TrainerEventBatch, timeout_s=3)
            assert batch.events[0].kind == "step_begin"
            with pytest.raises(asyncio.TimeoutError):
                await victim_events.sub.next_msg(timeout=0.3)

            # BYE claiming the victim's pid releases only the forger's GPU
            reply = await forger.request(K.BYE, {}, pid=victim.pid)
            assert reply.ok
            info1 = (await command(nc, node, 1, InfoCmd())).result
            assert info1["binding"]["pid"] == victim.pid
            assert [lease["holder"] for lease in info1["leases"]] == ["job-v"]
            assert agent.agents[1].gpu.get_power_limit_w() == 150  # the victim's GPU survives
            assert (await command(nc, node, 0, InfoCmd())).result["binding"] is None
        finally:
            await forger.kill()
            await victim.kill()


async def test_a_forged_huge_pid_does_not_stop_dead_trainers_being_reaped(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        forged = RawTrainer(agent.settings.socket_path, pid=2**31)
        doomed = await TrainerProcess.start(agent.settings.socket_path)
        try:
            assert (await forged.hello("job-big", gpu_index=0)).ok  # first in line
            assert agent.gateway.by_pid.keys() == {os.getpid()}
            assert (await doomed.hello("job-d", gpu_index=1)).ok
            cmd = SetPowerLimitCmd(power_limit_w=140, holder="job-d", lease_s=600)
            assert (await command(nc, node, 1, cmd)).ok
            await doomed.kill()
            await wait_for(lambda: agent.agents[1].gpu.get_power_limit_w() == 300, 3,
                           "the killed trainer's GPU restored")  # fmt: skip
        finally:
            forged.close()
            await doomed.kill()


async def test_reaping_goes_on_past_pids_that_name_no_process(nats_server):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        gateway = agent.gateway
        doomed = await TrainerProcess.start(agent.settings.socket_path)
        assert (await doomed.hello("job-d", gpu_index=1)).ok
        await doomed.kill()
        for bogus in (2**31, 2**70, -1, 0):  # what a payload pid could have put there
            gateway.by_pid[bogus] = [agent.agents[0]]
        gateway.by_pid[doomed.pid] = gateway.by_pid.pop(doomed.pid)  # last in line
        # The agent's own reaper (every 0.5 s) may have seen the pid gone while the kill was
        # awaited; forget that pass so this one is the first, with no await in between.
        gateway._dead_once.clear()
        await gateway.reap_dead_trainers()  # seen gone once: a goodbye may still be queued
        assert doomed.pid in gateway.by_pid
        await gateway.reap_dead_trainers()  # gone twice in a row (or the agent's reaper): released
        await wait_for(lambda: gateway.by_pid == {} and agent.agents[1].binding is None, 3,
                       "every pid released and GPU 1 unbound")  # fmt: skip


async def test_a_datagram_without_credentials_is_dropped_counted_and_reported(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        errors = await Inbox.open(nc, subjects.agent_errors(agent.settings.node))
        sock = agent.gateway.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)  # the kernel attaches none
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            reply = await trainer.hello("job-c", gpu_index=0)
            assert (reply.ok, reply.code) == (False, "forbidden")
            trainer.event(K.STEP_BEGIN, 0, 0)
            event = await errors.until(ErrorEvent, lambda e: e.code == "no_credentials")
            assert "credentials" in event.message
            await wait_for(lambda: agent.gateway.counters["no_credentials"] == 2, what="counted")
            assert agent.agents[0].binding is None
        finally:
            trainer.close()


def _unshare_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    done = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root or user namespaces)")
async def test_a_trainer_outside_the_agents_pid_namespace_is_refused(nats_server, nc):
    """An agent in its own PID namespace sees this process's pid as 0 (not visible to it)."""
    tmp = Path(tempfile.mkdtemp(prefix="zah-", dir="/tmp"))
    node = f"ns{os.getpid()}"
    hello = await nc.subscribe(subjects.agent_hello(node))
    errors = await Inbox.open(nc, subjects.agent_errors(node))
    args = [
        "unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "zeus_agent.cli", "run",
        "--nats-url", nats_server.url, "--backend", "sim", "--node", node,
        "--sim-state-dir", str(tmp / "sim"), "--socket-path", str(tmp / "agent.sock"),
        "--log-level", "WARNING",
    ]  # fmt: skip
    procs = Processes(tmp)
    proc = procs.spawn("agent", args)
    try:
        try:
            codec.decode((await hello.next_msg(timeout=20)).data, AgentHello)
        except TimeoutError:
            raise AssertionError("the agent did not announce itself:\n"
                                 + procs.log("agent")) from None
        trainer = RawTrainer(str(tmp / "agent.sock"))
        try:
            reply = await trainer.hello("job-ns", gpu_index=0)
            assert (reply.ok, reply.code) == (False, "forbidden")
            assert "PID namespace" in reply.error
            event = await errors.until(ErrorEvent, lambda e: e.code == "foreign_pid_namespace")
            assert "hostPID" in event.message
            assert (await command(nc, node, 0, InfoCmd())).result["binding"] is None
        finally:
            trainer.close()
    finally:
        await hello.unsubscribe()
        # unshare forwards no signal: SIGTERM its child (the agent), which unshare waits for
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        with contextlib.suppress(OSError, ValueError):
            for child in children.read_text().split():
                os.kill(int(child), signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 10)
        # What is left is SIGKILLed (unshare's --kill-child: the agent with it) and reaped.
        await asyncio.to_thread(procs.close)
        shutil.rmtree(tmp, ignore_errors=True)


async def test_a_datagram_longer_than_the_read_buffer_is_dropped_as_malformed(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            trainer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            hello = {"job_id": "job-t", "rank": 0, "gpu_index": 0, "pad": "x" * 80_000}
            trainer.send(msgpack.packb([1, int(K.HELLO), 0, 1, hello]))
            await wait_for(lambda: agent.gateway.counters["malformed"] == 1, what="counted")
            assert agent.agents[0].binding is None
            assert (await trainer.hello("job-t", gpu_index=0)).ok  # still serving
        finally:
            trainer.close()


ONE_SHOT_TRAINER = """
import socket, sys
from zeus_agent.wire import trainer as dg
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(""); s.connect(sys.argv[1]); s.settimeout(5)
s.send(dg.encode_request(dg.Kind.HELLO, 0, 1, {"job_id": "job-z", "rank": 0, "gpu_index": 0}))
assert dg.decode_datagram(s.recv(65536)).reply.ok
print("bound", flush=True)
"""


async def test_a_trainer_that_exited_but_is_not_reaped_yet_gets_its_gpu_restored(
    nats_server, nc, tmp_path
):
    """A zombie (its parent has not waited for it) is gone as far as its GPU is concerned."""
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        procs = Processes(tmp_path)  # nothing here waits for it until the end (close)
        proc = procs.spawn("trainer", [sys.executable, "-c", ONE_SHOT_TRAINER,
                                       agent.settings.socket_path], stdout=subprocess.PIPE)
        try:
            assert await asyncio.to_thread(proc.stdout.readline) == b"bound\n"
            cmd = SetPowerLimitCmd(power_limit_w=140, holder="job-z", lease_s=600)
            assert (await command(nc, node, 0, cmd)).ok
            # the process exits; this test (its parent) does not reap it: a zombie
            await wait_for(lambda: Path(f"/proc/{proc.pid}/stat").read_bytes().split(b")")[-1]
                           .split()[0] == b"Z", 10, "the trainer became a zombie")  # fmt: skip
            await wait_for(lambda: agent.agents[0].gpu.get_power_limit_w() == 300, 3,
                           "the zombie's GPU restored")  # fmt: skip
            assert agent.agents[0].binding is None
        finally:
            await asyncio.to_thread(procs.close)
            proc.stdout.close()
