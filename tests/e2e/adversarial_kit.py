"""The set-up the adversarial reviews attack: the harness's `SimCluster` (an embedded NATS, a
coordinator and the agents of nodes a and b, all processes) run for synchronous tests
(`sim_cluster`, `running_cluster`), a raw local client of an agent's trainer socket (`Raw`) and
rank processes (`spawn_rank`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from tests.repo_kit import REPO_ROOT
from zeus_agent.wire.trainer import Kind, decode_datagram, encode_event, encode_request
from zeus_demo.cluster import SimCluster, console_script, wait_for

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


_RANKS = itertools.count()


def spawn_rank(c: SimCluster, job: tuple[str, str], rank: int, node: str, gpu: int, steps: int,
               bye_at: int | None, period: float = 0.15) -> subprocess.Popen[bytes]:
    """A rank of `job` (its id and join token) on `node`'s agent, a process of the cluster's
    registry: it registers and prints how (a JSON line), then waits for a line on its stdin
    to start its `steps` (leaving at step `bye_at`)."""
    job_id, token = job
    spec = {"sock": str(c.socket_path(node)), "job": job_id, "rank": rank, "gpu": gpu,
            "steps": steps, "bye_at": -1 if bye_at is None else bye_at, "period": period,
            "registration": rank_payload(job_id, rank, node, gpu, token)}
    return c.procs.spawn(f"rank-{next(_RANKS)}", [
        sys.executable, "-c", RANK_CHILD, json.dumps(spec), str(REPO_ROOT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)


# ---------------------------------------------------------------------- the sim cluster
NODES = ("a", "b")


@contextlib.contextmanager
def sim_cluster(**kwargs: Any) -> Iterator[SimCluster]:
    """A started `SimCluster` of nodes a and b (`kwargs`: its options) for synchronous tests
    and module fixtures, closed afterwards.

    Its loop (its observer's connection) runs in a thread of its own, so it keeps reading while
    the tests block. Started: every agent announced itself, its socket exists and its log says
    it manages its GPUs; the coordinator answers queries and its log says it is ready.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sim-cluster", daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    c = SimCluster(nodes=NODES, **kwargs)
    try:
        run(c.start(), 90)
        for node in NODES:
            wait_for(lambda n=node: c.socket_path(n).exists(), 30, f"agent {node}'s socket")
        wait_for(lambda: "coordinator ready" in log(c, "coordinator"), 30, "the coordinator")
        wait_for(lambda: all("GPU(s)" in log(c, f"agent-{n}") for n in NODES), 30, "the agents")
        yield c
    finally:
        try:
            run(c.close(), 60)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def log(c: SimCluster, name: str) -> str:
    """Every run's log of process `name` of the cluster, oldest first."""
    return c.procs.text(name, every_run=True)


def running_cluster() -> Iterator[SimCluster]:
    """The cluster the adversarial reviews attack (the module fixture `cluster`, here and in
    other modules that attack the same set-up): a coordinator and the agents of nodes a and b,
    3 simulated A40s each."""
    with sim_cluster(gpus_per_node=3, root_prefix="zar", energy_update_ms=None) as c:
        yield c


def bye_everywhere(c: SimCluster) -> None:
    """Release whatever this (pytest) process bound on either node."""
    for node in c.nodes:
        with contextlib.suppress(Exception):
            r = Raw(c.socket_path(node))
            r.req(Kind.BYE, {}, timeout=5)
            r.close()
