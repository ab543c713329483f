"""NATS for a harness: `nats-server` processes, alone or routed, and relays to them.

(The project's own embedded server is `zeus_agent.broker.EmbeddedNats`.)

`NatsServer`: one server run from a configuration file (users, TLS, whatever the test writes),
its client port learnt from a ports file or given, its environment (the passwords its
configuration reads) chosen by the harness.

`NatsCluster`: 3 (or `size`) servers with JetStream on loopback.
`NatsCluster` writes one configuration file per server (`server_name`, client `listen`, `http`
monitoring, `jetstream { store_dir }` of its own, `cluster { name, listen, routes }` to the
others), starts them, and waits until they route to each other and JetStream has a meta leader
that knows every peer, so KV buckets with 3 replicas can be created. One server can be stopped
and started again on the same ports with the same store directory (`restart`). `close()`
always kills every server (each one a session leader carrying the marker of its
`Processes`, so nothing is left behind) and removes the temporary directory.

Readiness comes from each server's monitoring endpoint: `/jsz` (the meta group's leader and
its peers), `/routez` (routes to the other servers) and `/healthz` (JetStream current).

`Relay`: a TCP relay between some clients and a nats-server, which the harness holds or
releases, so the order in which services reconnect after a restart is chosen, not raced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from zeus_agent.broker import JETSTREAM_SYNC_ALWAYS, find_nats_server
from zeus_demo.cluster.ports import free_ports
from zeus_demo.cluster.processes import Processes

__all__ = ["NatsCluster", "NatsServer", "Relay", "ServerSpec"]

CLUSTER_NAME = "zeus-test"


@dataclass(frozen=True)
class ServerSpec:
    """One server of the cluster: its name, ports and directories."""

    index: int
    name: str
    client_port: int
    cluster_port: int
    http_port: int
    store_dir: Path
    config: Path

    @property
    def url(self) -> str:
        """Its client URL."""
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def process(self) -> str:
        """Its process name in `NatsCluster.procs`."""
        return f"nats-{self.name}"


class NatsCluster:
    """Three (or `size`) routed nats-servers with JetStream, on 127.0.0.1.

    Args:
        size: Number of servers.
        ready_timeout_s: How long `start`/`restart` wait for the cluster to be ready.
    """

    def __init__(self, size: int = 3, ready_timeout_s: float = 30.0) -> None:
        self.binary = find_nats_server()
        self.root = Path(tempfile.mkdtemp(prefix="zns-", dir="/tmp"))
        self.procs = Processes(self.root)
        self.size = size
        self.ready_timeout_s = ready_timeout_s
        ports = free_ports(3 * size)
        self.servers = [
            ServerSpec(index=i, name=f"n{i + 1}", client_port=ports[3 * i],
                       cluster_port=ports[3 * i + 1], http_port=ports[3 * i + 2],
                       store_dir=self.root / f"n{i + 1}" / "js",
                       config=self.root / f"n{i + 1}" / "nats.conf")
            for i in range(size)
        ]
        for spec in self.servers:
            spec.store_dir.mkdir(parents=True)
            spec.config.write_text(self._config(spec))

    # ------------------------------------------------------------------ addresses
    @property
    def urls(self) -> list[str]:
        """Every server's client URL, server order."""
        return [s.url for s in self.servers]

    def url(self, index: int) -> str:
        """The client URL of server `index`."""
        return self.servers[index].url

    def _config(self, spec: ServerSpec) -> str:
        routes = ", ".join(f'"nats-route://127.0.0.1:{s.cluster_port}"'
                           for s in self.servers if s is not spec)
        return (
            f'server_name: "{spec.name}"\n'
            f'listen: "127.0.0.1:{spec.client_port}"\n'
            f'http: "127.0.0.1:{spec.http_port}"\n'
            "jetstream {\n"
            f'  store_dir: "{spec.store_dir}"\n'
            f"  sync_interval: {JETSTREAM_SYNC_ALWAYS}\n"  # as every server the project ships
            "  max_memory_store: 64MB\n"
            "  max_file_store: 1GB\n"
            "}\n"
            "cluster {\n"
            f'  name: "{CLUSTER_NAME}"\n'
            f'  listen: "127.0.0.1:{spec.cluster_port}"\n'
            f"  routes: [{routes}]\n"
            "}\n"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NatsCluster:
        """Start every server; return once the cluster is ready (see `wait_ready`)."""
        try:
            for spec in self.servers:
                self._spawn(spec)
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, spec: ServerSpec) -> None:
        self.procs.spawn(spec.process, [self.binary, "-c", str(spec.config)], cwd=self.root)

    def running(self, index: int) -> bool:
        """Whether server `index` is up."""
        return self.procs.alive(self.servers[index].process)

    def stop(self, index: int, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop server `index`: SIGTERM (a clean shutdown) or, with `kill`, SIGKILL."""
        spec = self.servers[index]
        proc = self.procs.procs[spec.process]
        if proc.poll() is not None:
            return
        self.procs.kill(spec.process, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.procs.kill(spec.process, signal.SIGKILL)

    def start_server(self, index: int) -> None:
        """Start server `index` again: same configuration, ports and store directory.

        Returns once the whole cluster is ready again (`wait_ready`).
        """
        spec = self.servers[index]
        deadline = time.monotonic() + 10
        while True:  # Its ports may linger a moment after the old process went.
            self._spawn(spec)
            if self._wait_client_port(spec, self.procs.procs[spec.process], deadline):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server {spec.name} did not come back on port "
                                   f"{spec.client_port}\n{self.procs.log(spec.process)}")
            time.sleep(0.2)
        self.wait_ready()

    def restart(self, index: int, down_s: float = 0.0, kill: bool = False) -> None:
        """Stop server `index`, leave it down `down_s`, start it again, wait until ready."""
        self.stop(index, kill=kill)
        time.sleep(down_s)
        self.start_server(index)

    def _wait_client_port(self, spec: ServerSpec, proc: subprocess.Popen[bytes],
                          deadline: float) -> bool:
        """Whether `proc` accepts clients before `deadline` (False if it exited)."""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", spec.client_port), 0.5) as s:
                    if s.recv(4) == b"INFO":
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until every running server routes to the others and JetStream is ready on it.

        Ready: `/routez` shows a route to every other running server, `/jsz` names the same
        meta leader with the whole cluster as its group (every peer current, as the leader
        sees it), and `/healthz` says ok.

        Raises:
            RuntimeError: Not within `timeout_s` (the message has each server's last answers
                and log).
        """
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        last: dict[str, Any] = {}
        while True:
            problems = self._not_ready(last)
            if not problems:
                return
            if time.monotonic() > deadline:
                logs = "\n".join(self.procs.log(s.process, 2000) for s in self.servers)
                raise RuntimeError("the NATS cluster was not ready: " + "; ".join(problems)
                                   + f"\nlast answers: {json.dumps(last)[:3000]}\n{logs}")
            time.sleep(0.1)

    def _not_ready(self, last: dict[str, Any]) -> list[str]:
        running = [s for s in self.servers if self.procs.alive(s.process)]
        problems = []
        leaders = set()
        for spec in self.servers:
            if spec not in running:
                if spec.process in self.procs.procs:
                    problems.append(f"{spec.name} exited")
                continue
            health = self._http(spec, "/healthz")
            routez = self._http(spec, "/routez")
            jsz = self._http(spec, "/jsz")
            last[spec.name] = {"healthz": health, "jsz": jsz}
            if health is None or health.get("status") != "ok":
                problems.append(f"{spec.name} not healthy ({health})")
                continue
            routed = {r.get("remote_name") for r in (routez or {}).get("routes", [])}
            missing = {s.name for s in running if s is not spec} - routed
            if missing:
                problems.append(f"{spec.name} has no route to {sorted(missing)}")
            meta = (jsz or {}).get("meta_cluster") or {}
            leader = meta.get("leader")
            if not leader:
                problems.append(f"{spec.name} knows no JetStream meta leader")
                continue
            leaders.add(leader)
            if meta.get("cluster_size") != self.size:
                problems.append(f"{spec.name}: meta group of {meta.get('cluster_size')}")
            if leader == spec.name:
                peers = {p.get("name"): p for p in meta.get("replicas") or []}
                behind = [s.name for s in running if s is not spec
                          and not (peers.get(s.name) or {}).get("current")]
                if behind:
                    problems.append(f"meta leader {leader}: peers not current {behind}")
        if len(leaders) > 1:
            problems.append(f"servers disagree on the meta leader: {sorted(leaders)}")
        return problems

    @staticmethod
    def _http(spec: ServerSpec, path: str) -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{spec.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                data = json.loads(response.read())
        except urllib.error.HTTPError as e:  # /healthz answers 503 with a JSON body
            with contextlib.suppress(Exception):
                data = json.loads(e.read())
                return data if isinstance(data, dict) else None
            return None
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def meta_leader(self) -> str | None:
        """The JetStream meta leader's server name, as the first running server sees it."""
        for spec in self.servers:
            if self.procs.alive(spec.process):
                jsz = self._http(spec, "/jsz") or {}
                return (jsz.get("meta_cluster") or {}).get("leader")
        return None

    def connections(self, index: int) -> list[str]:
        """The names of the clients connected to server `index` (`/connz`)."""
        connz = self._http(self.servers[index], "/connz?limit=1024") or {}
        return [c.get("name") or "" for c in connz.get("connections", [])]

    def close(self) -> list[int]:
        """Kill every server, remove the directory (always); returns stray pids killed."""
        try:
            return self.procs.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log(self, index: int, tail: int = 4000) -> str:
        """The tail of server `index`'s log."""
        return self.procs.log(self.servers[index].process, tail)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> NatsCluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.close)


class NatsServer:
    """One `nats-server -c <config>` process in a `Processes` registry.

    Args:
        config: The configuration file; the server runs in its directory (so relative
            `include`s resolve there).
        procs: The registry that starts it (its log is the process's, named `name`).
        env: Extra environment variables (passwords the configuration reads; None removes
            one).
        port: The client port the configuration listens on; None when it says
            `listen: "127.0.0.1:-1"` (the port is then read from a ports file).
        name: Its process name in `procs`.
    """

    def __init__(self, config: Path, procs: Processes,
                 env: Mapping[str, str | None] | None = None, port: int | None = None,
                 name: str = "nats") -> None:
        self.config = config
        self.procs = procs
        self.env = dict(env or {})
        self.port = port
        self.name = name
        self._ports_dir = config.parent / f"{name}-ports"

    @property
    def url(self) -> str:
        """The client URL, without credentials."""
        return f"nats://127.0.0.1:{self.port}"

    def user_url(self, user: str, password: str) -> str:
        """The client URL of `user`."""
        return f"nats://{user}:{password}@127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        """Start the server; return once it accepts clients.

        Raises:
            AssertionError: It exited (the message has its log) or did not accept clients
                within `timeout_s`.
        """
        argv = [find_nats_server(), "-c", str(self.config)]
        if self.port is None:
            shutil.rmtree(self._ports_dir, ignore_errors=True)
            self._ports_dir.mkdir(parents=True)
            argv += ["--ports_file_dir", str(self._ports_dir)]
        proc = self.procs.spawn(self.name, argv, env=self.env, cwd=self.config.parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"nats-server exited:\n{self.procs.text(self.name)}")
            if self.port is None:
                self.port = self._port_from_file()
            elif self._accepts():
                return self
            time.sleep(0.02)
        raise AssertionError(f"nats-server did not start within {timeout_s} s:\n"
                             f"{self.procs.text(self.name)}")

    def _port_from_file(self) -> int | None:
        for f in self._ports_dir.glob("*.ports"):
            with contextlib.suppress(ValueError, OSError, IndexError, KeyError):
                return int(json.loads(f.read_text())["nats"][0].rsplit(":", 1)[1])
        return None

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", int(self.port or 0)), timeout=0.5) as s:
                return s.recv(4) == b"INFO"
        except OSError:
            return False

    def reload(self) -> None:
        """Make it read its configuration again (SIGHUP), as an operator's reload does."""
        self.procs.procs[self.name].send_signal(signal.SIGHUP)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL past `timeout_s`."""
        if self.name in self.procs.procs:
            self.procs.stop(self.name, timeout_s)


class Relay:
    """A TCP relay (on the test's event loop) between some clients and the nats-server.

    Services connected through a relay reconnect, after a NATS restart, only once the test
    `release()`s it: the order in which services come back, a race in real life, is then the
    test's choice. While held, a client's connection is accepted and closed at once (nats-py
    counts a failed attempt and retries).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port: int | None = None
        self.open = True
        self._server: Any = None
        self._writers: set[Any] = set()

    @property
    def url(self) -> str:
        """The URL its clients connect to."""
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen on a free loopback port (on the running loop)."""
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        """Refuse new connections (existing ones live until the server goes)."""
        self.open = False

    def release(self) -> None:
        """Let clients connect again."""
        self.open = True

    async def _client(self, reader: Any, writer: Any) -> None:
        if not self.open:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: Any, dst: Any) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.close()
                    self._writers.discard(w)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        """Stop listening and close every relayed connection."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        self._writers.clear()
