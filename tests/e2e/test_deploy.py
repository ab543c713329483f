import os
import subprocess

from tests.conftest import REPO_ROOT
from zeus_agent.broker import find_nats_server


def test_nats_server_config_is_valid():
    env = dict(os.environ, AGENT_PASSWORD="a", COORDINATOR_PASSWORD="b", DASHBOARD_PASSWORD="c")
    conf = REPO_ROOT / "deploy" / "nats" / "nats-server.conf"
    proc = subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "is valid" in proc.stdout + proc.stderr


def test_units_run_the_installed_commands():
    agent = (REPO_ROOT / "deploy" / "systemd" / "zeus-agent.service").read_text()
    coordinator = (REPO_ROOT / "deploy" / "systemd" / "zeus-coordinator.service").read_text()
    assert "zeus-agent run" in agent and "AmbientCapabilities=CAP_SYS_ADMIN" in agent
    assert "zeus-coordinator run" in coordinator
