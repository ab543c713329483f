"""An agent under a permissions file that predates `NodePower` stops sending it, and says so.

A deployment upgrades its agents before it regenerates `auth.conf`: nats-server then refuses
every `<p>.agent.<node>.power` publish. The real `zeus-agent run`, with its node's credentials
from a file without that subject, must log the refusal once with what to do, stop sending the
readings (not be refused every second), and go on publishing its per-GPU samples, which the
coordinators follow for a node that sends no `NodePower`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nats
import pytest

from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import SampleBatch
from zeus_demo.cluster import NatsServer, Processes, wait_for_async

NODE = "old-perm-node"


def old_auth_conf() -> str:
    """Today's authorization block without the power subject (a file written before it)."""
    text = permissions.render_authorization([NODE])
    lines = [line for line in text.splitlines() if ".power" not in line]
    assert len(lines) < len(text.splitlines())
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(90)
async def test_a_refused_node_power_is_said_once_and_samples_go_on() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="zeus-old-perm-", dir="/tmp"))
    procs = Processes(tmp)
    try:
        (tmp / "auth.conf").write_text(old_auth_conf())
        (tmp / "server.conf").write_text('listen: "127.0.0.1:-1"\ninclude ./auth.conf\n')
        users = {u.name: u for u in permissions.users([NODE])}
        passwords = {u.password_variable: f"z{os.urandom(12).hex()}" for u in users.values()}
        server = NatsServer(tmp / "server.conf", procs, env=passwords).start()

        def url(user: str) -> str:
            return (f"nats://{user}:{passwords[users[user].password_variable]}"
                    f"@127.0.0.1:{server.port}")

        observer = await nats.connect(url("observer"), inbox_prefix=permissions.inbox(
            "observer"), allow_reconnect=False, connect_timeout=3)
        got: list[SampleBatch] = []

        async def on_sample(msg: object) -> None:
            got.append(codec.decode(msg.data, SampleBatch))  # type: ignore[attr-defined]

        await observer.subscribe(subjects.gpu_samples(NODE, 0), cb=on_sample)
        await observer.flush()
        procs.spawn("agent", [
            sys.executable, "-m", "zeus_agent.cli", "run", "--nats-url",
            url(permissions.agent_user(NODE)), "--backend", "sim", "--node", NODE,
            "--sim-state-dir", str(tmp / "sim"), "--socket-path", str(tmp / "agent.sock"),
            "--publish-interval-s", "0.2", "--log-level", "INFO"])
        await wait_for_async(lambda: "power readings" in procs.text("agent"), 20,
                             lambda: procs.text("agent"))
        seen = len(got)
        await asyncio.sleep(2.0)  # ten publish intervals more
        await asyncio.to_thread(procs.stop, "agent", 10.0)
        text = procs.text("agent")
        said = [line for line in text.splitlines() if "refuses this agent's power" in line]
        assert len(said) == 1 and "zeus-coordinator nats-auth" in said[0], text
        refusals = [line for line in text.splitlines() if "permissions violation" in line]
        assert 1 <= len(refusals) <= 2, text  # not one a publish interval
        assert len(got) >= seen + 5, (seen, len(got))  # the samples went on
        assert got[-1].node == NODE
        await observer.close()
    finally:
        procs.close(grace_s=5)
        shutil.rmtree(tmp, ignore_errors=True)
