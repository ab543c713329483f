"""Helpers for the agent shell tests: an in-process agent, a raw trainer socket, a subscriber.

* `running_agent(url, **overrides)`: an `AgentServer` on simulated GPUs (short socket path,
  fast sampling), started on the current loop; stopped (and its GPUs restored) on exit.
* `RawTrainer`: the trainer side of the local datagram protocol with raw datagrams, so tests
  control every counter and can send garbage. Replies are read with `loop.sock_recv`, never
  with a blocking `recv` on the loop.
* `Inbox`: a subscription whose messages are awaited one at a time, decoded into a model.
* `command(nc, node, gpu, cmd)`: one GPU command round trip, decoded into a `Reply`.
* `AuthNats`: a nats-server with one password-protected user, whose password a config reload
  revokes (the server then closes the client's connection for good).
* `TrainerProcess`: a real second trainer process (raw datagrams) driven over its stdin, so
  tests can show what one process can and cannot do to another's GPU.
* `gated_gpu(state_dir)`: a simulated GPU (a `GatedGPU`) whose counter reads are counted and
  wait while its `gate` is clear, called in the agent's GPU thread as NVML is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from zeus_agent.agent.server import AgentServer
from zeus_agent.broker import confirm_subscriptions
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.base import GPU
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import CommandEnvelope, GpuCommand, Reply
from zeus_demo.cluster import NatsServer, Processes, free_port, wait_for_async

M = TypeVar("M", bound=BaseModel)
_nodes = itertools.count()


class RecordingSimGPU(SimGPU):
    """A simulated GPU that remembers every clock lock (in order) and when it was applied."""

    locks: list[tuple[int, int, int]]

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:  # noqa: D102
        super().lock_sm_clocks_mhz(min_clock_mhz, max_clock_mhz)
        if not hasattr(self, "locks"):
            self.locks = []
        self.locks.append((min_clock_mhz, max_clock_mhz, time.monotonic_ns()))


@contextlib.asynccontextmanager
async def running_agent(
    url: str,
    sim_count: int = 1,
    recording: bool = False,
    gpus: list[GPU] | None = None,
    **overrides: Any,
) -> AsyncIterator[AgentServer]:
    """Run an in-process agent on `sim_count` fresh simulated GPUs until the block exits.

    `gpus`: the agent's GPUs instead (e.g. simulated GPUs a test gates or counts).
    """
    tmp = Path(tempfile.mkdtemp(prefix="za-", dir="/tmp"))  # AF_UNIX paths are short
    values: dict[str, Any] = {
        "nats_url": url,
        "backend": "sim",
        "node": f"n{os.getpid()}x{next(_nodes)}",
        "sim_count": sim_count,
        "sim_energy_update_ms": 0,  # Exact counters unless a test asks for a coarse one.
        "sim_state_dir": str(tmp / "sim"),
        "socket_path": str(tmp / "agent.sock"),
        "sample_hz": 50.0,
        "publish_interval_s": 0.1,
        "heartbeat_s": 0.5,
        "request_timeout_s": 0.5,
    }
    values.update(overrides)
    settings = AgentSettings(**values)
    given, gpus = gpus, None
    if recording:
        gpus = [
            RecordingSimGPU.create(settings.sim_state_dir, i, energy_update_ms=0)
            for i in range(sim_count)
        ]
    server = AgentServer(settings, gpus=gpus or given)
    task = asyncio.create_task(server.serve())
    try:
        started = asyncio.create_task(server.started.wait())
        done, _ = await asyncio.wait({task, started}, timeout=10, return_when="FIRST_COMPLETED")
        if task in done:
            task.result()  # startup failed: raise its error
        assert started in done, "agent did not start within 10 s"
        server.serve_task = task  # type: ignore[attr-defined]  # for `stop_agent`
        yield server
    finally:
        server.handle_exit()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        shutil.rmtree(tmp, ignore_errors=True)


async def stop_agent(server: AgentServer) -> None:
    """Ask a `running_agent` to exit (as SIGTERM does) and wait until it has shut down."""
    server.handle_exit()
    await asyncio.wait_for(server.serve_task, 10)  # type: ignore[attr-defined]


async def command(nc: Any, node: str, gpu: int, cmd: GpuCommand | bytes) -> Reply:
    """Send one command (a model, or raw bytes) to a GPU and decode the reply."""
    data = cmd if isinstance(cmd, bytes) else codec.encode(CommandEnvelope(cmd=cmd))
    msg = await nc.request(subjects.gpu_command(node, gpu), data, timeout=2)
    return codec.decode(msg.data, Reply)


class Inbox:
    """Messages of one subscription, awaited one at a time.

    Every inbox is remembered in `Inbox.opened` so the `nc` fixture can unsubscribe them before
    it drains (a drain waits for unread messages of a subscription without a callback).
    """

    opened: ClassVar[list[Inbox]] = []

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        Inbox.opened.append(self)

    @classmethod
    async def close_all(cls) -> None:
        """Unsubscribe every inbox opened so far."""
        inboxes, cls.opened = cls.opened, []
        for inbox in inboxes:
            with contextlib.suppress(Exception):
                await inbox.sub.unsubscribe()

    @classmethod
    async def open(cls, nc: Any, subject: str) -> Inbox:
        """Subscribe to `subject` (flushed, so nothing published afterwards is missed)."""
        sub = await nc.subscribe(subject)
        await confirm_subscriptions(nc)
        return cls(sub)

    async def next(self, model: type[M], timeout_s: float = 2.0) -> M:
        """The next message, decoded."""
        msg = await self.sub.next_msg(timeout=timeout_s)
        return codec.decode(msg.data, model)

    async def until(self, model: type[M], pred: Any, timeout_s: float = 3.0) -> M:
        """The first message (decoded) for which `pred(message)` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching {model.__name__} within {timeout_s} s")
            item = await self.next(model, left)
            if pred(item):
                return item


