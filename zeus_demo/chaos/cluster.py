"""The soak's cluster: 3 NATS servers, 2 coordinator replicas, 2 sim agents, each in a namespace.

Every process is in the cluster harness's process registry (`zeus_demo.cluster.Processes`): a
session leader carrying the registry's marker in its environment and dying with the soak, so
`close` kills it and whatever it left, wherever reparented. Servers sync every write before
acknowledging it (`jetstream_block`, `sync_interval: always`); `power_loss` kills one with
SIGKILL and then tears the tail of every message block it wrote in its last second (see
`tear_tails`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from pathlib import Path

from zeus_agent.broker import find_nats_server, jetstream_block
from zeus_demo.chaos.netns import Net
from zeus_demo.cluster import Processes, console_script, kill_group, wait_for

__all__ = ["ChaosCluster", "tear_tails"]

SERVERS = ("n1", "n2", "n3")
REPLICAS = ("r1", "r2")
AGENTS = ("a1", "a2")
GPUS_PER_AGENT = 4


def tear_tails(store: Path, since: float, rng: random.Random, page: int = 4096) -> list[str]:
    """Cut up to a page off every message block written after `since`: a power cut's torn write.

    With `sync_interval: always` a server fsyncs each write before acknowledging it, so a power
    cut loses at most the writes in flight: the tails of the blocks it was writing. Cutting a
    random 1..`page` bytes off each may also drop records already synced (harsher than a real
    cut); the other servers hold every acknowledged record, and the soak lets the cluster
    heal before the next fault.
    """
    torn = []
    for blk in store.rglob("*.blk"):
        try:
            st = blk.stat()
        except OSError:
            continue
        if st.st_mtime >= since and st.st_size > 0:
            cut = rng.randint(1, min(page, st.st_size))
            os.truncate(blk, st.st_size - cut)
            torn.append(f"{blk.relative_to(store)}:-{cut}")
    return torn


class ChaosCluster:
    """The processes of a soak, on `net` (one namespace per process's node)."""

    def __init__(self, net: Net, root: Path, tag: str, lease_s: float, ownership_s: float) -> None:
        self.net, self.root, self.tag = net, root, tag
        self.lease_s, self.ownership_s = lease_s, ownership_s
        self.registry = Processes(root)
        self.procs = self.registry.procs
        self.ended: dict[str, float] = {}
        for node in (*SERVERS, *REPLICAS, *AGENTS, "obs"):
            net.add(node)
        self.urls = ",".join(f"nats://{net.addr(s)}:4222" for s in SERVERS)

    # ------------------------------------------------------------------ processes
    def spawn(self, name: str, node: str, argv: list[str], stdout: int | None = None) -> None:
        """Start `argv` in `node`'s namespace as process `name` (its log: the registry's)."""
        self.registry.spawn(name, [*self.net.exec(node), *argv], cwd=self.root, stdout=stdout)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to the process group of `name`."""
        kill_group(self.procs[name], sig, wait_s=0)

    def log(self, name: str, tail: int = 3000) -> str:
        """The end of the log of `name` (every run of it)."""
        return self.registry.text(name, every_run=True)[-tail:]

    def close(self) -> None:
        """Kill every process of the run (paused ones woken first) and whatever they left."""
        for name in self.procs:
            self.signal(name, signal.SIGCONT)
        self.registry.close()

    # ------------------------------------------------------------------ NATS
    def store(self, server: str) -> Path:
        """The JetStream directory of `server`."""
        return self.root / server / "js"

    def start_server(self, server: str) -> None:
        """Start (or restart, on the same store) NATS server `server`."""
        addr = self.net.addr(server)
        routes = ", ".join(f'"nats-route://{self.net.addr(s)}:6222"' for s in SERVERS
                           if s != server)
        conf = self.root / server / "nats.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(f'server_name: "{server}"\nlisten: "{addr}:4222"\nhttp: "{addr}:8222"\n'
                        f"{jetstream_block(str(self.store(server)))}"
                        f'cluster {{\n  name: "zc"\n  listen: "{addr}:6222"\n'
                        f"  routes: [{routes}]\n}}\n")
        self.spawn(server, server, [find_nats_server(), "-c", str(conf)])

    def healthy(self, server: str) -> bool:
        """Whether `server` answers /healthz with JetStream current (from the observer)."""
        try:
            url = f"http://{self.net.addr(server)}:8222/healthz"
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return bool(json.loads(r.read()).get("status") == "ok")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Until every server is healthy; returns the seconds it took.

        Raises:
            AssertionError: Not within `timeout_s` (the unhealthy servers' logs).
        """
        t0 = time.monotonic()
        wait_for(lambda: all(self.healthy(s) for s in SERVERS), timeout_s,
                 lambda: "the NATS cluster did not heal: " + "; ".join(
                     f"{s}: {self.log(s, 600)}" for s in SERVERS if not self.healthy(s)),
                 interval_s=0.2)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ Zeus
    def start_replica(self, name: str) -> None:
        """Start coordinator replica `name`, recording its history."""
        self.spawn(name, name, [
            *console_script("zeus-coordinator", "coordinator.cli"), "run", "--nats-url", self.urls,
            "--replica-name", name, "--state-replicas", "3", "--state-dir",
            str(self.root / name), "--dump-dir", str(self.root / "dump"),
            "--ownership-lease-s", f"{self.ownership_s:g}", "--lease-s", f"{self.lease_s:g}",
            "--history", str(self.root / f"{name}.history"), "--log-level", "INFO"])

    def start_agent(self, name: str) -> None:
        """Start the sim agent of node `name` (`GPUS_PER_AGENT` A40s), recording its history."""
        self.spawn(name, name, [
            *console_script("zeus-agent", "zeus_agent.cli"), "run", "--nats-url", self.urls,
            "--backend", "sim", "--sim-count", str(GPUS_PER_AGENT), "--sim-preset", "A40",
            "--sim-state-dir", str(self.sim_dir(name)), "--socket-path",
            str(self.socket(name)), "--node", name, "--sample-hz", "20",
            "--sim-energy-update-ms", "10", "--history", str(self.root / f"{name}.history"),
            "--log-level", "INFO"])

    def wait_agents(self, timeout_s: float) -> None:
        """Until every agent has bound its trainers' socket (and announced itself since).

        Raises:
            AssertionError: Not within `timeout_s` (the agents' logs).
        """
        wait_for(lambda: all(self.socket(a).exists() for a in AGENTS), timeout_s,
                 lambda: "the agents did not start: " + " ".join(
                     self.log(a, 1500) for a in AGENTS), interval_s=0.2)
        time.sleep(2.0)

    def sim_dir(self, agent: str) -> Path:
        """The sim GPUs' directory of `agent`."""
        return self.root / agent / "sim"

    def socket(self, agent: str) -> Path:
        """The trainers' socket of `agent`."""
        return self.root / agent / "zeus.sock"

    def histories(self) -> list[str]:
        """Every history line of the run's agents and replicas."""
        lines: list[str] = []
        for path in sorted(self.root.glob("*.history")):
            lines.extend(path.read_text(errors="replace").splitlines())
        return lines
