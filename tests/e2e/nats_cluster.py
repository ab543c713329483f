"""A 3-server NATS cluster with JetStream on loopback, each server a real `nats-server` process.

`NatsCluster` writes one configuration file per server (`server_name`, client `listen`, `http`
monitoring, `jetstream { store_dir }` of its own, `cluster { name, listen, routes }` to the
others), starts them, and waits until they route to each other and JetStream has a meta leader
that knows every peer, so KV buckets with 3 replicas can be created. One server can be stopped
and started again on the same ports with the same store directory (`restart`). `close()`
always kills every server (each one a session leader carrying the marker of
`tests.e2e.procs.Processes`, so nothing is left behind) and removes the temporary directory.

Readiness comes from each server's monitoring endpoint: `/jsz` (the meta group's leader and
its peers), `/routez` (routes to the other servers) and `/healthz` (JetStream current).
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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.e2e.procs import Processes
from zeus_agent.broker import find_nats_server

CLUSTER_NAME = "zeus-test"


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
