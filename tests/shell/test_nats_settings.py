"""`zeus_agent.bus.NatsSettings`: the NATS fields of both services, defined once.

Each service reads them from its own variables (ZEUS_AGENT_*, ZEUS_PFO_*) and its messages
name those (issue 35 item 5).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.config import CoordinatorSettings
from zeus_agent.bus import NatsSettings
from zeus_agent.config import AgentSettings
from zeus_agent.errors import BrokerError


def test_both_services_share_the_nats_fields_under_their_own_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (AgentSettings, CoordinatorSettings):
        assert issubclass(cls, NatsSettings)
        assert list(cls.model_fields)[:len(NatsSettings.model_fields)] == list(
            NatsSettings.model_fields)
    for env in ("ZEUS_AGENT_", "ZEUS_PFO_"):
        monkeypatch.setenv(f"{env}NATS_USER", "u")
        monkeypatch.setenv(f"{env}NATS_PASSWORD", "pw")
        monkeypatch.setenv(f"{env}NATS_TLS_CA", "/ca.pem")
        monkeypatch.setenv(f"{env}CONNECT_TIMEOUT_S", "2.5")
    expected = {"user": "u", "password": "pw", "tls_ca_file": "/ca.pem"}
    for settings in (AgentSettings(), CoordinatorSettings()):
        assert settings.nats_options() == expected
        assert settings.tls_options() == {"tls_ca_file": "/ca.pem"}
        assert settings.connect_timeout_s == 2.5


@pytest.mark.parametrize(("cls", "env"), [(AgentSettings, "ZEUS_AGENT_"),
                                          (CoordinatorSettings, "ZEUS_PFO_")])
def test_the_messages_name_the_services_own_variables(cls: Any, env: str) -> None:
    with pytest.raises(ValidationError, match=f"--nats-password \\({env}NATS_USER"):
        cls(nats_user="u")
    with pytest.raises(ValidationError, match=f"needs --nats-tls-cert \\({env}NATS_TLS_CERT"):
        cls(nats_tls_key="/k.pem")
    with pytest.raises(ValidationError, match="invalid subject prefix"):
        cls(prefix="a b")
    with pytest.raises(BrokerError, match=f"--nats-url URL \\(or {env}NATS_URL\\)"):
        cls().bus_url(None)
    assert cls(nats_url="nats://n:4222").bus_url(None) == "nats://n:4222"
    assert cls(nats_url="nats://n:4222").bus_url("nats://embedded:1") == "nats://embedded:1"