class RawTrainer:
    """A trainer process's socket, speaking raw datagrams (this test process is the trainer).

    `pid` is only what the datagrams *claim*: the agent reads the sender's real pid from the
    kernel, so a `pid` other than this process's is a forgery.
    """

    def __init__(self, socket_path: str, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind("")  # autobind: the agent replies to this address
        self.sock.connect(socket_path)
        self._ids = itertools.count(1)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def send(self, data: bytes) -> None:
        """Send one raw datagram."""
        self.sock.send(data)

    def event(self, kind: dg.Kind, a: int = 0, b: int = 0, name: str = "") -> int:
        """Send one event stamped now; return the stamp."""
        t = time.monotonic_ns()
        self.sock.send(dg.encode_event(kind, self.pid, t, a, b, name))
        return t

    async def event_when_room(self, kind: dg.Kind, a: int = 0, b: int = 0,
                              name: str = "") -> None:
        """One event, waiting while the agent's socket queue is full (Linux queues 10)."""
        while True:
            try:
                self.event(kind, a, b, name)
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)

    async def iteration(self, step: int, names: list[str], first: int) -> None:
        """One step of instructions `names`, numbered from `first`."""
        await self.event_when_room(dg.Kind.STEP_BEGIN, step)
        for i, name in enumerate(names):
            await self.event_when_room(dg.Kind.INSTRUCTION_BEGIN, first + i, step, name)
            await self.event_when_room(dg.Kind.INSTRUCTION_END, first + i, step, name)
        await self.event_when_room(dg.Kind.STEP_END, step)

    async def request(self, kind: dg.Kind, payload: BaseModel | dict) -> Reply:
        """Send a request and await its reply."""
        request_id = next(self._ids)
        self.sock.send(dg.encode_request(kind, self.pid, request_id, payload))
        loop = asyncio.get_running_loop()
        while True:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), 3)
            reply = dg.decode_datagram(data)
            assert isinstance(reply, dg.ReplyDatagram)
            if reply.request_id == request_id:
                return reply.reply

    async def hello(self, job_id: str, rank: int = 0, gpu_index: int = 0) -> Reply:
        """Bind this process to a job rank and GPU (unvalidated: the agent checks)."""
        return await self.request(
            dg.Kind.HELLO, {"job_id": job_id, "rank": rank, "gpu_index": gpu_index}
        )


async def wait_for(pred: Any, timeout_s: float = 3.0, what: str = "condition") -> None:
    """Poll `pred()` every 10 ms until it holds (the harness's `wait_for_async`)."""
    await wait_for_async(pred, timeout_s, what, interval_s=0.01)


