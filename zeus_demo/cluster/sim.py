"""`SimCluster`: NATS, coordinators, sim agents and a simulated job, each a process.

Every piece is a process of its own, as a deployment runs them:
an embedded `nats-server` (restartable on the same port with the same JetStream directory; or
NATS run elsewhere, such as a `NatsCluster`), `zeus-coordinator run` replicas, one
`zeus-agent run --backend sim` per simulated node, and a simulated data-parallel job
(`zeus_agent.gpu.sim.trainers.data_parallel.run_data_parallel` in a process of its own, started
as `python -m zeus_demo.cluster.trainer SPEC`, its ranks being its children) or the simulated
pipeline trainer. Every process is in the cluster's `Processes` registry: `close()` kills them
and whatever they left, stops NATS and removes the temporary directory.

The cluster follows the job as anyone would: `JobStatus` events on `<p>.job.*.status`, the
coordinator's `<p>.coord.jobs.query`, and the simulated GPUs' shared files (`SimGPU.open`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import AgentHello, JobQuery, JobStatus, Reply
from zeus_agent.wire.node_columns import as_rows, decode_measurements
from zeus_demo.cluster.nats import Relay
from zeus_demo.cluster.ports import free_port
from zeus_demo.cluster.processes import CODE_ROOT, Processes, console_script

__all__ = ["SimCluster"]


class SimCluster:
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
        nats_urls: For NATS run elsewhere (e.g. a `NatsCluster`): the
            NATS URL(s) of each process by name ("observer" for the test's own connection,
            "coordinator", "coordinator-2", ..., "agent-<node>"); no nats-server is started.
        root_prefix: The temporary directory's name starts with it (short: the agents' Unix
            socket paths must fit in 108 bytes).
        energy_update_ms: How often the simulated GPUs' energy counters advance
            (`--sim-energy-update-ms`): 10 ms by default, as the jobs here run ~10x faster than
            real ones; None: the preset's (as NVML's, ~100 ms).
        status_ports: Each replica serves `/healthz` on a port of its own
            (`status_ports[name]`; read with `health(name)`).
    """

    def __init__(self, nodes: Sequence[str] = ("node-a", "node-b"), gpus_per_node: int = 2,
                 coordinator_args: Sequence[str] = (), agent_args: Sequence[str] = (),
                 relays: bool = False, replicas: int = 1,
                 nats_urls: Callable[[str], str] | None = None, root_prefix: str = "zft",
                 energy_update_ms: float | None = 10.0, status_ports: bool = False) -> None:
        # Short: the agents' Unix socket paths must fit in 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix=f"{root_prefix}-", dir="/tmp"))
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
        self.energy_update_ms = energy_update_ms
        self.serve_status = status_ports
        self.status_ports: dict[str, int] = {}

    # ------------------------------------------------------------------ paths
    def sim_dir(self, node: str) -> Path:
        """The state directory of `node`'s simulated GPUs."""
        return self.root / "sim" / node

    def socket_path(self, node: str) -> Path:
        """The trainers' socket of `node`'s agent."""
        return self.root / f"{node}.sock"

    @property
    def url(self) -> str:
        """The embedded nats-server's URL."""
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
                assert self.nats_port is not None, "relays need the embedded nats-server"
                self.relays[side] = Relay(self.nats_port)
                await self.relays[side].start()
        async def wake() -> None:
            self._changed.set()

        self.nc = await connect(self.process_url("observer", "observer"), "fault-test-observer",
                                on_reconnect=wake)
        await self.nc.subscribe(subjects.all_job_status(), cb=self._on_status)
        await self.nc.subscribe(subjects.all_agent_hellos(), cb=self._on_hello)
        await self.nc.subscribe(subjects.all_job_measurements(), cb=self._on_measurements)
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
        """Stop the embedded nats-server (its JetStream directory stays)."""
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
                "--replica-name", name, *self.status_args(name), *self.coordinator_args]
        self.procs.spawn(name, argv, cwd=self.root)

    def status_args(self, name: str) -> list[str]:
        """`--status-port` of replica `name` (the same port at every start), with status ports."""
        if not self.serve_status:
            return []
        return ["--status-port", str(self.status_ports.setdefault(name, free_port()))]

    def health(self, name: str = "coordinator") -> dict[str, Any]:
        """Replica `name`'s `/healthz` JSON (also when unhealthy: 503 has its detail too)."""
        url = f"http://127.0.0.1:{self.status_ports[name]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read()))

    def start_agent(self, node: str, attach: bool = False) -> None:
        """Start the agent of `node` (`attach`: open its existing GPUs, as after a restart)."""
        argv = [*console_script("zeus-agent", "zeus_agent.cli"), "run",
                "--nats-url", self.process_url(f"agent-{node}", "agents"), "--backend", "sim",
                "--sim-count", str(self.gpus_per_node), "--sim-preset", "A40",
                "--sim-state-dir", str(self.sim_dir(node)),
                "--socket-path", str(self.socket_path(node)), "--node", node,
                "--sample-hz", "20", "--log-level", "INFO",
                *([] if self.energy_update_ms is None
                  else ["--sim-energy-update-ms", f"{self.energy_update_ms:g}"]),
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

    async def wait_agent(self, node: str, after: int, exclude: Collection[str] = frozenset(),
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
        batch = as_rows(decode_measurements(msg.data))
        if batch.job_id.endswith(self.tag):
            for part in batch.gpus:
                if part.marks:
                    self.marks.append((time.monotonic(), batch.node, part.rank))
                    self._changed.set()

    def ranks_with_marks_since(self, t: float) -> set[int]:
        """Ranks whose GPU marks arrived after monotonic time `t`."""
        return {rank for at, _, rank in self.marks if at > t}

    def states(self) -> list[str]:
        """The state of every status event of the job, in order."""
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
        self.procs.spawn("trainer", [sys.executable, "-m", "zeus_demo.cluster.trainer",
                                     json.dumps(spec)], cwd=CODE_ROOT)

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
        ], cwd=CODE_ROOT)  # fmt: skip

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
