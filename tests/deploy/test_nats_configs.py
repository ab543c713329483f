"""deploy/nats/: `nats-server -t` on the configuration with its optional TLS and cluster
includes switched on (tests/e2e/test_deploy.py checks the default one and auth.conf)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.deploy.deploy_kit import DEPLOY, Pki, clean_env, nats_check
from zeus_agent.wire import permissions

NATS = DEPLOY / "nats"
EXAMPLE_NODES = ["gpu-node-1", "gpu-node-2"]


def _passwords() -> dict[str, str]:
    return {u.password_variable: "zexample" for u in permissions.users(EXAMPLE_NODES)}


def test_jetstream_is_on() -> None:
    conf = (NATS / "nats-server.conf").read_text()
    assert re.search(r"^jetstream \{\s*store_dir: \"[^\"]+\"\s*sync_interval: always\s*\}",
                     conf, re.MULTILINE)  # acknowledged writes survive a power loss
    assert re.search(r'^server_name: "[^"]+"', conf, re.MULTILINE)


def test_tls_and_cluster_includes(tmp_path: Path, pki: Pki) -> None:
    for name in ("nats-server.conf", "auth.conf", "tls.conf", "cluster.conf"):
        shutil.copyfile(NATS / name, tmp_path / name)
    conf = (tmp_path / "nats-server.conf").read_text()
    for include in ("tls.conf", "cluster.conf"):
        assert f"# include ./{include}\n" in conf
        conf = conf.replace(f"# include ./{include}\n", f"include ./{include}\n")
    conf = conf.replace("/var/lib/nats/jetstream", str(tmp_path / "js"))
    (tmp_path / "nats-server.conf").write_text(conf)
    tls = (tmp_path / "tls.conf").read_text()
    for name, path in {"server.crt": pki.server_cert, "server.key": pki.server_key,
                       "ca.crt": pki.ca}.items():  # fmt: skip
        tls = tls.replace(f"/etc/nats/tls/{name}", str(path))
    (tmp_path / "tls.conf").write_text(tls)
    proc = nats_check(tmp_path / "nats-server.conf", clean_env(**_passwords()))
    assert proc.returncode == 0, proc.stderr
    # The check reads the certificates: a missing one is an error.
    (tmp_path / "tls.conf").write_text(tls.replace(str(pki.server_key), str(tmp_path / "no.key")))
    proc = nats_check(tmp_path / "nats-server.conf", clean_env(**_passwords()))
    assert proc.returncode != 0 and "no.key" in proc.stdout + proc.stderr
