"""The set-up the adversarial reviews attack: an embedded NATS, a coordinator and the agents of
nodes a and b as processes of a harness registry (`Cluster`, `running_cluster`), a raw local
client of an agent's trainer socket (`Raw`) and rank processes (`spawn_rank`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import EmbeddedNats
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire.trainer import Kind, decode_datagram, encode_event, encode_request
from zeus_demo.cluster import Processes, console_script, wait_for

DEFAULT_W = 300  # the simulated A40's default (= maximum) power limit
AGENT = console_script("zeus-agent", "zeus_agent.cli")
COORDINATOR = console_script("zeus-coordinator", "coordinator.cli")


# ---------------------------------------------------------------------- helpers
class Raw:
    """A local process speaking the trainers' datagram protocol, as anyone on the node may."""

    def __init__(self, path: str | Path) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.s.bind("")
        self.s.connect(str(path))
        self.ids = itertools.count(1)

    def req(self, kind: Kind, payload: dict[str, Any], timeout: float = 8.0) -> Any:
        rid = next(self.ids)
        self.s.settimeout(timeout)
        self.s.send(encode_request(kind, 0, rid, payload))
        deadline = time.monotonic() + timeout
        while True:
            self.s.settimeout(max(0.01, deadline - time.monotonic()))
            dg = decode_datagram(self.s.recv(70_000))
            if getattr(dg, "request_id", None) == rid:
                return dg.reply

    def event(self, kind: Kind, a: int, b: int = 0, name: str = "") -> None:
        self.s.settimeout(5)
        self.s.send(encode_event(int(kind), 0, time.monotonic_ns(), a, b, name))

    def drain(self) -> None:
        self.s.setblocking(False)
        with contextlib.suppress(OSError):
            while True:
                self.s.recv(70_000)

    def close(self) -> None:
        self.s.close()


def rank_payload(job_id: str, rank: int, node: str, gpu: int,
                 token: str | None) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "join_token": token,
        "rank_info": {"rank": rank, "dp_rank": rank, "pp_rank": 0, "tp_rank": 0,
                      "available_frequencies": []},
        "gpu": {"node": node, "gpu_index": gpu},
    }


RANK_CHILD = r"""
import itertools, json, socket, sys, time
sys.path.insert(0, sys.argv[2])
from zeus_agent.wire.trainer import Kind, decode_datagram, encode_event, encode_request
from zeus_demo.cluster import Processes, console_script, wait_for
spec = json.loads(sys.argv[1])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(""); s.connect(spec["sock"])
s.settimeout(10)
ids = itertools.count(1)
def req(kind, payload):
    rid = next(ids)
    s.send(encode_request(kind, 0, rid, payload))
    while True:
        dg = decode_datagram(s.recv(70000))
        if getattr(dg, "request_id", None) == rid:
            return dg.reply
hello = req(Kind.HELLO, {"job_id": spec["job"], "rank": spec["rank"], "dp_rank": spec["rank"],
                         "gpu_index": spec["gpu"],
                         "join_token": spec["registration"]["join_token"]})
rank = req(Kind.REGISTER_RANK, spec["registration"])
print(json.dumps({"hello": hello.ok, "rank": rank.ok, "code": rank.code}), flush=True)
sys.stdin.readline()  # go
for step in range(spec["steps"]):
    if step == spec["bye_at"]:
        break
    s.send(encode_event(int(Kind.STEP_BEGIN), 0, time.monotonic_ns(), step, 0, ""))
    time.sleep(spec["period"])
req(Kind.BYE, {})
"""


def spawn_rank(sock: Path, job: tuple[str, str], rank: int, node: str, gpu: int, steps: int,
               bye_at: int | None, period: float = 0.15) -> subprocess.Popen[str]:
    job_id, token = job
    spec = {"sock": str(sock), "job": job_id, "rank": rank, "gpu": gpu, "steps": steps,
            "bye_at": -1 if bye_at is None else bye_at, "period": period,
            "registration": rank_payload(job_id, rank, node, gpu, token)}
    return subprocess.Popen([sys.executable, "-c", RANK_CHILD, json.dumps(spec), str(REPO_ROOT)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)


# ---------------------------------------------------------------------- the sim cluster
class Cluster:
    """Embedded NATS, a coordinator and agents of nodes a and b (3 simulated A40s each)."""

    NODES = ("a", "b")

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="zar-", dir="/tmp"))
        self.nats = EmbeddedNats().start()
        self.url = self.nats.url
        self.registry = Processes(self.root)
        self.procs = self.registry.procs

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        return self.registry.spawn(name, argv, cwd=self.root)

    def sock(self, node: str) -> Path:
        return self.root / f"{node}.sock"

    def sim(self, node: str) -> Path:
        return self.root / f"sim-{node}"

    def limit(self, node: str, gpu: int) -> int:
        return SimGPU.open(self.sim(node), gpu).get_power_limit_w()

    def log(self, name: str) -> str:
        return self.registry.text(name, every_run=True)

    def start(self) -> None:
        self.spawn("coord", [*COORDINATOR, "run", "--nats-url", self.url,
                             "--state-dir", str(self.root / "state"),
                             "--dump-dir", str(self.root / "dump")])
        for node in self.NODES:
            self.spawn(f"agent-{node}", [
                *AGENT, "run", "--nats-url", self.url, "--node", node, "--backend", "sim",
                "--sim-count", "3", "--sim-state-dir", str(self.sim(node)),
                "--socket-path", str(self.sock(node)), "--sample-hz", "20"])
        for node in self.NODES:
            wait_for(lambda n=node: self.sock(n).exists(), 30, f"agent {node}'s socket")
        wait_for(lambda: "coordinator ready" in self.log("coord"), 30, "the coordinator")
        wait_for(lambda: all("GPU(s)" in self.log(f"agent-{n}") for n in self.NODES), 30,
                 "the agents")

    def close(self) -> None:
        self.registry.close(grace_s=10)
        self.nats.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def running_cluster() -> Iterator[Cluster]:
    """A started `Cluster`, closed afterwards (the module fixture `cluster`, here and in
    other modules that attack the same set-up)."""
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.close()


def bye_everywhere(c: Cluster) -> None:
    """Release whatever this (pytest) process bound on either node."""
    for node in c.NODES:
        with contextlib.suppress(Exception):
            r = Raw(c.sock(node))
            r.req(Kind.BYE, {}, timeout=5)
            r.close()
