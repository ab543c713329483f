import os
import re
import subprocess

from coordinator import nats_auth
from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import find_nats_server
from zeus_agent.wire import permissions

NATS_DIR = REPO_ROOT / "deploy" / "nats"
EXAMPLE_NODES = ["gpu-node-1", "gpu-node-2"]


def check_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(NATS_DIR / "nats-server.conf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_nats_server_config_is_valid_with_the_password_variables_set():
    variables = [u.password_variable for u in permissions.users(EXAMPLE_NODES)]
    assert variables == [
        "ZEUS_NATS_AGENT_GPU_NODE_1_PASSWORD",
        "ZEUS_NATS_AGENT_GPU_NODE_2_PASSWORD",
        "ZEUS_NATS_COORDINATOR_PASSWORD",
        "ZEUS_NATS_OBSERVER_PASSWORD",
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_NATS_")}
    passwords = {v: nats_auth.new_password() for v in variables}
    proc = check_config({**base, **passwords})
    assert proc.returncode == 0, proc.stderr
    assert "is valid" in proc.stdout + proc.stderr
    # Each variable is needed: without one, the check names it.
    for missing in variables:
        proc = check_config({**base, **{k: v for k, v in passwords.items() if k != missing}})
        assert proc.returncode != 0 and missing in proc.stdout + proc.stderr


def test_shipped_auth_conf_is_the_generated_one():
    """deploy/nats/auth.conf is what `zeus-coordinator nats-auth` writes for the example nodes.

    So it never drifts from the subjects. Regenerate it when they change: `python -m
    coordinator.nats_auth --node gpu-node-1 --node gpu-node-2 --out deploy/nats/auth.conf`.
    """
    command = "zeus-coordinator nats-auth " + " ".join(f"--node {n}" for n in EXAMPLE_NODES)
    expected = permissions.render_authorization(EXAMPLE_NODES, command=command)
    assert (NATS_DIR / "auth.conf").read_text() == expected
    assert "include ./auth.conf" in (NATS_DIR / "nats-server.conf").read_text()
    assert not re.search(r'"(_INBOX|zeus\.gpu)\.>"', expected)  # the holes this closes


def test_deploy_readme_names_every_password_variable():
    readme = (REPO_ROOT / "deploy" / "README.md").read_text()
    for u in permissions.users(EXAMPLE_NODES):
        assert u.password_variable in readme, u.password_variable
    assert "ZEUS_NATS_AGENT_<NODE>_PASSWORD" in readme
    assert "nats-auth" in readme and "nats-server -t -c" in readme


def test_units_run_the_installed_commands():
    agent = (REPO_ROOT / "deploy" / "systemd" / "zeus-agent.service").read_text()
    coordinator = (REPO_ROOT / "deploy" / "systemd" / "zeus-coordinator.service").read_text()
    assert "zeus-agent run" in agent and "AmbientCapabilities=CAP_SYS_ADMIN" in agent
    assert "zeus-coordinator run" in coordinator
