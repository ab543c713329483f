"""The hostile-agent harness: nats-server with the `nats-auth` users, coordinator replicas as
processes, and a raw attacker client holding one GPU node's agent credential.

Used by `test_hostile_agent.py` and `test_review33_hostile_agent.py` (issue 33), built on the
cluster harness (`zeus_demo.cluster`): every subprocess is in its process registry and runs the
code of the tree the harness lives in (`python -m` with its root on PYTHONPATH and as working
directory).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import pytest

from zeus_agent.broker import confirm_subscriptions
from zeus_agent.models import JobInfo, RankInfo
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    PowerLimitOptions,
    RegisterJob,
    Reply,
)
from zeus_demo.cluster import CODE_ROOT, NatsServer, Processes, Replicas, wait_for_async
from zeus_demo.cluster.processes import child_env

pytestmark = pytest.mark.timeout(150)

ROOT = CODE_ROOT
"""Root of the tree the harness belongs to: the code every subprocess runs."""
HOSTILE, GOOD = "gpu-node-1", "gpu-node-2"
HUGE = 2**63 - 1
ROUNDS = 3
ALIVE_S = 2.5  # how long both replicas must stay up after each attack or restart
READY_S = 30.0  # a coordinator starts in ~1-3 s on this VM; generous for a loaded one
FAILED = ("error", "failed")


def description(index: int, lo: int, hi: int, default: int) -> dict[str, Any]:
    """A GPU's `GpuDescription` as plain data (so it may hold what the model refuses)."""
    return {
        "index": index, "uuid": f"GPU-{index:08d}-hostile", "name": "NVIDIA A40",
        "architecture": "Ampere", "min_power_limit_w": lo, "max_power_limit_w": hi,
        "default_power_limit_w": default, "supported_memory_clocks_mhz": [7251],
        "supported_graphics_clocks_mhz": [1740, 1500, 1200], "has_energy_counter": True,
        "power_limit_w": default,
    }  # fmt: skip


def rank_payload(job_id: str, token: str, node: str, gpu: int,
                 gpu_info: dict[str, Any] | None = None) -> bytes:
    """A `RegisterRank` (rank 0 of a 1-rank job) as raw msgpack, as a relaying agent sends it."""
    payload: dict[str, Any] = {
        "v": 1, "job_id": job_id, "join_token": token,
        "rank_info": RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                              available_frequencies=[]).model_dump(),
        "gpu": GpuBinding(node=node, gpu_index=gpu).model_dump(),
    }  # fmt: skip
    if gpu_info is not None:
        payload["gpu_info"] = gpu_info
    return codec.encode(payload)


ONE_RANK = JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1)


REPLICA_ARGS = ("--ownership-lease-s", "3", "--command-timeout-s", "2",
                "--shutdown-timeout-s", "2")


