"""deploy/docker/: the image (non-root by default) and the one-node compose file."""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml

from coordinator.config import CoordinatorSettings
from tests.deploy.deploy_kit import (
    DEPLOY,
    PENDING_COORDINATOR_SETTINGS,
    clean_env,
    load_credentials_module,
    nats_check,
)
from tests.repo_kit import REPO_ROOT
from zeus_agent.config import AgentSettings

DOCKER = DEPLOY / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def _final_stage(commands: list[Any]) -> list[Any]:
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


def test_dockerfile_runs_as_a_non_root_user() -> None:
    path = DOCKER / "Dockerfile"
    commands = list(dockerfile.parse_file(str(path)))  # BuildKit's own parser
    users = [c.value[0] for c in _final_stage(commands) if c.cmd == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"0", "root"}
    for c in commands:  # no privileged build step (BuildKit's RUN --security=insecure)
        assert "privileged" not in c.original.lower() and "--security=insecure" not in c.flags
    # The image's user owns what the compose file's volumes start from.
    run = " ".join(" ".join(c.value) for c in _final_stage(commands) if c.cmd == "RUN")
    assert f"--uid {user}" in run
    for directory in ("/var/lib/zeus-coordinator", "/run/zeus-secrets", "/run/zeus-agent"):
        assert directory in run
    (base,) = [c.value[0] for c in commands if c.cmd == "ARG"]
    assert base.startswith("PYTHON_IMAGE=python:3.11-slim")


