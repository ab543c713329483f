"""A small HTTP status server for both services: `/healthz` and Prometheus `/metrics`.

    from zeus_agent import status_http

    def health() -> tuple[bool, dict]:          # called on the server's thread: keep it cheap
        return nats_ok, {"status": "ok" if nats_ok else "disconnected", "since": ...}

    server = status_http.start("0.0.0.0", 9400, health, registry=my_registry)
    server.port                                   # the bound port (port 0 picks a free one)
    server.close()                                # or: await asyncio.to_thread(server.close)

* `GET /healthz`: `health()` -> `(ok, detail)`; 200 with `{"ok": true, **detail}` as JSON when
  ok, else 503 with `{"ok": false, **detail}`. A `health` that raises gives 503 too.
* `GET /metrics`: the Prometheus text format of `registry` (404 when None).
* Anything else: 404.

The server runs on a daemon thread (a stalled event loop does not hide `/metrics`; `health` can
detect the stall by looking at a timestamp the loop refreshes). `start` binds before it returns:
a port in use or an address that does not exist raises `ZeusAgentError` with a one-line reason.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from zeus_agent.errors import ZeusAgentError

LOG = logging.getLogger(__name__)

Health = Callable[[], tuple[bool, dict[str, Any]]]

__all__ = ["Health", "StatusServer", "start"]


class StatusServer:
    """A running status server. `port` is the bound port; `close()` stops it (idempotent)."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread, host: str) -> None:
        self._httpd: ThreadingHTTPServer | None = httpd
        self._thread = thread
        self.host = host
        self.port = int(httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:9400` (the wildcard address shown as loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port (blocks up to ~0.1 s; idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(timeout=5)


def start(host: str, port: int, health: Health, registry: Any = None) -> StatusServer:
    """Serve `/healthz` (and `/metrics` when `registry` is given) on `host:port`.

    Args:
        host: Address to listen on ("0.0.0.0", "127.0.0.1", "::", a host name).
        port: TCP port; 0 picks a free one (see `StatusServer.port`).
        health: Called for each `/healthz` on the server's thread; returns `(ok, detail)`.
        registry: A `prometheus_client` `CollectorRegistry` for `/metrics`, or None.

    Raises:
        ZeusAgentError: The address cannot be resolved or bound (e.g. the port is in use).
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror as e:
        raise ZeusAgentError(
            f"cannot serve /healthz and /metrics on {host}:{port}: unknown address ({e.strerror})"
        ) from None
    family = infos[0][0]

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        allow_reuse_address = True

    handler = _handler(health, registry)
    try:
        httpd = Server((host, port), handler)
    except OSError as e:
        hint = ""
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            hint = ": the port is already in use; pick another one (0: any free port)"
        elif e.errno == 13:  # EACCES
            hint = ": permission denied (ports below 1024 need privileges)"
        elif e.errno == 99:  # EADDRNOTAVAIL
            hint = ": no such address on this host"
        raise ZeusAgentError(
            f"cannot serve /healthz and /metrics on {host}:{port} ({e.strerror or e}){hint}"
        ) from None
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="status-http", daemon=True
    )
    thread.start()
    return StatusServer(httpd, thread, host)


def _handler(health: Health, registry: Any) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "zeus-status"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._health()
            elif path == "/metrics" and registry is not None:
                self._metrics()
            else:
                self._send(404, "application/json", b'{"ok": false, "error": "not found"}\n')

        def _health(self) -> None:
            try:
                ok, detail = health()
                body = {"ok": bool(ok), **detail}
            except Exception as e:  # noqa: BLE001 - a broken check is an unhealthy service
                LOG.exception("health check failed")
                ok, body = False, {"ok": False, "status": "error", "reason": f"{e}"}
            data = (json.dumps(body, default=str) + "\n").encode()
            self._send(200 if ok else 503, "application/json", data)

        def _metrics(self) -> None:
            from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

            self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))

        def _send(self, status: int, content_type: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
            LOG.debug("%s %s", self.address_string(), format % args)

    return Handler
