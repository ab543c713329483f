"""Only operators set budgets: a real nats-server with `nats-auth --operator` users.

The coordinator (in this process, with the coordinator user's credentials) serves
`<p>.coord.budget`; an operator is answered, while the observer and an agent are refused by
NATS's permissions, which `zeus-coordinator budget` reports as `forbidden`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.budget_cli import send
from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from zeus_agent.wire import permissions, subjects
from zeus_agent.wire.budget import BudgetRequest
from zeus_demo.cluster import NatsServer, Processes

pytestmark = pytest.mark.timeout(60)

NODE = "gpu-a"
OPERATOR = "grid-desk"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """A nats-server with the project's users, operators included (the harness's: it dies
    with the test)."""
    users = permissions.users([NODE], operators=[OPERATOR])
    text = permissions.render_authorization([NODE], operators=[OPERATOR])
    (tmp_path / "auth.conf").write_text(text)
    (tmp_path / "server.conf").write_text(
        'listen: "127.0.0.1:-1"\ninclude ./auth.conf\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n')
    passwords = {u.password_variable: f"z{os.urandom(12).hex()}" for u in users}
    with Processes(tmp_path / "procs") as procs:
        nats = NatsServer(tmp_path / "server.conf", procs, env=passwords).start()
        assert nats.port is not None
        yield nats.port, {u.name: passwords[u.password_variable] for u in users}


def url(port: int, names: dict[str, str], user: str) -> str:
    return f"nats://{user}:{names[user]}@127.0.0.1:{port}"


async def test_operator_is_answered_and_everyone_else_forbidden(server, tmp_path):
    port, names = server
    assert f"operator-{OPERATOR}" in names
    settings = CoordinatorSettings(
        nats_url=url(port, names, permissions.COORDINATOR_USER), state_dir=str(tmp_path / "c"),
        command_timeout_s=1.0)
    coord = CoordinatorService(settings)
    task = asyncio.create_task(coord.serve())
    await asyncio.wait_for(coord.started.wait(), 15)
    try:
        show = BudgetRequest(action="show")
        reply = await send(url(port, names, f"operator-{OPERATOR}"), subjects.DEFAULT_PREFIX,
                           show, 5.0)
        assert reply.ok and reply.result["budgets"] == []
        for user in (permissions.OBSERVER_USER, permissions.agent_user(NODE)):
            reply = await send(url(port, names, user), subjects.DEFAULT_PREFIX, show, 1.0)
            assert not reply.ok and reply.code == "forbidden", (user, reply)
    finally:
        coord.should_exit.set()
        await asyncio.wait_for(task, 15)


def test_operator_permissions_reach_budgets_only() -> None:
    perms = permissions.operator()
    assert subjects.coord_budget() in perms.publish
    assert not any(s.endswith(".cmd") or s.startswith("$KV") for s in perms.publish)
    for role in (permissions.observer(), permissions.agent(NODE)):
        assert subjects.coord_budget() not in role.publish
    assert subjects.coord_budget() in permissions.coordinator().subscribe
