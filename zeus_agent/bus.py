"""What the agent and the coordinator share about their NATS connection.

* `NatsSettings`: the connection's settings (URL, credentials, TLS files, connect timeout,
  embedded server, subject prefix), the base of `AgentSettings` and `CoordinatorSettings`:
  each field is a flag and an environment variable with the service's prefix
  (`--nats-url`: `ZEUS_AGENT_NATS_URL`, `ZEUS_PFO_NATS_URL`).
* `BusHealth`: the connection's state as nats-py's callbacks report it, what `/healthz` shows
  of it, and the exit a service asks for when the server closed the connection for good
  (`BUS_LOST`, 4: its supervisor starts a fresh process, which connects anew).

Construction does no I/O.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings

from zeus_agent.aio import ExitSignals
from zeus_agent.cli_kit import BUS_LOST
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


class BusHealth:
    """A service's NATS connection as nats-py reports it; what `/healthz` says of it.

    Pass `on_disconnect`, `on_reconnect` and `on_closed` to `zeus_agent.broker.connect` and call
    `connected(nc)` once it returns.
    nats-py reconnects a lost connection forever, but one the server closed with an error (an
    authorization violation, a protocol error) stays closed: `on_closed` then sets
    `exit_code` to `BUS_LOST` and asks the service to exit (`should_exit`).
    """

    def __init__(
        self,
        who: str,
        exits: ExitSignals,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        before_exit: str = "",
    ) -> None:
        """Follow a service's connection (nothing happens until `connect` calls back).

        Args:
            who: What the service is ("agent"), for the log.
            exits: The service's exit events.
            on_reconnect: What the service does once reconnected (announce itself...).
            before_exit: What the service does on its way out after the server closed the
                connection, for the log ("restoring the GPUs and ").
        """
        self.who = who
        self._exits = exits
        self._on_reconnect = on_reconnect
        self._before_exit = before_exit
        self.state: tuple[str, float, str] = ("starting", time.time(), "not connected yet")
        """(state, since (Unix time), reason): "starting", "connected", "disconnected",
        "closed"."""
        self.connection: Any = None
        self.exit_code = 0
        """What the process should exit with: 0, or `BUS_LOST` (the server closed NATS)."""

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up."""
        return self.state[0] == "connected"

    def _set(self, state: str, reason: str) -> None:
        self.state = (state, time.time(), reason)

    def connected(self, connection: Any) -> None:
        """The first connection is made (`connection`: nats-py's client)."""
        self.connection = connection
        self._set("connected", "connected to NATS")

    async def on_disconnect(self) -> None:
        """The connection was lost; nats-py reconnects."""
        self._set("disconnected", "the connection to NATS was lost; reconnecting")

    async def on_reconnect(self) -> None:
        """The connection is back."""
        self._set("connected", "reconnected to NATS")
        if self._on_reconnect is not None:
            await self._on_reconnect()

    async def on_closed(self) -> None:
        """The server closed the connection and nats-py will not reconnect: exit with 4."""
        last = getattr(self.connection, "last_error", None)
        reason = f"the NATS server closed the connection ({last or 'no reason given'})"
        self._set("closed", reason)
        LOG.error(
            "%s; nats-py does not reconnect after that: %sexiting with code %d so the "
            "supervisor starts a fresh %s", reason, self._before_exit, BUS_LOST, self.who)
        self.exit_code = BUS_LOST
        self._exits.should_exit.set()

    def report(self) -> dict[str, Any]:
        """`/healthz`'s `nats`: state, since (ISO 8601, UTC) and reason."""
        state, since, reason = self.state
        return {"state": state, "since": iso(since), "reason": reason}

    def problem(self) -> tuple[str, str] | None:
        """(status, reason) for `/healthz` while not connected, else None."""
        state, since, reason = self.state
        if state == "connected":
            return None
        if state == "disconnected":
            return state, f"disconnected from NATS since {iso(since)}; reconnecting"
        return state, reason


def iso(t: float) -> str:
    """Unix time `t` as ISO 8601 in UTC, to the second."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")
