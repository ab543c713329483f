"""deploy/systemd/: `systemd-analyze verify` on the units, and what they promise."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from coordinator.config import CoordinatorSettings
from tests.deploy.deploy_kit import DEPLOY, PENDING_COORDINATOR_SETTINGS, SCRIPTS, clean_env
from zeus_agent.config import AgentSettings

SYSTEMD = DEPLOY / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
INSTALLED = "/opt/zeus-bus/bin/"
"""Where the units expect the project (a virtual environment in /opt/zeus-bus)."""


def directives(path: Path) -> dict[str, list[str]]:
    """`Key` -> every value of `Key=value` lines (systemd allows a key more than once)."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            found.setdefault(m.group(1), []).append(m.group(2))
    return found


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """No warning at all. The units run /opt/zeus-bus/bin/...; the copies checked here run the
    same commands from this checkout's environment, since verify wants existing executables."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    assert {u.name for u in UNITS} == {
        "zeus-agent.service", "zeus-coordinator.service", "nats-server.service"
    }  # fmt: skip
    copies = []
    for unit in UNITS:
        text = unit.read_text()
        for command in re.findall(re.escape(INSTALLED) + r"([\w-]+)", text):
            assert (SCRIPTS / command).exists(), f"{unit.name} runs {command}: not installed"
        copy = tmp_path / unit.name
        copy.write_text(text.replace(INSTALLED, f"{SCRIPTS}/"))
        copies.append(str(copy))
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *copies],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(SYSTEMD_LOG_COLOR="0"),
    )
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), (
        proc.stdout + proc.stderr
    )


def test_agent_unit() -> None:
    d = directives(SYSTEMD / "zeus-agent.service")
    # CAP_SYS_ADMIN only, to a non-root user that can gain nothing else.
    assert d["User"] == ["zeus"]
    assert d["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]
    assert d["AmbientCapabilities"] == ["CAP_SYS_ADMIN"]
    assert d["NoNewPrivileges"] == ["yes"]
    # Restore on stop: SIGTERM to the agent (it restores its GPUs), time to do it, restart.
    assert d["KillSignal"] == ["SIGTERM"] and int(d["TimeoutStopSec"][0]) >= 10
    assert d["Restart"] == ["on-failure"]
    assert "zeus-agent run" in d["ExecStart"][0]
    # Raised CPU priority: the real-time class (nice -10 when that is removed).
    assert d["CPUSchedulingPolicy"] == ["rr"] and d["CPUSchedulingPriority"] == ["1"]
    assert d["CPUSchedulingResetOnFork"] == ["yes"] and d["Nice"] == ["-10"]
    # Nothing that would hide the GPUs or forbid that priority.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                "RestrictRealtime"):  # fmt: skip
        assert key not in d, key
    # The socket directory outlives restarts (containers of trainers bind-mount it).
    assert d["RuntimeDirectory"] == ["zeus-agent"] and d["RuntimeDirectoryPreserve"] == ["yes"]


def test_coordinator_and_nats_units_have_no_capability() -> None:
    for name in ("zeus-coordinator.service", "nats-server.service"):
        d = directives(SYSTEMD / name)
        assert d["CapabilityBoundingSet"] == [""], name
        assert d["NoNewPrivileges"] == ["yes"], name
        assert d["RestrictRealtime"] == ["yes"], name
    coordinator = directives(SYSTEMD / "zeus-coordinator.service")
    assert "zeus-coordinator run" in coordinator["ExecStart"][0]
    assert coordinator["StateDirectory"] == ["zeus-coordinator"]


def test_nats_unit_matches_its_configuration() -> None:
    d = directives(SYSTEMD / "nats-server.service")
    conf = (DEPLOY / "nats" / "nats-server.conf").read_text()
    (store,) = re.findall(r'store_dir:\s*"([^"]+)"', conf)
    assert store.startswith(f"/var/lib/{d['StateDirectory'][0]}/")
    assert d["EnvironmentFile"] == ["/etc/nats/zeus-passwords.env"]
    assert d["ExecStart"] == [f"{INSTALLED}nats-server -c /etc/nats/nats-server.conf"]
    assert d["ExecStartPre"] == [f"{INSTALLED}nats-server -t -c /etc/nats/nats-server.conf"]
    assert d["KillSignal"] == ["SIGUSR2"]  # lame duck: clients move before it stops


def _env_file(path: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z_]+=", line)
    )


def _commented_keys(path: Path) -> list[str]:
    return re.findall(r"^#([A-Z_]+)=", path.read_text(), re.MULTILINE)


def test_agent_environment_example(monkeypatch: pytest.MonkeyPatch) -> None:
    path = SYSTEMD / "agent.env.example"
    env = _env_file(path)
    for key in [*env, *_commented_keys(path)]:
        assert key.removeprefix("ZEUS_AGENT_").lower() in AgentSettings.model_fields, key
    for key in [k for k in os.environ if k.startswith("ZEUS_AGENT_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = AgentSettings()
    assert settings.node == "gpu-node-1" and settings.nats_options()["user"] == "agent-gpu-node-1"


def test_coordinator_environment_example() -> None:
    path = SYSTEMD / "coordinator.env.example"
    fields = set(CoordinatorSettings.model_fields) | PENDING_COORDINATOR_SETTINGS
    for key in [*_env_file(path), *_commented_keys(path)]:
        assert key.removeprefix("ZEUS_PFO_").lower() in fields, key
    url = _env_file(path)["ZEUS_PFO_NATS_URL"]
    assert all(server.startswith("nats://coordinator:") for server in url.split(","))