class Cluster:
    """nats-server with the `nats-auth` users, two coordinator replicas (the harness's
    `Replicas` "r1" and "r2", each with its state under `tmp/<name>`); logs under `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.passwords: dict[str, str] = {}
        self.procs = Processes(tmp)
        self.server: NatsServer | None = None
        self.coordinators: Replicas | None = None
        self.env: dict[str, str | None] = {"ZEUS_PFO_NATS_URL": None}

    @property
    def port(self) -> int:
        assert self.server is not None and self.server.port is not None
        return self.server.port

    # --- NATS ----------------------------------------------------------------------------
    def start_server(self) -> None:
        auth, env_file = self.tmp / "auth.conf", self.tmp / "nats.env"
        gen = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "nats-auth", "--node", HOSTILE,
             "--node", GOOD, "--out", str(auth), "--env-file", str(env_file)],
            cwd=ROOT, env=child_env(self.env), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        for line in env_file.read_text().splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("=", 1)
                self.passwords[name] = value
        (self.tmp / "server.conf").write_text(
            'listen: "127.0.0.1:-1"\ninclude ./auth.conf\n'
            'jetstream { store_dir: "' + str(self.tmp / "js") + '" }\n')
        self.server = NatsServer(self.tmp / "server.conf", self.procs,
                                 env=self.passwords).start(timeout_s=15)
        self.coordinators = Replicas(self.url(permissions.COORDINATOR_USER), self.tmp,
                                     ("r1", "r2"), REPLICA_ARGS, procs=self.procs,
                                     log_level="INFO", env=self.env)

    def url(self, user: str) -> str:
        var = next(u.password_variable for u in permissions.users([HOSTILE, GOOD])
                   if u.name == user)  # fmt: skip
        return f"nats://{user}:{self.passwords[var]}@127.0.0.1:{self.port}"

    async def connect(self, user: str, inbox: str) -> Any:
        return await nats.connect(self.url(user), name=f"test-{user}", inbox_prefix=inbox,
                                  allow_reconnect=False, connect_timeout=5)  # fmt: skip

    # --- replicas --------------------------------------------------------------------------
    def log(self, name: str) -> Path:
        return self.procs.logs[name][-1]

    @property
    def replicas(self) -> dict[str, subprocess.Popen[bytes]]:
        """The latest process of every replica started so far, by name."""
        return {name: self.procs.procs[name] for name in ("r1", "r2")
                if name in self.procs.procs}

    def start_replica(self, name: str) -> None:
        assert self.coordinators is not None, "start the server first"
        self.coordinators.start(name)

    async def start_replicas(self) -> None:
        for name in ("r1", "r2"):
            self.start_replica(name)
        waiting = set(self.replicas)

        def ready() -> bool:
            for name in list(waiting):
                assert self.replicas[name].poll() is None, self.report(f"{name} exited at start")
                if "coordinator ready" in self.procs.text(name):
                    waiting.discard(name)
            return not waiting

        await wait_for_async(ready, READY_S, lambda: self.report(f"{sorted(waiting)} not ready"))

    async def stop_replicas(self) -> dict[str, int | None]:
        """SIGTERM every replica (SIGKILL past 15 s: exit code -9); their exit codes."""
        assert self.coordinators is not None
        await asyncio.to_thread(self.coordinators.stop_all, 15.0)
        return {name: proc.returncode for name, proc in self.replicas.items()}

    async def assert_alive(self, what: str, for_s: float = ALIVE_S) -> None:
        """Both replicas run now and for `for_s` seconds (an exit within it fails at once)."""
        deadline = time.monotonic() + for_s
        while True:
            dead = {n: p.returncode for n, p in self.replicas.items() if p.poll() is not None}
            assert not dead, self.report(f"{what}: replica(s) exited {dead}")
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)

    def report(self, what: str) -> str:
        tails = []
        for name in sorted(self.replicas):
            lines = self.procs.text(name).splitlines()
            notable = [ln for ln in lines[:-15] if " INFO " not in ln][-20:]
            text = "\n".join([*notable, "...", *lines[-15:]])
            tails.append(f"--- {name} (start {len(self.procs.logs[name])}) ---\n{text}")
        return f"{what}\n" + "\n".join(tails)

    async def cli(self, *args: str) -> tuple[int, str]:
        """`zeus-coordinator ARGS` (this tree's), as the coordinator user: (code, output)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.cli", *args, cwd=ROOT, env=child_env(self.env),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(errors="replace")

    def close(self) -> None:
        self.procs.close(grace_s=10)


class FakeAgent:
    """A raw client with one node's agent credential, answering its GPUs' commands itself.

    `info` is answered with `descriptions[gpu]` (raw data: any value the attacker likes); every
    other command with ok. `ops[gpu]` counts the commands received.
    """

    def __init__(self, nc: Any, node: str) -> None:
        self.nc = nc
        self.node = node
        self.descriptions: dict[int, dict[str, Any]] = {}
        self.ops: dict[int, Counter[str]] = {}

    async def serve(self) -> None:
        async def handler(msg: Any) -> None:
            gpu = int(msg.subject.split(".")[-2])
            try:
                op = codec.unpack(msg.data)["cmd"]["op"]
            except Exception:  # noqa: BLE001 - whatever came, count it
                op = "?"
            self.ops.setdefault(gpu, Counter())[op] += 1
            if op == "info" and gpu in self.descriptions:
                reply = {"v": 1, "ok": True, "result": {"gpu": self.descriptions[gpu]}}
            else:
                reply = {"v": 1, "ok": True, "result": {"node": self.node, "gpu": gpu}}
            if msg.reply:
                await msg.respond(codec.encode(reply))

        every_gpu = subjects.gpu_command(self.node, 0).rsplit(".", 2)[0] + ".*.cmd"
        await self.nc.subscribe(every_gpu, cb=handler, queue=f"agent-{self.node}")
        await confirm_subscriptions(self.nc)

    async def request(self, subject: str, data: bytes) -> Reply:
        msg = await self.nc.request(subject, data, timeout=10)
        return codec.decode(msg.data, Reply)

    async def register_job(self, options: PowerLimitOptions) -> tuple[str, str]:
        reply = await self.request(subjects.coord_register_job(self.node),
                                   codec.encode(RegisterJob(job=ONE_RANK, power_limit=options)))
        assert reply.ok, reply
        return reply.result["job_id"], reply.result["join_token"]

    async def register_rank(self, job_id: str, token: str, gpu: int,
                            gpu_info: dict[str, Any] | None = None) -> Reply:
        return await self.request(subjects.coord_register_rank(self.node),
                                  rank_payload(job_id, token, self.node, gpu, gpu_info))
