"""Helpers of the deployment tests: paths, YAML documents, a throwaway TLS PKI, nats-server -t.

The `pki` fixture (conftest.py) makes the PKI once per session."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import find_nats_server
from zeus_demo.cluster import NatsServer, Processes

DEPLOY = REPO_ROOT / "deploy"
PENDING_COORDINATOR_SETTINGS: set[str] = set()
"""Coordinator settings the deployment files name before `CoordinatorSettings` has them (its
TLS options, as the agent's); tolerated by the tests only while they are missing."""
SCRIPTS = Path(sysconfig.get_path("scripts"))
"""Where the project's commands are installed (zeus-agent, zeus-coordinator, nats-server)."""


def documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a file."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def load_credentials_module() -> ModuleType:
    """deploy/credentials.py, imported from its path (deploy/ is no package)."""
    spec = importlib.util.spec_from_file_location("deploy_credentials", DEPLOY / "credentials.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without zeus-bus variables, plus `extra`."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ZEUS_", "NATS_"))}
    return {**keep, **extra}


def nats_check(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`nats-server -t -c config` (parses the configuration, includes and certificates)."""
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=config.parent,
    )


@contextlib.contextmanager
def nats_server(config: Path, port: int, env: dict[str, str]) -> Iterator[None]:
    """Run nats-server with `config` (listening on 127.0.0.1:`port`) until the block ends; its
    environment is `env` (the variables of this process that `env` leaves out are removed)."""
    procs = Processes(config.parent)
    removed: dict[str, str | None] = {k: None for k in os.environ if k not in env}
    server = NatsServer(config, procs, env={**removed, **env}, port=port)
    try:
        server.start()
        yield
    finally:
        server.stop()
        procs.close()


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for localhost/127.0.0.1, a client certificate, another CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(name: str, cwd: Path) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=cwd,
    )  # fmt: skip


def _leaf(name: str, ca: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


def make_pki(d: Path) -> Pki:
    """Certificates made in `d` with the openssl command."""
    _ca("ca", d)
    _ca("other-ca", d)
    _leaf("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
          "extendedKeyUsage=serverAuth\n", d)  # fmt: skip
    _leaf("client", "ca", "extendedKeyUsage=clientAuth\n", d)
    return Pki(
        ca=d / "ca.crt",
        server_cert=d / "server.crt",
        server_key=d / "server.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
        other_ca=d / "other-ca.crt",
    )
