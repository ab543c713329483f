"""deploy/credentials.py: every credential file, consistent with nats-server's users."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_kit import clean_env, load_credentials_module, nats_server
from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.errors import BrokerError
from zeus_agent.wire import permissions
from zeus_demo.cluster import free_port

credentials = load_credentials_module()


def _env(path: Path) -> dict[str, str]:
    return credentials.read_env(path.read_text())


def test_files_modes_and_passwords_kept(tmp_path: Path) -> None:
    url = "nats://n1:4222,nats://n2:4222"
    args = ["--node", "gpu-a", "--node", "gpu.b", "--dir", str(tmp_path), "--nats-url", url]
    assert credentials.main(args) == 0
    agent_b = credentials.agent_file_name("gpu.b")
    assert agent_b.startswith("agent-gpu_b~")  # a dot is no subject token: mapped, digested
    names = {"auth.conf", "nats.env", "coordinator.env", "observer.env", "agent-gpu-a.env", agent_b}
    assert {p.name for p in tmp_path.iterdir()} == names
    for name in names - {"auth.conf"}:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    passwords = _env(tmp_path / "nats.env")
    a = _env(tmp_path / "agent-gpu-a.env")
    assert a["ZEUS_AGENT_NATS_USER"] == permissions.agent_user("gpu-a")
    assert (
        a["ZEUS_AGENT_NATS_PASSWORD"] == passwords[permissions.password_variable("agent", "gpu-a")]
    )
    coordinator_url = _env(tmp_path / "coordinator.env")["ZEUS_PFO_NATS_URL"]
    password = passwords["ZEUS_NATS_COORDINATOR_PASSWORD"]
    assert (
        coordinator_url
        == f"nats://coordinator:{password}@n1:4222,nats://coordinator:{password}@n2:4222"
    )
    # Again with one node fewer: the passwords stay, the departed node's file goes.
    assert credentials.main(["--node", "gpu-a", "--dir", str(tmp_path), "--group-readable"]) == 0
    assert not (tmp_path / agent_b).exists()
    assert _env(tmp_path / "agent-gpu-a.env") == a
    assert stat.S_IMODE((tmp_path / "coordinator.env").stat().st_mode) == 0o640


@pytest.mark.parametrize("url", ["nats:4222", "nats://user:pw@nats:4222"])
def test_bad_urls_are_refused_before_writing(tmp_path: Path, url: str) -> None:
    assert credentials.main(["--node", "a", "--dir", str(tmp_path), "--nats-url", url]) == 2
    assert not any(tmp_path.iterdir())


async def test_the_files_let_each_client_in(tmp_path: Path) -> None:
    """auth.conf with nats.env's passwords on a real server: each client's file logs in."""
    assert credentials.main(["--node", "gpu-a", "--dir", str(tmp_path)]) == 0
    port = free_port()
    (tmp_path / "server.conf").write_text(f'listen: "127.0.0.1:{port}"\ninclude ./auth.conf\n')
    agent = _env(tmp_path / "agent-gpu-a.env")
    coordinator_url = _env(tmp_path / "coordinator.env")["ZEUS_PFO_NATS_URL"]
    observer_url = _env(tmp_path / "observer.env")["ZEUS_OBSERVER_NATS_URL"]
    here = f"@127.0.0.1:{port}"
    logins: list[tuple[str, dict[str, Any]]] = [
        (
            coordinator_url.replace("@nats:4222", here),
            {"inbox_prefix": permissions.inbox("coordinator")},
        ),
        (observer_url.replace("@nats:4222", here), {"inbox_prefix": permissions.inbox("observer")}),
        (
            f"nats://127.0.0.1:{port}",
            {
                "user": agent["ZEUS_AGENT_NATS_USER"],
                "password": agent["ZEUS_AGENT_NATS_PASSWORD"],
                "inbox_prefix": permissions.inbox("agent", "gpu-a"),
            },
        ),
    ]
    with nats_server(tmp_path / "server.conf", port, clean_env(**_env(tmp_path / "nats.env"))):
        for url, options in logins:
            nc = await connect(url, "credentials-test", timeout_s=2, **options)
            await confirm_subscriptions(nc)  # a request to its own inbox: its rights work
            await nc.drain()
        with pytest.raises(BrokerError, match="refused the credentials"):
            await connect(f"nats://coordinator:wrong@127.0.0.1:{port}", "t", timeout_s=1)