def test_dockerfile_copies_only_what_the_ignore_file_lets_in() -> None:
    commands = dockerfile.parse_file(str(DOCKER / "Dockerfile"))
    allowed = {
        line[1:].rstrip("/")
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    sources = [
        src
        for c in commands
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
        for src in c.value[:-1]
    ]
    assert sources
    for src in sources:
        assert (REPO_ROOT / src).exists(), src
        assert src.rstrip("/") in allowed, src


def test_no_service_is_privileged_and_only_the_gpu_agent_gains_sys_admin() -> None:
    for name, service in SERVICES.items():
        assert not service.get("privileged"), name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service["read_only"] is True, name
        if name == "agent":
            assert service["cap_add"] == ["SYS_ADMIN"]
        else:
            assert "cap_add" not in service, name
    # uid 0 only where a capability or a volume owned by root needs it (see the file's notes).
    assert SERVICES["agent"]["user"].split(":")[0] == "0"
    for name in ("coordinator", "agent-sim", "credentials"):
        assert "user" not in SERVICES[name], name  # the image's user


def test_nats_runs_jetstream_on_a_volume() -> None:
    nats = SERVICES["nats"]
    assert nats["image"].startswith("nats:")
    assert "command" not in nats  # JetStream is configured in nats.conf
    conf = (DEPLOY / "docker" / "nats.conf").read_text()
    block = re.search(r"^jetstream \{\s*store_dir: \"([^\"]+)\"\s*sync_interval: always\s*\}",
                      conf, re.MULTILINE)
    assert block, conf  # on the volume, synced before each acknowledgement
    assert f"nats-data:{block[1]}" in nats["volumes"]
    assert "js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])


def test_gpu_agent_sees_the_hosts_gpus() -> None:
    agent = SERVICES["agent"]
    assert agent["profiles"] == ["gpu"]
    (device,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all"
    assert {"gpu", "utility"} <= set(device["capabilities"])
    assert agent["command"][:2] == ["zeus-agent", "run"] and "nvml" in agent["command"]


def _agent_settings(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> AgentSettings:
    for key in [k for k in os.environ if k.startswith("ZEUS_AGENT_")]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        if key.startswith("ZEUS_AGENT_"):
            assert key.removeprefix("ZEUS_AGENT_").lower() in AgentSettings.model_fields, key
            monkeypatch.setenv(key, value.replace("${ZEUS_NODE:-node-1}", "node-1"))
    assert service["command"][:2] == ["zeus-agent", "run"]
    return AgentSettings(_cli_parse_args=service["command"][2:])


@pytest.mark.parametrize("name", ["agent", "agent-sim"])
def test_agents(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = SERVICES[name]
    settings = _agent_settings(service, monkeypatch)
    assert settings.backend == ("nvml" if name == "agent" else "sim")
    # Host PID (the trainers' pids), the socket directory mounted, health on the metrics port.
    assert service["pid"] == "host"
    socket_dir = posixpath.dirname(settings.socket_path)
    assert any(v.endswith(f":{socket_dir}") for v in service["volumes"])
    assert f"{settings.metrics_port}:{settings.metrics_port}" in service["ports"]
    assert f"127.0.0.1:{settings.metrics_port}/healthz" in " ".join(service["healthcheck"]["test"])
    # SIGTERM restores the GPUs: time to do it, and a real-time priority when allowed.
    assert service["stop_signal"] == "SIGTERM" and service["stop_grace_period"] == "30s"
    assert service["ulimits"] == {"rtprio": 1}
    script = service["entrypoint"][2]
    assert 'exec chrt --rr 1 "$$@"' in script and 'exec "$$@"' in script
    # Its NATS user: the file the credentials service writes for this node.
    credentials = load_credentials_module()
    assert "agent-$${ZEUS_AGENT_NODE}.env" in script
    assert credentials.agent_file_name(settings.node) == f"agent-{settings.node}.env"


def test_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    service = SERVICES["coordinator"]
    fields = set(CoordinatorSettings.model_fields) | PENDING_COORDINATOR_SETTINGS
    for key in service["environment"]:
        assert key.removeprefix("ZEUS_PFO_").lower() in fields, key
    assert service["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert service["environment"]["ZEUS_PFO_STATUS_PORT"] in " ".join(
        service["healthcheck"]["test"]
    )
    assert "coordinator.env" in service["entrypoint"][2]
    state = service["environment"]["ZEUS_PFO_STATE_DIR"]
    assert f"coordinator-state:{state}" in service["volumes"]


def test_credentials_service_feeds_every_other_service() -> None:
    command = SERVICES["credentials"]["command"]
    assert command[:2] == ["python", "/opt/zeus-bus/deploy/credentials.py"]
    assert "--group-readable" in command
    for name in ("nats", "coordinator", "agent", "agent-sim"):
        assert SERVICES[name]["depends_on"]["credentials"] == {
            "condition": "service_completed_successfully"
        }
        assert any(
            v.startswith("secrets:") and v.endswith(":ro") for v in SERVICES[name]["volumes"]
        )


def test_compose_nats_config_with_generated_credentials(tmp_path: Path) -> None:
    """What the credentials service writes is what nats.conf and the services read."""
    command = SERVICES["credentials"]["command"]
    secrets_dir = tmp_path / "secrets"
    args = [a.replace("/run/zeus-secrets", str(secrets_dir)) for a in command[2:]]
    args = [a.replace("${ZEUS_NODE:-node-1}", "node-1") for a in args]
    assert load_credentials_module().main(args) == 0
    shutil.copyfile(DOCKER / "nats.conf", tmp_path / "nats.conf")
    nats_mounts = SERVICES["nats"]["volumes"]
    assert "./nats.conf:/etc/nats/zeus.conf:ro" in nats_mounts
    assert "secrets:/etc/nats/secrets:ro" in nats_mounts
    env_text = (secrets_dir / "nats.env").read_text()
    env = clean_env(**dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line))
    proc = nats_check(tmp_path / "nats.conf", env)
    assert proc.returncode == 0, proc.stderr
    # The files each service sources exist, and the NATS entrypoint sources its own.
    assert ". /etc/nats/secrets/nats.env" in SERVICES["nats"]["entrypoint"][2]
    for name in ("coordinator.env", "agent-node-1.env"):
        assert (secrets_dir / name).exists()
