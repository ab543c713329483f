"""TLS between the services and NATS: `broker.tls_context`, `connect`'s TLS files, the agent's
--nats-tls-* settings, and deploy/nats/tls.conf served by a real nats-server."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.deploy.deploy_kit import DEPLOY, Pki, clean_env, nats_server
from zeus_agent.broker import connect, tls_context
from zeus_agent.config import AgentSettings
from zeus_agent.errors import BrokerError
from zeus_demo.cluster import free_port

# --- tls_context -----------------------------------------------------------------------------


def test_missing_files_are_named_with_their_option(tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    with pytest.raises(BrokerError, match=rf"CA file {missing} \(--nats-tls-ca\).*No such file"):
        tls_context(ca_file=str(missing))
    with pytest.raises(BrokerError, match=r"client certificate .* \(--nats-tls-cert\)"):
        tls_context(cert_file=str(missing))
    with pytest.raises(BrokerError, match=r"Is a directory"):
        tls_context(ca_file=str(tmp_path))


def test_a_key_needs_its_certificate(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="needs its certificate"):
        tls_context(key_file=str(tmp_path / "client.key"))


def test_a_file_that_is_no_certificate_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(BrokerError, match="holds no usable PEM certificate"):
        tls_context(ca_file=str(junk))


def test_server_verification_is_on(pki: Pki) -> None:
    context = tls_context(ca_file=str(pki.ca))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_certificate_with_another_key_is_refused(pki: Pki) -> None:
    tls_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))  # the right pair loads
    with pytest.raises(BrokerError, match="do not load as a matching PEM pair"):
        tls_context(str(pki.ca), str(pki.client_cert), str(pki.server_key))


async def test_tls_files_and_a_context_together_are_refused(pki: Pki) -> None:
    with pytest.raises(BrokerError, match="not both"):
        await connect("tls://127.0.0.1:1", "t", tls=ssl.create_default_context(),
                      tls_ca_file=str(pki.ca))  # fmt: skip


# --- the agent's settings --------------------------------------------------------------------


def test_agent_settings_pass_the_tls_files_to_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUS_AGENT_NATS_TLS_CA", "/etc/zeus/tls/ca.crt")
    settings = AgentSettings(
        nats_url="tls://nats:4222",
        nats_tls_cert="/etc/zeus/tls/agent.crt",
        nats_tls_key="/etc/zeus/tls/agent.key",
        nats_user="agent-a",
        nats_password="secret",
    )
    assert settings.nats_options() == {
        "user": "agent-a",
        "password": "secret",
        "tls_ca_file": "/etc/zeus/tls/ca.crt",
        "tls_cert_file": "/etc/zeus/tls/agent.crt",
        "tls_key_file": "/etc/zeus/tls/agent.key",
    }
    monkeypatch.delenv("ZEUS_AGENT_NATS_TLS_CA")
    assert AgentSettings(nats_url="nats://n:4222").nats_options() == {}


def test_agent_settings_refuse_a_key_without_certificate() -> None:
    with pytest.raises(ValidationError, match="needs --nats-tls-cert"):
        AgentSettings(nats_url="tls://nats:4222", nats_tls_key="/k.pem")


# --- deploy/nats/tls.conf on a real nats-server ---------------------------------------------


@pytest.fixture
def tls_server(pki: Pki, tmp_path: Path) -> Iterator[str]:
    """nats-server with the shipped tls block (its /etc/nats/tls/ files replaced by the PKI's)."""
    block = (DEPLOY / "nats" / "tls.conf").read_text()
    for name, path in (("server.crt", pki.server_cert), ("server.key", pki.server_key),
                       ("ca.crt", pki.ca)):  # fmt: skip
        assert f"/etc/nats/tls/{name}" in block
        block = block.replace(f"/etc/nats/tls/{name}", str(path))
    (tmp_path / "tls.conf").write_text(block)
    port = free_port()
    (tmp_path / "server.conf").write_text(f'listen: "127.0.0.1:{port}"\ninclude ./tls.conf\n')
    with nats_server(tmp_path / "server.conf", port, clean_env()):
        yield f"tls://localhost:{port}"


async def test_mutual_tls_with_the_shipped_block(tls_server: str, pki: Pki) -> None:
    nc = await connect(
        tls_server,
        "tls-test",
        timeout_s=5,
        tls_ca_file=str(pki.ca),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    try:
        sub = await nc.subscribe("zeus.tls.echo")
        await nc.publish("zeus.tls.echo", b"over tls")
        assert (await sub.next_msg(timeout=2)).data == b"over tls"
    finally:
        await nc.drain()


@pytest.mark.parametrize("case", ["no client certificate", "another CA"])
async def test_tls_connections_the_server_or_client_must_refuse(
    tls_server: str, pki: Pki, case: str
) -> None:
    files: dict[str, Any]
    if case == "no client certificate":  # verify: true wants one: the server hangs up
        files, why = {"tls_ca_file": str(pki.ca)}, "could not connect"
    else:  # the client does not trust the server's certificate
        files = {"tls_ca_file": str(pki.other_ca), "tls_cert_file": str(pki.client_cert),
                 "tls_key_file": str(pki.client_key)}  # fmt: skip
        why = "could not connect.*CERTIFICATE_VERIFY_FAILED"
    with pytest.raises(BrokerError, match=why):
        await asyncio.wait_for(connect(tls_server, "tls-test", timeout_s=1, **files), 10)
