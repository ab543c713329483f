"""`zeus-agent run --backend sim` as a real process against a real nats-server.

Covers what the issue's "done when" lists: commands over NATS, a trainer subprocess's events
relayed to `zeus.job.<job>.ev.<rank>`, samples published, SIGTERM restoring a power limit,
a SIGKILLed trainer's GPU restored, and lease expiry restoring defaults. GPU state is checked
through the simulated GPU's shared file (`SimGPU.open`), as another process would see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    AgentHello,
    CommandEnvelope,
    InfoCmd,
    Reply,
    SampleBatch,
    SetPowerLimitCmd,
    TrainerEventBatch,
)
from zeus_demo.cluster import Processes, wait_for_async

AGENT = [sys.executable, "-m", "zeus_agent.cli"]
_nodes = itertools.count()

TRAINER = textwrap.dedent(
    """
    import sys, time
    from zeus_agent.emit import Publisher
    from zeus_agent.wire.trainer import TrainerHello
    sock, job = sys.argv[1], sys.argv[2]
    pub = Publisher(socket_path=sock, gpu_index=0)
    reply = pub.hello(TrainerHello(job_id=job, rank=1, gpu_index=0))
    assert reply is not None and reply.ok, reply
    for _ in range(3):
        pub.step_begin()
        pub.instruction_begin("forward")
        time.sleep(0.01)
        pub.instruction_end("forward")
        pub.step_end()
    print("bound", flush=True)
    time.sleep(float(sys.argv[3]))
    """
)


class Agent:
    """One `zeus-agent run` process (in `procs`, with its trainers) and what the test needs to
    talk to it."""

    def __init__(self, procs: Processes, proc: Any, node: str, state_dir: Path,
                 socket_path: Path) -> None:
        self.procs = procs
        self.proc = proc
        self.node = node
        self.state_dir = state_dir
        self.socket_path = socket_path

    def gpu(self, index: int) -> SimGPU:
        """The simulated GPU, opened from its shared file."""
        return SimGPU.open(self.state_dir, index)


@pytest.fixture(scope="module")
def nats() -> Any:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def nc(nats) -> AsyncIterator[Any]:
    conn = await connect(nats.url, "e2e-test")
    yield conn
    await conn.close()


@pytest.fixture
async def agent(nats, nc) -> AsyncIterator[Agent]:
    tmp = Path(tempfile.mkdtemp(prefix="zae-", dir="/tmp"))
    node = f"e2e{os.getpid()}x{next(_nodes)}"
    hello = await nc.subscribe(subjects.agent_hello(node))
    args = [
        "run", "--nats-url", nats.url, "--backend", "sim", "--sim-count", "2",
        "--node", node, "--sim-state-dir", str(tmp / "sim"),
        "--socket-path", str(tmp / "agent.sock"), "--socket-mode", "0660",
        "--sample-hz", "20", "--publish-interval-s", "0.2", "--heartbeat-s", "1",
        "--log-level", "WARNING",
    ]  # fmt: skip
    procs = Processes(tmp)
    proc = procs.spawn("agent", [*AGENT, *args])
    try:
        msg = await hello.next_msg(timeout=15)
        assert [g.index for g in codec.decode(msg.data, AgentHello).gpus] == [0, 1]
        await hello.unsubscribe()
        yield Agent(procs, proc, node, tmp / "sim", tmp / "agent.sock")
    finally:
        await asyncio.to_thread(procs.close, 10.0)
        shutil.rmtree(tmp, ignore_errors=True)


async def command(nc: Any, node: str, gpu: int, cmd: Any) -> Reply:
    msg = await nc.request(
        subjects.gpu_command(node, gpu), codec.encode(CommandEnvelope(cmd=cmd)), timeout=2
    )
    return codec.decode(msg.data, Reply)


@contextlib.asynccontextmanager
async def trainer(agent: Agent, job: str, linger_s: float) -> AsyncIterator[Any]:
    """A trainer process of `job` (in the agent's registry), bound to GPU 0."""
    name = f"trainer-{job}"
    proc = agent.procs.spawn(name, [sys.executable, "-c", TRAINER, str(agent.socket_path), job,
                                    str(linger_s)], stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 15)
        assert line == b"bound\n", agent.procs.log(name)
        yield proc
    finally:
        agent.procs.kill(name)  # SIGKILL (if still running) and reap
        proc.stdout.close()


async def test_commands_events_samples_and_sigterm_restore(agent, nc):
    node = agent.node
    assert oct(agent.socket_path.stat().st_mode & 0o777) == oct(0o660)
    samples = await nc.subscribe(f"zeus.gpu.{node}.*.sample")  # not gpu_samples("*"): sanitised
    events = await nc.subscribe(subjects.job_events("e2e-job", 1, node))

    reply = await command(nc, node, 0, InfoCmd())
    assert reply.ok and reply.result["gpu"]["name"] == "NVIDIA A40"
    reply = await command(nc, node, 1, SetPowerLimitCmd(power_limit_w=160, holder="h", lease_s=60))
    assert reply.ok, reply.error
    assert agent.gpu(1).get_power_limit_w() == 160

    async with trainer(agent, "e2e-job", linger_s=0):
        kinds: list[str] = []
        while kinds.count("step_end") < 3:
            batch = codec.decode((await events.next_msg(timeout=3)).data, TrainerEventBatch)
            assert (batch.job_id, batch.rank, batch.node, batch.gpu) == ("e2e-job", 1, node, 0)
            kinds += [e.kind for e in batch.events]
        step = ["step_begin", "instruction_begin", "instruction_end", "step_end"]
        assert kinds == step * 3

    gpus_seen = set()
    while gpus_seen != {0, 1}:
        batch = codec.decode((await samples.next_msg(timeout=3)).data, SampleBatch)
        gpus_seen.add(batch.gpu)
        assert batch.samples and batch.node == node

    agent.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(agent.proc.wait, 10) == 0
    assert agent.gpu(1).get_power_limit_w() == 300
    assert not agent.socket_path.exists()


async def test_a_sigkilled_trainer_gets_its_gpu_restored(agent, nc):
    async with trainer(agent, "doomed", linger_s=60) as proc:
        cmd = SetPowerLimitCmd(power_limit_w=130, holder="doomed", lease_s=60)
        assert (await command(nc, agent.node, 0, cmd)).ok
        assert agent.gpu(0).get_power_limit_w() == 130
        proc.kill()  # SIGKILL: no goodbye, no atexit
        await asyncio.to_thread(proc.wait)
        killed = time.monotonic()
        await wait_for_async(lambda: agent.gpu(0).get_power_limit_w() == 300, 3,
                             "the restore after SIGKILL")
    assert time.monotonic() - killed < 1.5  # the agent checks trainer pids every 0.5 s


async def test_lease_expiry_restores_defaults(agent, nc):
    cmd = SetPowerLimitCmd(power_limit_w=200, holder="gone-coordinator", lease_s=0.5)
    assert (await command(nc, agent.node, 0, cmd)).ok
    assert agent.gpu(0).get_power_limit_w() == 200
    await wait_for_async(lambda: agent.gpu(0).get_power_limit_w() == 300, 3,
                         "the restore on lease expiry")
    assert agent.proc.poll() is None  # and the agent keeps running
    assert (await command(nc, agent.node, 0, InfoCmd())).result["leases"] == []


async def test_a_connection_the_server_closes_ends_the_process_with_4_gpus_restored(tmp_path):
    """The NATS server throws the agent out for good (its credentials revoked by a config
    reload): `zeus-agent run` restores its GPUs and exits 4 instead of living on deaf."""
    import json
    import urllib.request

    from tests.shell.agent_kit import AuthNats
    from zeus_demo.cluster import free_port

    server = AuthNats(tmp_path).start()
    tmp = Path(tempfile.mkdtemp(prefix="zae-", dir="/tmp"))
    node = f"e2e{os.getpid()}closed"
    http = free_port()
    nc = await connect(server.url("first"), "e2e-test")
    procs = Processes(tmp)
    try:
        hello = await nc.subscribe(subjects.agent_hello(node))
        args = [
            "run", "--nats-url", server.url("first"), "--backend", "sim", "--node", node,
            "--sim-state-dir", str(tmp / "sim"), "--socket-path", str(tmp / "agent.sock"),
            "--metrics-port", str(http), "--metrics-host", "127.0.0.1", "--log-level", "ERROR",
        ]  # fmt: skip
        proc = procs.spawn("agent", [*AGENT, *args])
        await hello.next_msg(timeout=15)
        url = f"http://127.0.0.1:{http}/healthz"
        body = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(url).read()))
        assert body["ok"] is True and body["status"] == "ok"
        cmd = SetPowerLimitCmd(power_limit_w=150, holder="h", lease_s=600)
        assert (await command(nc, node, 0, cmd)).ok
        assert SimGPU.open(tmp / "sim", 0).get_power_limit_w() == 150

        server.revoke()
        assert await asyncio.to_thread(proc.wait, 20) == 4
        stderr = procs.text("agent")
        assert "closed the connection" in stderr and "exiting with code 4" in stderr
        assert "Traceback" not in stderr
        assert SimGPU.open(tmp / "sim", 0).get_power_limit_w() == 300
        assert not (tmp / "agent.sock").exists()
    finally:
        await asyncio.to_thread(procs.close)
        with contextlib.suppress(Exception):
            await nc.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
