"""Real processes for fault-injection end-to-end tests: NATS, coordinator, agents, a sim job.

`FaultCluster` starts, as separate processes, what a deployment runs: an embedded
`nats-server` (restartable on the same port with the same JetStream directory),
`zeus-coordinator run`, one `zeus-agent run --backend sim` per simulated node and a simulated
data-parallel job (`zeus_agent.gpu.sim.trainers.data_parallel.run_data_parallel` in a process
of its own, started as `python -m tests.e2e.procs trainer SPEC`, its ranks being its children).
Each process is the leader of a new session, so SIGKILL of its process group takes its children
with it; every process carries a marker in its environment, so `close()` finds and kills
whatever is left, wherever it was reparented, and then removes the temporary directory.

The test follows the job as anyone would: `JobStatus` events on `<p>.job.*.status`, the
coordinator's `<p>.coord.jobs.query`, and the simulated GPUs' shared files (`SimGPU.open`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.fileio import atomic_write
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import AgentHello, JobQuery, JobStatus, MeasurementBatch, Reply

REPO_ROOT = Path(__file__).resolve().parents[2]
MARK_ENV = "ZEUS_FAULT_TEST_MARK"
"""Environment variable carrying the cluster's marker into every process it starts."""


def console_script(name: str, module: str) -> list[str]:
    """The installed console script `name`, else `python -m module`."""
    script = Path(sysconfig.get_path("scripts")) / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def processes_with_mark(mark: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment carries `mark`."""
    found = []
    needle = f"{MARK_ENV}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if needle in environ.split(b"\0") and stat.rsplit(")", 1)[-1].split()[0] != "Z":
            found.append(int(pid))
    return found


class Processes:
    """Processes started by a test: each one a session leader, logging to its own file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mark = uuid.uuid4().hex
        self.logs_dir = root / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, list[Path]] = {}

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` as process `name` (a name is reused after the previous one ended)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"process {name} is still running")
        path = self.logs_dir / f"{name}.{len(self.logs.get(name, []))}.log"
        self.logs.setdefault(name, []).append(path)
        with open(path, "wb") as log:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=cwd, start_new_session=True,
                env={**os.environ, **(env or {}), MARK_ENV: self.mark, "PYTHONUNBUFFERED": "1"},
            )
        self.procs[name] = proc
        return proc

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the process group of `name` (SIGKILL: and reap the leader)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(10)

    def close(self) -> list[int]:
        """Kill every process started here and anything left carrying the marker.

        Returns:
            The pids that were still alive after the groups were killed (they are killed too).
        """
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        strays = processes_with_mark(self.mark)
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while processes_with_mark(self.mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        return strays

    def log(self, name: str, tail: int = 6000) -> str:
        """The last `tail` characters of every log of process `name`, oldest run first."""
        out = []
        for path in self.logs.get(name, []):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")
                out.append(f"----- {path.name} -----\n{text[-tail:]}")
        return "\n".join(out)

    def all_logs(self, tail: int = 4000) -> str:
        return "\n".join(self.log(name, tail) for name in self.logs)


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
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        """Refuse new connections (existing ones live until the server goes)."""
        self.open = False

    def release(self) -> None:
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
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        self._writers.clear()


class FaultCluster:
    """NATS, a coordinator, agents on simulated nodes and one simulated job, all processes.

    Args:
        nodes: Simulated node names, one agent each.
        gpus_per_node: Simulated A40s per node.
        coordinator_args: Extra flags of `zeus-coordinator run`.
        agent_args: Extra flags of every `zeus-agent run`.
        relays: Connect the coordinator and the agents to NATS through `Relay`s (one for the
            coordinator, one for all agents), so a test decides who reconnects first.
        replicas: Coordinator replicas, processes "coordinator", "coordinator-2", ... (each
            `--replica-name`d after its process).
        nats_urls: For NATS run elsewhere (e.g. `tests.e2e.nats_cluster.NatsCluster`): the
            NATS URL(s) of each process by name ("observer" for the test's own connection,
            "coordinator", "coordinator-2", ..., "agent-<node>"); no nats-server is started.
    """

    def __init__(self, nodes: Sequence[str] = ("node-a", "node-b"), gpus_per_node: int = 2,
                 coordinator_args: Sequence[str] = (), agent_args: Sequence[str] = (),
                 relays: bool = False, replicas: int = 1,
                 nats_urls: Callable[[str], str] | None = None) -> None:
        # Short: the agents' Unix socket paths must fit in 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="zft-", dir="/tmp"))
        self.procs = Processes(self.root)
        self.nodes = list(nodes)
        self.gpus_per_node = gpus_per_node
        self.coordinator_args = list(coordinator_args)
        self.agent_args = list(agent_args)
        self.tag = f"fault{uuid.uuid4().hex[:8]}"
        """Job metadata: the job id ends with it."""
        self.nats: Any = None
        self.nats_port: int | None = None
        self.nc: Any = None
        self.statuses: list[Any] = []
        self.hellos: dict[str, list[Any]] = {n: [] for n in self.nodes}
        self.marks: list[tuple[float, str, int]] = []
        """(arrival time, node, rank) of every measurement batch of the job carrying marks."""
        self._changed = asyncio.Event()
        self.trainer_out = self.root / "trainer-result.json"
        self.strays: list[int] = []
        self.use_relays = relays
        self.relays: dict[str, Relay] = {}
        self.replicas = [("coordinator" if i == 0 else f"coordinator-{i + 1}")
                         for i in range(replicas)]
        self.nats_urls = nats_urls

    # ------------------------------------------------------------------ paths
    def sim_dir(self, node: str) -> Path:
        return self.root / "sim" / node

    def socket_path(self, node: str) -> Path:
        return self.root / f"{node}.sock"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def url_for(self, side: str) -> str:
        """The NATS URL of "coordinator" or "agents" (their relay's, with relays)."""
        relay = self.relays.get(side)
        return relay.url if relay is not None else self.url

    def process_url(self, name: str, side: str) -> str:
        """The NATS URL of process `name` (`nats_urls`'s, else that of its `side`)."""
        return self.nats_urls(name) if self.nats_urls is not None else self.url_for(side)

    def gpu_limit(self, node: str, index: int) -> int:
        """The power limit of a simulated GPU, read from its shared file."""
        return SimGPU.open(self.sim_dir(node), index).get_power_limit_w()

    def placements(self) -> list[tuple[str, int]]:
        """(node, GPU) of each rank: every GPU of every node, rank order."""
        return [(n, i) for n in self.nodes for i in range(self.gpus_per_node)]

    def job_limits(self) -> dict[str, int]:
        """The power limit (W) of every GPU of the job, by "node/gpuI"."""
        return {f"{n}/gpu{i}": self.gpu_limit(n, i) for n, i in self.placements()}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start NATS, connect the observer, start the coordinator and the agents."""
        if self.nats_urls is None:
            await self.start_nats()
        if self.use_relays:
            for side in ("coordinator", "agents"):
                self.relays[side] = Relay(self.nats_port)
                await self.relays[side].start()
        async def wake() -> None:
            self._changed.set()

        self.nc = await connect(self.process_url("observer", "observer"), "fault-test-observer",
                                on_reconnect=wake)
        await self.nc.subscribe(subjects.all_job_status(), cb=self._on_status)
        await self.nc.subscribe(subjects.all_agent_hellos(), cb=self._on_hello)
        await self.nc.subscribe(subjects.all_gpu_measurements(), cb=self._on_measurements)
        await confirm_subscriptions(self.nc)
        for name in self.replicas:
            self.start_coordinator(name)
        for node in self.nodes:
            self.start_agent(node)
        await self.wait_coordinator()
        await asyncio.gather(*(self.wait_agent(n, 0) for n in self.nodes))

    async def start_nats(self) -> None:
        """Start nats-server, on the same port and JetStream directory as before if restarted."""
        self.nats = EmbeddedNats(port=self.nats_port or 0, store_dir=str(self.root / "js"))
        await asyncio.to_thread(self.nats.start)
        self.nats_port = self.nats.port

    async def stop_nats(self) -> None:
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)

    async def restart_nats(self, down_s: float, first: str | None = None) -> None:
        """Stop nats-server, leave it down `down_s`, start it again (same port, same state).

        Args:
            down_s: How long the server is down.
            first: With relays, "coordinator" or "agents": that side reconnects (and is
                seen serving again: the coordinator answers a query, every agent announces
                itself, after its buffered messages) before the other side may.
        """
        for relay in self.relays.values():
            relay.hold()
        hellos = {node: len(self.hellos[node]) for node in self.nodes}
        await self.stop_nats()
        await asyncio.sleep(down_s)
        deadline = time.monotonic() + 10
        while True:
            try:
                await self.start_nats()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        await self.wait(lambda: self.nc.is_connected, 10)  # The observer sees everything.
        await confirm_subscriptions(self.nc)
        order = [first, *(s for s in self.relays if s != first)] if first else list(self.relays)
        for side in order:
            self.relays[side].release()
            if side == "coordinator":
                await self.wait_coordinator()
            else:
                for node in self.nodes:
                    await self.wait_agent(node, hellos[node])

    def start_coordinator(self, name: str = "coordinator") -> None:
        """Start coordinator replica `name` (its own state directory for kept files)."""
        argv = [*console_script("zeus-coordinator", "coordinator.cli"), "run",
                "--nats-url", self.process_url(name, "coordinator"),
                "--state-dir", str(self.root / name),
                "--dump-dir", str(self.root / "dump"), "--log-level", "INFO",
                "--replica-name", name, *self.coordinator_args]
        self.procs.spawn(name, argv, cwd=self.root)

    def start_agent(self, node: str, attach: bool = False) -> None:
        """Start the agent of `node` (`attach`: open its existing GPUs, as after a restart)."""
        argv = [*console_script("zeus-agent", "zeus_agent.cli"), "run",
                "--nats-url", self.process_url(f"agent-{node}", "agents"), "--backend", "sim",
                "--sim-count", str(self.gpus_per_node), "--sim-preset", "A40",
                "--sim-state-dir", str(self.sim_dir(node)),
                "--socket-path", str(self.socket_path(node)), "--node", node,
                "--sample-hz", "20", "--log-level", "INFO",
                # Jobs here run ~10x faster than real ones: so does the energy counter.
                "--sim-energy-update-ms", "10",
                *(["--sim-attach"] if attach else []), *self.agent_args]
        self.procs.spawn(f"agent-{node}", argv, cwd=self.root)

    def kill_agent(self, node: str) -> None:
        """SIGKILL the agent of `node` (it restores nothing)."""
        self.procs.kill(f"agent-{node}")

    async def restart_agent(self, node: str) -> Any:
        """Start the agent of `node` again on its existing GPUs; returns its first hello."""
        seen = len(self.hellos[node])
        known = {h.agent_id for h in self.hellos[node]}
        self.start_agent(node, attach=True)
        return await self.wait_agent(node, seen, exclude=known)

    async def wait_agent(self, node: str, after: int, exclude: set[str] = frozenset(),
                         timeout_s: float = 20) -> Any:
        """The first hello of `node` at index >= `after` from an agent not in `exclude`."""
        def found() -> Any:
            return next((h for h in self.hellos[node][after:] if h.agent_id not in exclude),
                        None)
        try:
            return await self.wait(found, timeout_s)
        except TimeoutError:
            raise AssertionError(f"agent of {node} did not announce itself within "
                                 f"{timeout_s} s\n{self.procs.log('agent-' + node)}") from None

    async def wait_coordinator(self, timeout_s: float = 20) -> None:
        """Until the coordinator answers `<p>.coord.jobs.query`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.query(None, timeout_s=0.5)
                return
            except Exception:
                if time.monotonic() > deadline or not any(
                        self.procs.alive(n) for n in self.replicas):
                    raise AssertionError("no coordinator answered queries\n" + "\n".join(
                        self.procs.log(n) for n in self.replicas)) from None
                await asyncio.sleep(0.1)

    async def query(self, job_id: str | None, timeout_s: float = 2.0) -> dict[str, Any]:
        """The coordinator's answer to a `JobQuery` (its `result`)."""
        msg = await self.nc.request(subjects.coord_job_query(),
                                    codec.encode(JobQuery(job_id=job_id)), timeout=timeout_s)
        reply = codec.decode(msg.data, Reply)
        if not reply.ok:
            raise AssertionError(f"query {job_id}: {reply.code}: {reply.error}")
        return reply.result

    async def close(self) -> None:
        """Kill every process, stop NATS, remove the temporary directory (always)."""
        try:
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.nc.close(), 5)
        finally:
            try:
                self.strays = await asyncio.to_thread(self.procs.close)
            finally:
                for relay in self.relays.values():
                    with contextlib.suppress(Exception):
                        await relay.close()
                with contextlib.suppress(Exception):
                    await self.stop_nats()
                shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ observing
    async def _on_status(self, msg: Any) -> None:
        status = codec.decode(msg.data, JobStatus)
        if status.job_id.endswith(self.tag):
            self.statuses.append((time.monotonic(), status))
            self._changed.set()

    async def _on_hello(self, msg: Any) -> None:
        hello = codec.decode(msg.data, AgentHello)
        if hello.node in self.hellos:
            self.hellos[hello.node].append(hello)
            self._changed.set()

    async def _on_measurements(self, msg: Any) -> None:
        batch = codec.decode(msg.data, MeasurementBatch)
        if batch.job_id.endswith(self.tag) and batch.marks:
            self.marks.append((time.monotonic(), batch.node, batch.rank))
            self._changed.set()

    def ranks_with_marks_since(self, t: float) -> set[int]:
        """Ranks whose GPU marks arrived after monotonic time `t`."""
        return {rank for at, _, rank in self.marks if at > t}

    def states(self) -> list[str]:
        return [s.state for _, s in self.statuses]

    def messages(self) -> str:
        """Every status event of the job, one per line (for assertion messages)."""
        return "\n".join(f"  {s.state}: {s.message}" for _, s in self.statuses)

    async def wait(self, predicate: Callable[[], Any], timeout_s: float) -> Any:
        """Until `predicate()` is truthy (checked at every status, hello, or 0.1 s); returns it.

        Raises:
            TimeoutError: Not within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))

    async def wait_status(self, predicate: Callable[[Any], bool], timeout_s: float,
                          what: str, after: int = 0) -> tuple[int, Any]:
        """The first status event at index >= `after` that satisfies `predicate`.

        Returns:
            (its index, the `JobStatus`).
        """
        def found() -> tuple[int, Any] | None:
            for i in range(after, len(self.statuses)):
                if predicate(self.statuses[i][1]):
                    return i, self.statuses[i][1]
            return None
        try:
            return await self.wait(found, timeout_s)
        except TimeoutError:
            raise AssertionError(
                f"no status event '{what}' within {timeout_s} s; trainer "
                f"{'running' if self.procs.alive('trainer') else 'ended'}; events:\n"
                f"{self.messages()}\n"
                + "\n".join(self.procs.log(name, 4000) for name in self.replicas)
            ) from None

    # ------------------------------------------------------------------ the job
    def start_trainer(self, *, workload: str, steps: int, scale: float,
                      power_limit: dict[str, Any], timeout_s: float, seed: int = 0,
                      noise: bool = True) -> None:
        """Start the simulated job, one rank per GPU of every node, in its own process."""
        spec = {
            "placements": [
                {"node": n, "socket_path": str(self.socket_path(n)),
                 "sim_state_dir": str(self.sim_dir(n)), "gpu_index": i}
                for n, i in self.placements()
            ],
            "options": {"workload": workload, "steps_per_epoch": steps, "scale": scale,
                        "power_limit": power_limit, "job_metadata": self.tag, "seed": seed,
                        "noise": noise},
            "timeout_s": timeout_s,
            "out": str(self.trainer_out),
        }
        self.procs.spawn("trainer", [sys.executable, "-m", "tests.e2e.procs", "trainer",
                                     json.dumps(spec)], cwd=REPO_ROOT)

    def start_pipeline_trainer(self, timeout_s: float) -> None:
        """Start the simulated 4-stage GPT-3 pipeline (1F1B, a tenth of real time).

        One rank per GPU of the first two on each node, in its own process; its result goes to
        `pipeline.json`.
        """
        nodes = [f"{n}:{self.socket_path(n)}:{self.sim_dir(n)}:0-1" for n in self.nodes]
        self.procs.spawn("trainer", [
            sys.executable, "-m", "zeus_agent.gpu.sim.trainers.pipeline",
            "--profile", "gpt3-175b+a40", "--stages", "4", "--microbatches", "4",
            "--dp", "1", "--seconds", "30", "--time-scale", "0.1",
            "--job-metadata", self.tag, "--output", str(self.root / "pipeline.json"),
            "--timeout", str(timeout_s), *[arg for node in nodes for arg in ("--node", node)],
        ], cwd=REPO_ROOT)  # fmt: skip

    async def wait_trainer(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the job to end; returns its result (job id, per-rank steps)."""
        proc = self.procs.procs["trainer"]
        try:
            await self.wait(lambda: proc.poll() is not None, timeout_s)
        except TimeoutError:
            raise AssertionError(f"the simulated job did not end within {timeout_s} s; "
                                 f"events:\n{self.messages()}") from None
        try:
            result = json.loads(self.trainer_out.read_text())
        except (OSError, ValueError) as e:
            raise AssertionError(f"the simulated job left no result ({e}); exit code "
                                 f"{proc.returncode}\n{self.procs.log('trainer')}") from None
        if result.get("error"):
            raise AssertionError(f"the simulated job failed: {result['error']}\n"
                                 f"{self.procs.log('trainer')}")
        return result


# ---------------------------------------------------------------------- trainer process
def _trainer_main(spec_json: str) -> int:
    """Run `run_data_parallel` from a JSON spec and write its result as JSON.

    The result's "step_seen_at" has, for each step of rank 0, the `time.monotonic()` (the
    system's clock, the test's too) at which this process learnt it ended (polled every 50 ms).
    """
    from zeus_agent.gpu.sim.trainers.data_parallel import (
        RankPlacement,
        TrainerOptions,
        run_data_parallel,
    )
    from zeus_agent.wire.messages import PowerLimitOptions

    spec = json.loads(spec_json)
    out = Path(spec["out"])
    opts = dict(spec["options"])
    opts["power_limit"] = PowerLimitOptions(**opts["power_limit"])
    seen: list[float] = []
    try:
        result = run_data_parallel([RankPlacement(**p) for p in spec["placements"]],
                                   TrainerOptions(**opts), lambda _: seen.append(time.monotonic()),
                                   spec["timeout_s"])
        data: dict[str, Any] = {
            "job_id": result.job_id,
            "step_seen_at": seen,
            "ranks": [
                {"rank": r.rank, "step_time_s": r.step_time_s,
                 "step_power_limit_w": r.step_power_limit_w,
                 "dropped_events": r.dropped_events, "error": r.error}
                for r in result.ranks
            ],
        }
    except Exception as e:  # noqa: BLE001 - reported to the test
        data = {"error": f"{type(e).__name__}: {e}"}
    atomic_write(out, json.dumps(data))
    return 0 if "error" not in data else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "trainer":
        sys.exit(_trainer_main(sys.argv[2]))
    print("usage: python -m tests.e2e.procs trainer SPEC_JSON", file=sys.stderr)
    sys.exit(2)