TRAINER_PROCESS = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from zeus_agent.wire import trainer as dg
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(""); s.connect(sys.argv[1]); s.settimeout(5)
    ids = iter(range(1, 1 << 30))
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = req.get("pid") or os.getpid()
        if req["op"] == "event":
            s.send(dg.encode_event(req["kind"], pid, time.monotonic_ns(), req["a"], req["b"], ""))
            print("{}", flush=True)
            continue
        rid = next(ids)
        s.send(dg.encode_request(dg.Kind(req["kind"]), pid, rid, req["payload"]))
        while True:
            reply = dg.decode_datagram(s.recv(65536))
            if reply.request_id == rid:
                break
        print(json.dumps(reply.reply.model_dump()), flush=True)
    """
)


class TrainerProcess:
    """A real trainer process speaking raw datagrams, driven line by line over its stdin.

    It runs in a harness `Processes` registry of its own (its log in a temporary directory), so
    it dies with the test whatever happens; `kill()` ends it and removes the directory.
    `pid=` on a call forges the pid field of the datagram (the kernel still names the sender).
    """

    def __init__(self, procs: Processes, pid: int) -> None:
        self.procs = procs
        self.proc = procs.procs["trainer"]
        self.pid = pid

    @classmethod
    async def start(cls, socket_path: str) -> TrainerProcess:
        """Start one and wait until its socket is connected to the agent's."""
        procs = Processes(Path(tempfile.mkdtemp(prefix="ztp-", dir="/tmp")))
        procs.spawn("trainer", [sys.executable, "-c", TRAINER_PROCESS, socket_path],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        trainer = cls(procs, 0)
        try:
            trainer.pid = json.loads(await trainer._line(15))["pid"]
        except BaseException:
            log = procs.log("trainer")
            await trainer.kill()
            raise AssertionError(f"the trainer process did not start:\n{log}") from None
        return trainer

    async def _line(self, timeout_s: float) -> bytes:
        """Its next line of output (read in a thread: the agent may share this loop)."""
        assert self.proc.stdout is not None
        return await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)

    async def _call(self, req: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return json.loads(await self._line(10))

    async def request(self, kind: dg.Kind, payload: BaseModel | dict, pid: int = 0) -> Reply:
        """Send a request (its pid field forged when `pid` is given) and return the reply."""
        if isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="python")
        reply = await self._call({"op": "request", "kind": int(kind), "payload": payload,
                                  "pid": pid})  # fmt: skip
        return Reply.model_validate(reply)

    async def hello(self, job_id: str, rank: int = 0, gpu_index: int = 0, pid: int = 0) -> Reply:
        """Bind this process to a job rank and GPU."""
        hello = {"job_id": job_id, "rank": rank, "gpu_index": gpu_index}
        return await self.request(dg.Kind.HELLO, hello, pid)

    async def event(self, kind: dg.Kind, a: int = 0, b: int = 0, pid: int = 0) -> None:
        """Send one event stamped now."""
        await self._call({"op": "event", "kind": int(kind), "a": a, "b": b, "pid": pid})

    async def kill(self) -> None:
        """SIGKILL (no goodbye) and reap; its directory goes too (again: nothing more)."""
        await asyncio.to_thread(self.procs.close)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        shutil.rmtree(self.procs.root, ignore_errors=True)


class AuthNats:
    """A nats-server with one user whose password a config reload can change (as an operator
    revoking credentials does): the server then closes the client's connection for good."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.conf = tmp / "nats.conf"
        self.procs = Processes(tmp)
        self.server = NatsServer(self.conf, self.procs, port=self.port)

    def write(self, password: str) -> None:
        self.conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f'authorization {{ users = [ {{user: agent, password: "{password}"}} ] }}\n'
        )

    def url(self, password: str) -> str:
        return self.server.user_url("agent", password)

    def start(self) -> AuthNats:
        self.write("first")
        self.server.start()
        return self

    def revoke(self) -> None:
        """Change the password and reload: connected clients are thrown out for good."""
        self.write("second")
        self.server.reload()

    def stop(self) -> None:
        self.server.stop()
        self.procs.close()


class GatedGPU(SimGPU):
    """A simulated GPU whose counter reads are counted and wait while `gate` is clear."""

    gate: threading.Event
    waiting: threading.Event
    reads: int

    def get_total_energy_j(self) -> float:  # noqa: D102
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(10)
        self.reads += 1
        return super().get_total_energy_j()


def gated_gpu(state_dir: Path, energy_update_ms: float = 100) -> GatedGPU:
    SimGPU.create(state_dir, 0, preset="A40", energy_update_ms=energy_update_ms)
    gpu = GatedGPU.open(state_dir, 0)
    assert isinstance(gpu, GatedGPU)
    gpu.calls_block = True  # called in the agent's GPU thread, as NVML is
    gpu.gate, gpu.waiting, gpu.reads = threading.Event(), threading.Event(), 0
    gpu.gate.set()
    return gpu
