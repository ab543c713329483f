"""What the agent and the coordinator share about their NATS connection.

* `NatsSettings`: the connection's settings (URL, credentials, TLS files, connect timeout,
  embedded server, subject prefix), the base of `AgentSettings` and `CoordinatorSettings`:
  each field is a flag and an environment variable with the service's prefix
  (`--nats-url`: `ZEUS_AGENT_NATS_URL`, `ZEUS_PFO_NATS_URL`).

Construction does no I/O.
"""

from __future__ import annotations

import logging
from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings

from zeus_agent.errors import BrokerError
from zeus_agent.wire.subjects import DEFAULT_PREFIX, check_prefix

LOG = logging.getLogger(__name__)


class NatsSettings(BaseSettings):
    """How a service reaches NATS (fields shared by the agent's and the coordinator's settings).

    A subclass sets `model_config` (its `env_prefix`); the messages below name its variables.
    """

    nats_url: str | None = Field(
        None,
        description="NATS server URL(s), comma separated; omit with --embedded-nats. "
        "Credentials may be given in the URL (nats://user:password@host:4222)",
    )
    nats_user: str | None = Field(
        None, description="NATS user name (with --nats-password; or user:password in the URL)"
    )
    nats_password: SecretStr | None = Field(
        None,
        description="NATS password; prefer its environment variable (a flag shows in the "
        "process list)",
    )
    nats_tls_ca: str | None = Field(
        None,
        description="CA certificate(s) (PEM file) that verify the NATS server's certificate; "
        "default: the system's CAs (used when the server asks for TLS, as one with a tls {} "
        "block does)",
    )
    nats_tls_cert: str | None = Field(
        None,
        description="Client certificate (PEM file) for a NATS server that verifies clients "
        "(mutual TLS, tls { verify: true })",
    )
    nats_tls_key: str | None = Field(
        None,
        description="Private key (PEM file) of --nats-tls-cert; omit when that file holds it",
    )
    embedded_nats: bool = Field(
        False, description="Start a private nats-server on a free loopback port (development)"
    )
    prefix: str = Field(
        DEFAULT_PREFIX, description="Subject prefix shared by the agents and the coordinator"
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, description="Give up connecting to NATS at start after this (s)"
    )

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        return check_prefix(value)

    @model_validator(mode="after")
    def _credentials(self) -> Self:
        env = self.model_config.get("env_prefix", "")
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError(
                f"give both --nats-user and --nats-password ({env}NATS_USER and "
                f"{env}NATS_PASSWORD), or put user:password in --nats-url"
            )
        if self.nats_tls_key is not None and self.nats_tls_cert is None:
            raise ValueError(
                f"--nats-tls-key ({env}NATS_TLS_KEY) needs --nats-tls-cert "
                f"({env}NATS_TLS_CERT), the certificate of that key"
            )
        return self

    def bus_url(self, embedded: str | None = None) -> str:
        """The URL to connect to: the embedded server's when there is one, else `nats_url`.

        Raises:
            BrokerError: Neither (the message names the flag and its variable).
        """
        url = embedded or self.nats_url
        if not url:
            env = self.model_config.get("env_prefix", "")
            raise BrokerError(
                f"no NATS: pass --nats-url URL (or {env}NATS_URL), or --embedded-nats"
            )
        return url

    def tls_options(self) -> dict[str, str]:
        """`zeus_agent.broker.connect`'s TLS arguments, those set (files read when connecting)."""
        files = {"tls_ca_file": self.nats_tls_ca, "tls_cert_file": self.nats_tls_cert,
                 "tls_key_file": self.nats_tls_key}
        return {k: v for k, v in files.items() if v is not None}

    def nats_options(self) -> dict[str, str]:
        """Options for `zeus_agent.broker.connect`: credentials and TLS files, when set.

        Credentials are absent when the URL carries them (or there are none).
        """
        options: dict[str, str] = {}
        if self.nats_user is not None and self.nats_password is not None:
            options |= {"user": self.nats_user, "password": self.nats_password.get_secret_value()}
        return options | self.tls_options()
