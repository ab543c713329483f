"""Adversarial probes of the pipeline frequency optimizer, every piece a real process.

A module-wide cluster: an embedded `nats-server`, `zeus-coordinator run` (scheduler
`InstructionProfiler3D` with a tiny grid, one iteration per profiling result, 2 s leases, a
`/healthz` port), one `zeus-agent run --backend sim` on each of nodes "a" and "b" (4 simulated
A40s each). Trainers are child processes speaking raw datagrams on the agents' sockets (the agent
takes each sender's pid from the kernel, so ranks must be separate processes), driven line by
line over their stdin: the test controls every counter, name and timing, as a malicious or buggy
trainer would.

Each probe asserts what an operator would expect; those marked "Regression (a defect found by
review, fixed)" failed before their fix (their docstrings say what was wrong). Bounded: every
wait has a deadline; every process and temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from coordinator.pipeline.dumps import job_dir_name
from tests.e2e.adversarial_kit import log, sim_cluster
from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    CommandEnvelope,
    ErrorEvent,
    InfoCmd,
    InstallScheduleCmd,
    JobQuery,
    JobStatus,
    Reply,
)
from zeus_agent.wire.trainer import (
    Kind,
    ScheduleNotice,
    decode_datagram,
    encode_notice,
    encode_request,
)
from zeus_demo.cluster import SimCluster, console_script, free_port, wait_for, wait_for_async

pytestmark = pytest.mark.timeout(60)

TOP_MHZ = 1740  # the simulated A40's highest SM clock
COORDINATOR = console_script("zeus-coordinator", "coordinator.cli")
PROFILER_ARGS = {"clocks": 2, "warmup_iterations": 0, "min_profile_iterations": 1}
LEASE_S = 2.0


# ---------------------------------------------------------------------- the cluster
GPUS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    """NATS, a coordinator (with a `/healthz` port) and the agents of nodes a and b (4 simulated
    A40s each), as separate processes (the harness's `SimCluster`)."""
    with sim_cluster(gpus_per_node=GPUS, root_prefix="zpa", energy_update_ms=None,
                     status_ports=True, coordinator_args=[
                         "--scheduler", "InstructionProfiler3D",
                         "--scheduler-args", json.dumps(PROFILER_ARGS),
                         "--profiling-iterations", "1", "--switch-lead-steps", "1",
                         "--lease-s", str(LEASE_S)]) as c:
        yield c


def dump_dir(c: SimCluster) -> Path:
    """The coordinator's `--dump-dir`."""
    return c.root / "dump"


def restart_coordinator(c: SimCluster) -> None:
    """Start the (killed) coordinator again; until its log says it is ready."""
    before = log(c, "coordinator").count("coordinator ready")
    c.start_coordinator()
    wait_for(lambda: log(c, "coordinator").count("coordinator ready") > before, 30,
             "the coordinator")


def restart_agent(c: SimCluster, node: str) -> None:
    """Start the (killed) agent of `node` again on its GPUs; until its log says it has them."""
    before = log(c, f"agent-{node}").count("GPU(s)")
    c.start_agent(node, attach=True)
    wait_for(lambda: log(c, f"agent-{node}").count("GPU(s)") > before, 30, f"agent {node}")


# ---------------------------------------------------------------------- trainers
RANK_CHILD = r"""
import itertools, json, signal, socket, sys, time
from zeus_agent.wire.trainer import (Kind, ReplyDatagram, ScheduleNotice, decode_datagram,
                                     encode_event, encode_request)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("")
s.connect(sys.argv[1])
s.settimeout(10)
ids = itertools.count(1)
notices = []
instr = -1
stop = [False]
signal.signal(signal.SIGUSR1, lambda *_: stop.__setitem__(0, True))

def take(data):
    dg = decode_datagram(data)
    if isinstance(dg, ScheduleNotice):
        notices.append(dg.model_dump())
    return dg

def drain():
    s.setblocking(False)
    try:
        while True:
            take(s.recv(70000))
    except (BlockingIOError, OSError):
        pass
    finally:
        s.setblocking(True)
        s.settimeout(10)

def ev(kind, a, b=0, name=""):
    try:
        s.send(encode_event(int(kind), 0, time.monotonic_ns(), a, b, name))
    except OSError:
        pass  # the agent is gone (killed): the trainer keeps training

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    out = {}
    if op == "req":
        rid = next(ids)
        s.send(encode_request(Kind(cmd["kind"]), 0, rid, cmd["payload"]))
        while True:
            dg = take(s.recv(70000))
            if isinstance(dg, ReplyDatagram) and dg.request_id == rid:
                out = dg.reply.model_dump()
                break
    elif op == "reconnect":
        s.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind("")
        s.connect(sys.argv[1])
        s.settimeout(10)
    elif op == "run":
        names = cmd["names"]
        step = cmd["start"]
        deadline = time.monotonic() + cmd["seconds"]
        n = 0
        stop[0] = False
        while time.monotonic() < deadline and n < cmd.get("max", 10**9) and not stop[0]:
            ev(Kind.STEP_BEGIN, step + cmd.get("offset", 0))
            for name in (names if isinstance(names[0], str) else names[n % len(names)]):
                instr += 1
                ev(Kind.INSTRUCTION_BEGIN, instr, step + cmd.get("offset", 0), name)
                if cmd["dt"]:
                    time.sleep(cmd["dt"])
                ev(Kind.INSTRUCTION_END, instr, step + cmd.get("offset", 0), name)
            ev(Kind.STEP_END, step + cmd.get("offset", 0))
            step += 1
            n += 1
            time.sleep(cmd.get("gap", 0.0))
        drain()
        out = {"next": step, "notices": len(notices)}
    elif op == "notices":
        drain()
        out = {"notices": notices}
    print(json.dumps(out), flush=True)
"""


class Rank:
    """A trainer rank in a child process of its own (so the kernel names it apart)."""

    def __init__(self, proc: Any, node: str, gpu: int) -> None:
        self.proc = proc
        self.node = node
        self.gpu = gpu
        self.next_step = 0
        self._running: asyncio.Task[Any] | None = None

    @classmethod
    async def start(cls, c: SimCluster, node: str, gpu: int) -> Rank:
        """A rank process in the cluster's registry (its stderr in its log), driven by lines."""
        proc = c.procs.spawn(f"prank-{next(_ranks)}", [
            sys.executable, "-c", RANK_CHILD, str(c.socket_path(node))], cwd=REPO_ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        return cls(proc, node, gpu)

    async def call(self, cmd: dict[str, Any], timeout_s: float = 15) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if not line:
            raise AssertionError(f"rank on {self.node}/gpu{self.gpu} died")
        return json.loads(line)

    async def req(self, kind: Kind, payload: dict[str, Any]) -> Reply:
        return Reply.model_validate(await self.call({"op": "req", "kind": int(kind),
                                                     "payload": payload}))

    async def join(self, job: tuple[str, str], rank: int, dp: int, pp: int) -> None:
        """HELLO and REGISTER_RANK as rank `rank` of `job` (its id and join token)."""
        job_id, token = job
        hello = await self.req(Kind.HELLO, {"job_id": job_id, "rank": rank, "dp_rank": dp,
                                            "pp_rank": pp, "gpu_index": self.gpu,
                                            "join_token": token})
        assert hello.ok, hello
        reg = await self.req(Kind.REGISTER_RANK, {
            "job_id": job_id,
            "join_token": token,
            "rank_info": {"rank": rank, "dp_rank": dp, "pp_rank": pp, "tp_rank": 0,
                          "available_frequencies": []},
            "gpu": {"node": self.node, "gpu_index": self.gpu}})
        assert reg.ok, reg

    def run(self, seconds: float, names: list[Any], dt: float = 0.004, gap: float = 0.0,
            offset: int = 0, max_steps: int | None = None) -> asyncio.Task[Any]:
        """Train in the background for `seconds` (iterations of `names`)."""
        cmd = {"op": "run", "start": self.next_step, "seconds": seconds, "names": names,
               "dt": dt, "gap": gap, "offset": offset}
        if max_steps is not None:
            cmd["max"] = max_steps

        async def go() -> Any:
            out = await self.call(cmd, timeout_s=seconds + 30)
            self.next_step = out["next"]
            return out

        self._running = asyncio.ensure_future(go())
        return self._running

    async def stop(self) -> Any:
        """End the background run now (SIGUSR1), return its result."""
        if self._running is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGUSR1)
        out = await self._running
        self._running = None
        return out

    async def notices(self) -> list[dict[str, Any]]:
        if self._running is not None:
            await self._running
        return (await self.call({"op": "notices"}))["notices"]

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await asyncio.to_thread(self.proc.wait)
        if self._running is not None:
            self._running.cancel()
            with contextlib.suppress(BaseException):
                await self._running

    async def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.req(Kind.BYE, {}), 5)
        await self.kill()


_ranks = itertools.count()
"""Numbers the rank processes' names in the cluster's registry."""


class Observer:
    """A NATS client following job statuses and agent errors."""

    def __init__(self, c: SimCluster, nc: Any) -> None:
        self.c = c
        self.nc = nc
        self.statuses: list[JobStatus] = []
        self.errors: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, c: SimCluster) -> Observer:
        nc = await connect(c.url, "pipeline-adversary")
        obs = cls(c, nc)

        async def on_status(msg: Any) -> None:
            obs.statuses.append(codec.decode(msg.data, JobStatus))

        async def on_error(msg: Any) -> None:
            obs.errors.append(codec.decode(msg.data, ErrorEvent).model_dump())

        await nc.subscribe(subjects.all_job_status(), cb=on_status)
        await nc.subscribe(f"{subjects.DEFAULT_PREFIX}.gpu.*.*.error", cb=on_error)
        await confirm_subscriptions(nc)
        return obs

    def of(self, job_id: str) -> list[JobStatus]:
        return [s for s in self.statuses if s.job_id == job_id]

    def messages(self, job_id: str) -> str:
        return "\n".join(f"  {s.state}: {s.message}" for s in self.of(job_id))

    async def wait_status(self, job_id: str, pred: Any, timeout_s: float, what: str,
                          after: int = 0) -> JobStatus:
        return await wait_for_async(
            lambda: next((s for s in self.of(job_id)[after:] if pred(s)), None), timeout_s,
            lambda: f"no status '{what}' within {timeout_s} s for {job_id}:\n"
                    f"{self.messages(job_id)}")

    async def query(self, job_id: str | None) -> dict[str, Any]:
        msg = await self.nc.request(subjects.coord_job_query(),
                                    codec.encode(JobQuery(job_id=job_id)), timeout=5)
        reply = codec.decode(msg.data, Reply)
        assert reply.ok, reply
        return reply.result

    async def command(self, node: str, gpu: int, cmd: Any) -> Reply:
        msg = await self.nc.request(subjects.gpu_command(node, gpu),
                                    codec.encode(CommandEnvelope(cmd=cmd)), timeout=5)
        return codec.decode(msg.data, Reply)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), 5)


_tags = itertools.count()


class Job:
    """One pipeline job of the test: its ranks (child processes) and its id."""

    def __init__(self, c: SimCluster, obs: Observer) -> None:
        self.c = c
        self.obs = obs
        self.ranks: list[Rank] = []
        self.job_id = ""
        self.join_token = ""

    async def register(self, placements: list[tuple[str, int]], pp: int, dp: int,
                       metadata: str | None = None, **extra: Any) -> Reply:
        """Register the job through the first placement's rank process."""
        for node, gpu in placements:
            self.ranks.append(await Rank.start(self.c, node, gpu))
        job: dict[str, Any] = {"pp_degree": pp, "dp_degree": dp, "tp_degree": 1,
                               "world_size": pp * dp,
                               "job_metadata": metadata or f"adv{next(_tags)}x{os.getpid()}"}
        reply = await self.ranks[0].req(Kind.REGISTER_JOB, {"job": job, **extra})
        if reply.ok:
            self.job_id, self.join_token = reply.result["job_id"], reply.result["join_token"]
        return reply

    @property
    def key(self) -> tuple[str, str]:
        """What a rank joins with: the job id and its join token."""
        return self.job_id, self.join_token

    async def join_all(self, pp: int) -> None:
        """Every rank says HELLO and registers (rank r: pp_rank r % pp, dp_rank r // pp)."""
        for r, rank in enumerate(self.ranks):
            await rank.join(self.key, r, r // pp, r % pp)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.ranks), return_exceptions=True)


@pytest.fixture
async def env(cluster: SimCluster) -> AsyncIterator[tuple[SimCluster, Observer, list[Job]]]:
    obs = await Observer.open(cluster)
    jobs: list[Job] = []
    try:
        yield cluster, obs, jobs
    finally:
        for job in jobs:
            await job.close()
        await obs.close()


async def new_job(env: Any, placements: list[tuple[str, int]], pp: int, dp: int = 1,
                  **kw: Any) -> Job:
    c, obs, jobs = env
    job = Job(c, obs)
    jobs.append(job)
    reply = await job.register(placements, pp, dp, **kw)
    assert reply.ok, reply
    await job.join_all(pp)
    return job


FB = ["forward", "backward"]


# ====================================================================== calibration
async def test_world_size_one_pipeline_job_is_profiled_and_served(env: Any) -> None:
    """Regression: a 1-stage, 1-rank pipeline job goes discovering -> profiling -> serving; its
    GPU runs the served plan's clocks, and is unlocked when the trainer says BYE."""
    c, obs, _ = env
    job = await new_job(env, [("a", 0)], pp=1)
    job.ranks[0].run(15, FB)
    try:
        await obs.wait_status(job.job_id, lambda s: s.state == "serving", 15, "serving")
        await asyncio.sleep(0.3)
        assert locked(c, "a", 0) == (TOP_MHZ, TOP_MHZ)  # the served (all-max) plan
    finally:
        await job.ranks[0].stop()
    assert "error" not in [s.state for s in obs.of(job.job_id)], obs.messages(job.job_id)
    assert (await job.ranks[0].req(Kind.BYE, {})).ok
    assert locked(c, "a", 0) is None  # restored when the trainer leaves


def locked(c: SimCluster, node: str, gpu: int) -> tuple[int, int] | None:
    return SimGPU.open(c.sim_dir(node), gpu).get_locked_sm_clocks_mhz()


def load_ranks_of(c: Any, job_id: str) -> list[list[str]]:
    """Each rank's instruction order as the coordinator dumped it (`ranks.json`)."""
    data = json.loads((dump_dir(c) / job_dir_name(job_id) / "ranks.json").read_text())
    return [r["instructions"] for r in data]


# ====================================================================== trainer-made values
async def test_a_step_counter_near_2_64_does_not_stall_the_job_silently(env: Any) -> None:
    """Regression (a defect found by review, fixed). Rank 1 of a 2-stage job counts its steps from
    2**63 (msgpack carries it; the agent
    and the wire accept any int). `from_step` = latest step of ANY rank + lead, so schedule 0
    switches at step ~2**63 on every rank: rank 0 never gets there, its measurements never
    carry version 0, and the job sits in `profiling` forever with no error status (only the
    query's `waiting_for` hints at it). Expected: the absurd counter is refused/ignored (the
    job proceeds), or a status says which rank's step counter is out of line."""
    c, obs, _ = env
    job = await new_job(env, [("a", 1), ("b", 1)], pp=2)
    job.ranks[0].run(8, FB)
    job.ranks[1].run(8, FB, offset=2**63)
    try:
        # The agent refuses to measure such counters and says so; the job stops, naming it.
        await obs.wait_status(job.job_id, lambda s: s.state == "error" and "rank 1" in s.message,
                              8, "an error naming rank 1's counter")
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))


async def test_measurements_with_impossible_values_are_refused_at_decode(env: Any) -> None:
    """Regression (a defect found by review, fixed). `Measurement` refuses NaN/inf (good) but takes
    a negative duration,
    a negative energy, an end stamp before its begin stamp and negative step/index counters:
    such a batch (from a buggy or compromised agent) reaches `PipelineJob` and becomes a
    `ProfilingResult` with negative `iter_time` fed to the scheduler. Expected: refused at
    decode, counted as `malformed` like the NaN batch."""
    c, obs, jobs = env
    job = Job(c, obs)  # (Known to the coordinator: another job's batches are not decoded.)
    jobs.append(job)
    assert (await job.register([("a", 3)], pp=1, dp=1)).ok

    def batch(**measurement: Any) -> bytes:
        m = {"kind": "step", "name": "", "epoch": 0, "step": 3, "index": 0, "t0_ns": 10,
             "t1_ns": 20, "time_s": 1.0, "energy_j": 1.0, **measurement}
        return msgpack.packb({"v": 1, "node": "a", "job_id": job.job_id,
                              "gpus": [{"gpu": 3, "rank": 0, "measurements": [m]}]})

    subject = subjects.job_measurements(job.job_id, "a")
    before = c.health()["dropped"].get("malformed", 0)
    await obs.nc.publish(subject, batch(time_s=float("nan")))
    await obs.nc.publish(subject, batch(energy_j=float("inf")))
    await obs.nc.flush()
    await wait_for_async(lambda: c.health()["dropped"].get("malformed", 0) >= before + 2, 5,
                     "the NaN/inf batches to be dropped as malformed")
    before = c.health()["dropped"].get("malformed", 0)
    bad = {"negative time_s": {"time_s": -5.0}, "negative energy_j": {"energy_j": -1e6},
           "t1_ns before t0_ns": {"t0_ns": 20, "t1_ns": 10},
           "negative step": {"step": -7}, "negative index": {"kind": "instruction",
                                                             "name": "forward", "index": -1}}
    for fields in bad.values():
        await obs.nc.publish(subject, batch(**fields))
    await obs.nc.flush()
    await asyncio.sleep(0.5)
    dropped = c.health()["dropped"].get("malformed", 0) - before
    assert dropped == len(bad), (
        f"only {dropped} of {len(bad)} impossible measurements ({', '.join(bad)}) were refused "
        "at decode")


async def test_instruction_order_changing_between_iterations_is_reported(env: Any) -> None:
    """Regression (a defect found by review, fixed). A rank runs [forward, backward] in its first
    iteration (learnt as its order) and
    then [forward, forward, backward, backward]. The agent publishes `schedule_mismatch` error
    events (the coordinator does not follow them); InstructionProfiler skips every window
    ("results do not match the schedule") and holds its setting without bound: the job profiles
    forever ("profiling 102/104: schedule 101", the total growing with each round, a new
    schedule installed every iteration, the GPU held at profiling clocks), and no status says
    the rank's instructions changed. Expected: an error status naming it (the job stops)."""
    c, obs, _ = env
    job = await new_job(env, [("a", 2)], pp=1)
    # One iteration of one shape, then another shape: discovery needs two alike iterations,
    # so the order learnt is the one the rank keeps running.
    job.ranks[0].run(0.5, FB, max_steps=1)
    await job.ranks[0].stop()
    job.ranks[0].run(6, [FB * 2])
    try:
        await obs.wait_status(job.job_id, lambda s: s.state == "profiling", 6, "profiling")
        assert len(load_ranks_of(c, job.job_id)[0]) == 2 * len(FB)
        # Now the shape changes while profiling: the agent reports mismatches and the job
        # stops with a status naming the rank (its GPU back at default clocks).
        await job.ranks[0].stop()
        job.ranks[0].run(6, FB)
        await wait_for_async(lambda: any(e.get("code") == "schedule_mismatch"
                                     and e.get("job_id") == job.job_id for e in obs.errors),
                         6, "the agent's schedule_mismatch error event")
        await obs.wait_status(job.job_id, lambda s: s.state == "error"
                              and "rank 0 no longer runs" in s.message, 6,
                              "a status saying the rank's instructions changed")
        await wait_for_async(lambda: locked(c, "a", 2) is None, 5, "the GPU unlocked")
    finally:
        await job.ranks[0].stop()


async def test_dp_peers_with_different_instruction_orders_get_a_clear_error(env: Any) -> None:
    """Regression: two DP replicas of one stage running different instruction orders: the 3D
    scheduler's per-stage schedule does not fit rank 1; the job stops with an error status and
    no GPU is left with locked clocks."""
    c, obs, _ = env
    job = await new_job(env, [("a", 3), ("b", 3)], pp=1, dp=2)
    job.ranks[0].run(6, FB)
    job.ranks[1].run(6, FB * 2)
    try:
        err = await obs.wait_status(job.job_id, lambda s: s.state == "error", 6, "error")
        assert "rank 1" in err.message, err.message
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))
    assert locked(c, "a", 3) is None and locked(c, "b", 3) is None


async def test_a_rank_training_before_the_job_starts_is_discovered_correctly(env: Any) -> None:
    """Regression (a defect found by review, fixed). Rank 0 of a 2-stage job registers and starts
    training at once (as a
    Perseus drop-in does) while rank 1 is still registering. The optimiser starts when rank 1
    registers, in the middle of rank 0's first iteration: the `forward` it already finished was
    measured before the job existed, so the first complete iteration the job sees holds only
    `backward`. Discovery takes it as rank 0's order, and InstructionProfiler refuses the job
    ("rank 0: instructions have no forward"; another scheduler would plan the wrong shape).
    The same race follows every coordinator restart that lands mid-iteration. Expected: a step
    seen only in part is not used for discovery; the job profiles [forward, backward]."""
    c, obs, jobs = env
    job = Job(c, obs)
    jobs.append(job)
    assert (await job.register([("a", 1), ("b", 1)], pp=2, dp=1)).ok
    await job.ranks[0].join(job.key, 0, 0, 0)
    job.ranks[0].run(5, FB, dt=0.6, max_steps=1)  # forward 0-0.6 s, backward 0.6-1.2 s
    await asyncio.sleep(0.8)
    await job.ranks[1].join(job.key, 1, 0, 1)  # the job starts during rank 0's backward
    await job.ranks[0].stop()
    for rank in job.ranks:
        rank.run(6, FB, dt=0.01)
    try:
        await obs.wait_status(job.job_id, lambda s: s.state in ("profiling", "error"), 6,
                              "profiling or error")
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))
    assert "error" not in [s.state for s in obs.of(job.job_id)], obs.messages(job.job_id)
    ranks = json.loads((dump_dir(c) / job_dir_name(job.job_id) / "ranks.json").read_text())
    assert [r["instructions"] for r in ranks] == [FB, FB]


# ====================================================================== deaths and restarts
async def _profiling_job(env: Any, placements: list[tuple[str, int]], pp: int,
                         seconds: float = 20, gap: float = 0.0) -> Job:
    """A job of `pp` stages, its ranks training in the background, seen profiling."""
    c, obs, _ = env
    job = await new_job(env, placements, pp=pp)
    for rank in job.ranks:
        rank.run(seconds, FB, dt=0.01, gap=gap)
    await obs.wait_status(job.job_id, lambda s: s.state == "profiling", 10, "profiling")
    return job


async def test_a_killed_rank_gets_its_gpu_restored_and_the_job_says_so(env: Any) -> None:
    """Regression (a defect found by review, fixed). Rank 1 of a 2-stage job is SIGKILLed
    mid-profiling. Its
    agent notices (reaping) and restores its GPU (clocks unlocked): good. But the coordinator
    does not follow the agents' `trainer_gone` error events, so the job stays in `profiling`
    waiting for a rank that will never report, with no status event; only a query's
    `waiting_for` shows rank 1. Expected: a job status naming the departed rank."""
    c, obs, _ = env
    job = await _profiling_job(env, [("a", 0), ("b", 0)], pp=2)
    try:
        await wait_for_async(lambda: locked(c, "b", 0) is not None, 5, "a clock locked on b/gpu0")
        q = await obs.query(job.job_id)
        seen = len(obs.of(job.job_id))
        await job.ranks[1].kill()
        await wait_for_async(lambda: locked(c, "b", 0) is None, 5,
                         "the killed rank's GPU to be unlocked")
        await obs.wait_status(
            job.job_id, lambda s: s.state in ("error", "stopped") and "rank 1" in s.message, 4,
            "a status about the departed rank 1", after=seen)
        # The job stopped: the surviving rank's GPU is back at its default clocks too.
        await wait_for_async(lambda: locked(c, "a", 0) is None, 5, "the other GPU unlocked")
    finally:
        await job.ranks[0].stop()
    assert q["pipeline"]["phase"] == "profiling"


async def test_agent_sigkill_and_restart_mid_profiling(env: Any) -> None:
    """Regression (a defect found by review, fixed). Node b's agent is SIGKILLed while its rank is
    profiled, and started again
    on the same GPUs; it resets the clocks (good); the rank reconnects and says HELLO again.
    The coordinator reinstalls a schedule only when `restarted` (the hello's agent id differs
    from the previous hello's), but the new agent's FIRST hello (at start, before any trainer
    can bind) already records the new id with no job bound, so the hello announcing the
    rebinding never counts as a restart: the schedule is never installed again, the rank's
    measurements carry no version, and the job waits for them forever in `profiling`, silently.
    Expected: a `reconciled` status, the schedule back on the GPU, the job served."""
    c, obs, _ = env
    job = await _profiling_job(env, [("a", 1), ("b", 1)], pp=2, seconds=30)
    rank = job.ranks[1]
    try:
        c.kill_agent("b")
        restart_agent(c, "b")
        assert locked(c, "b", 1) is None, "the restarted agent should reset the clocks"
        await rank.stop()
        await rank.call({"op": "reconnect"})
        hello = await rank.req(Kind.HELLO, {"job_id": job.job_id, "rank": 1, "pp_rank": 1,
                                            "gpu_index": 1, "join_token": job.join_token})
        assert hello.ok, hello
        rank.run(30, FB, dt=0.01)
        # Reconciled on the agent's announcement after the rebinding, or on its next heartbeat
        # (every 5 s) when a schedule was installed too recently to be called lost.
        await obs.wait_status(job.job_id, lambda s: s.state == "reconciled", 15, "reconciled")
        await obs.wait_status(job.job_id, lambda s: s.state == "serving", 20, "serving")
        assert "error" not in [s.state for s in obs.of(job.job_id)], obs.messages(job.job_id)
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))


async def test_coordinator_sigkill_mid_profiling_loses_nothing(env: Any) -> None:
    """Regression (a defect found by review, fixed). The coordinator is SIGKILLed mid-profiling and
    stays
    down past the lease: the agents restore the GPUs' clocks (good). Restarted, it rebuilds the
    job and profiles again from schedule 0 (documented), writing `0.sched.json`,
    `0.prof.json`... into the same dump directory: the dumps of the first run are overwritten
    by different measurements. Expected: nothing dumped before the restart is lost (a new
    directory or numbering that continues)."""
    c, obs, _ = env
    # Idle time between iterations: the restarted coordinator almost never starts mid-iteration
    # (see test_a_rank_training_before_the_job_starts_is_discovered_correctly for that race).
    job = await _profiling_job(env, [("a", 2), ("b", 2)], pp=2, seconds=40, gap=0.15)
    dump = dump_dir(c) / job_dir_name(job.job_id)
    try:
        await wait_for_async(lambda: (dump / "1.prof.json").exists(), 10, "a second profile dump")
        c.procs.kill("coordinator")
        before = {p.name: p.read_bytes() for p in dump.iterdir()}
        await wait_for_async(lambda: locked(c, "a", 2) is None and locked(c, "b", 2) is None,
                         LEASE_S + 4, "the lapsed leases to unlock the clocks")
        restart_coordinator(c)
        await obs.wait_status(job.job_id, lambda s: s.state == "serving", 20, "serving")
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))
    changed = sorted(n for n, data in before.items()
                     if not (dump / n).exists() or (dump / n).read_bytes() != data)
    assert not changed, f"dumps of the first run overwritten after the restart: {changed}"


# ====================================================================== size
LONG = [f"allreduce-{i:0>240}" for i in range(5000)]


async def test_an_iteration_too_big_for_one_message_fails_clearly(env: Any) -> None:
    """Regression (a defect found by review, fixed). A rank runs 5002 instructions per iteration
    with 250-character names (within
    every per-field bound: names <= 255, <= 100 000 instructions per step). Discovery works and
    `ranks.json` is dumped, but schedule 0 (~1.3 MB of msgpack) exceeds NATS's max payload:
    `request_all`'s publish raises inside the measurement callback (logged only as "NATS error
    ... maximum payload exceeded"), the remaining actions (dump, status) are skipped, and the job
    believes schedule 0 is installed: `phase` profiling, no status event, no GPU ever switches,
    the job waits forever. Expected: an `error` status saying the schedule is too large (or the
    schedule delivered)."""
    c, obs, _ = env
    job = await new_job(env, [("a", 3)], pp=1)
    job.ranks[0].run(20, [FB + LONG], dt=0)
    try:
        await obs.wait_status(job.job_id, lambda s: s.state == "discovering", 5, "discovering")
        ranks_json = dump_dir(c) / job_dir_name(job.job_id) / "ranks.json"
        # (~1.3 MB iterations: 2-3 s alone, more than 15 s once in a loaded full run)
        await wait_for_async(ranks_json.exists, 40, "the instruction order to be learnt")
        try:
            await obs.wait_status(job.job_id, lambda s: s.state in ("profiling", "error"), 4,
                                  "profiling or error")
        except AssertionError:
            q = await obs.query(job.job_id)
            raise AssertionError(
                f"no status since discovery; the coordinator thinks {q['pipeline']}; its log: "
                + " | ".join(line for line in log(c, "coordinator").splitlines()[-5:]
                             if "payload" in line)) from None
    finally:
        await job.ranks[0].stop()


# ====================================================================== forgeries
async def test_schedule_notices_sent_to_the_agent_are_dropped(env: Any) -> None:
    """Regression: a local process sends the agent `ScheduleNotice` datagrams (only the agent
    sends those): they are dropped and reported as malformed; nothing is installed and the
    agent keeps answering."""
    c, obs, _ = env
    reports: list[ErrorEvent] = []

    async def on_report(msg: Any) -> None:
        reports.append(codec.decode(msg.data, ErrorEvent))

    sub = await obs.nc.subscribe(subjects.agent_errors("a"), cb=on_report)
    await confirm_subscriptions(obs.nc)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind("")
        s.connect(str(c.socket_path("a")))
        s.settimeout(5)
        notice = ScheduleNotice(job_id="x", rank=0, version=9, from_step=0,
                                frequencies=[("forward", 210)])
        for _ in range(3):
            s.send(encode_notice(notice))
        s.send(encode_request(Kind.WINDOW, 0, 7, {"t0_ns": 0, "t1_ns": 1, "gpus": [0]}))
        reply = decode_datagram(s.recv(70_000))
        assert getattr(reply, "request_id", None) == 7, reply  # still answering
        await wait_for_async(lambda: any(r.code == "malformed_datagram" for r in reports), 5,
                         "a malformed_datagram report")
    finally:
        s.close()
        await sub.unsubscribe()
    info = await obs.command("a", 0, InfoCmd())
    assert info.ok and info.result["gpu"].get("schedule_version") is None, info


async def test_a_trainer_on_node_a_cannot_feed_measurements_of_node_bs_rank(env: Any) -> None:
    """Regression: a process on node a says HELLO as rank 1 of a job whose rank 1 runs on
    node b, and trains a different instruction order: its agent forwards the measurements, the
    coordinator drops them (`wrong_node`), and the job learns rank 1's order from node b. The
    forger has the job's token (a misconfigured rank of the job, say): without it, node a's
    agent, which relayed rank 0 with the token, refuses the HELLO itself."""
    c, obs, _ = env
    job = await new_job(env, [("a", 0), ("b", 0)], pp=2)
    forger = await Rank.start(c, "a", 1)
    job.ranks.append(forger)
    tokenless = await forger.req(Kind.HELLO, {"job_id": job.job_id, "rank": 1, "pp_rank": 1,
                                              "gpu_index": 1})
    assert (tokenless.ok, tokenless.code) == (False, "forbidden"), tokenless
    hello = await forger.req(Kind.HELLO, {"job_id": job.job_id, "rank": 1, "pp_rank": 1,
                                          "gpu_index": 1, "join_token": job.join_token})
    assert hello.ok  # HELLO is local; the coordinator is the one to refuse
    before = c.health()["dropped"].get("wrong_node", 0)
    forger.run(5, ["evil"] * 3, dt=0.002)
    await asyncio.sleep(0.5)
    for rank in job.ranks[:2]:
        rank.run(5, FB, dt=0.01)
    try:
        await obs.wait_status(job.job_id, lambda s: s.state == "profiling", 8, "profiling")
    finally:
        await asyncio.gather(*(r.stop() for r in job.ranks))
    dumped = dump_dir(c) / job_dir_name(job.job_id) / "ranks.json"
    # Written right after `profiling` is announced.
    await wait_for_async(dumped.exists, 5, f"{dumped}")
    ranks = json.loads(dumped.read_text())
    assert ranks[1]["instructions"] == FB
    assert c.health()["dropped"].get("wrong_node", 0) > before


async def test_job_metadata_with_dot_dot_stays_inside_the_dump_dir(env: Any) -> None:
    """Regression: `job_metadata` = "/../../../escape": the job id holds '/..', its dumps go to
    one safe directory inside the dump dir, nothing is written outside it."""
    c, obs, _ = env
    job = await new_job(env, [("b", 2)], pp=1, metadata="/../../../escape")
    job.ranks[0].run(10, FB)
    try:
        await obs.wait_status(job.job_id, lambda s: s.state == "serving", 10, "serving")
    finally:
        await job.ranks[0].stop()
    assert "/../" in job.job_id
    where = dump_dir(c) / job_dir_name(job.job_id)
    assert (where / "ranks.json").exists() and (where / "0.sched.json").exists()
    assert where.parent == dump_dir(c) and "/" not in where.name and where.name != ".."
    naive = Path(os.path.normpath(dump_dir(c) / job.job_id))  # where a naive join would land
    assert not naive.exists() and not naive.is_relative_to(dump_dir(c)), naive


async def test_a_job_asking_for_a_pipeline_scheduler_and_power_limits_is_refused(
        env: Any) -> None:
    """Regression (a defect found by review, fixed). `RegisterJob` naming the pipeline scheduler AND
    carrying power-limit
    options (pp=2) is accepted: the job id and the query say `InstructionProfiler3D`, while
    the coordinator runs the power-limit optimiser on it. Expected: refused (`bad_request`),
    like a pipeline job naming another scheduler."""
    c, obs, jobs = env
    job = Job(c, obs)
    jobs.append(job)
    reply = await job.register([("b", 3)], pp=2, dp=1, scheduler="InstructionProfiler3D",
                               power_limit={"profile_steps": 5})
    if reply.ok:
        q = await obs.query(reply.result["job_id"])
        raise AssertionError(f"accepted as {reply.result['job_id']!r}: scheduler "
                             f"{q['scheduler']!r}, power_limit_options set: "
                             f"{q['power_limit_options'] is not None}")
    assert reply.code == "bad_request", reply


async def test_a_departed_trainers_gpu_refuses_the_jobs_schedule(env: Any) -> None:
    """Regression: once a job's trainer has said BYE on a GPU, an install of that job's
    schedule (even one switching at a huge `from_step`) is refused; the GPU stays at default."""
    c, obs, _ = env
    job = await new_job(env, [("b", 3)], pp=1)
    job.ranks[0].run(5, FB, max_steps=3)
    await job.ranks[0].stop()
    assert (await job.ranks[0].req(Kind.BYE, {})).ok
    cmd = InstallScheduleCmd(job_id=job.job_id, holder=job.job_id, lease_s=60, version=7,
                             from_step=2**52,  # (the contract's counters end at 2**53)
                             schedule={"rank": 0, "frequencies": [("forward", 210),
                                                                   ("backward", 210)]})
    reply = await obs.command("b", 3, cmd)
    assert not reply.ok and "left" in reply.error, reply
    assert locked(c, "b", 3) is None


# ====================================================================== operator mistakes
CONFIG_ERROR = 2


@pytest.mark.parametrize("scheduler,args,why", [
    ("PointSolution", {"solution_path": "/nonexistent/freqs_pipeline_00000.py"}, "exist"),
    ("InstructionProfiler", {"clocks": 1}, "clocks"),
    ("PointSolution", {"solution_path": "CODE"}, "code"),
], ids=["mistyped-plan-path", "bad-profiler-arg", "plan-file-with-code"])
def test_coordinator_refuses_scheduler_args_it_cannot_run(
        tmp_path: Path, scheduler: str, args: dict[str, Any], why: str) -> None:
    """Regression (a defect found by review, fixed). `zeus-coordinator run` checks only that
    scheduler_args BIND to the scheduler's
    constructor (CoordinatorSettings says "checked at start, not per job"): a mistyped
    `solution_path`, a plan file holding code, or `clocks: 1` are accepted; the coordinator
    starts (here: goes on to connect to NATS) and every pipeline job then fails after its
    discovery. Expected: exit 2 (configuration) naming the problem. The plan file's code is
    never executed (checked)."""
    marker = tmp_path / "pwned"
    if args.get("solution_path") == "CODE":
        plan = tmp_path / "freqs_pipeline_00000.py"
        plan.write_text(f"__import__('os').system('touch {marker}')\n")
        args = {"solution_path": str(plan)}
    done = subprocess.run(
        [*COORDINATOR, "run", "--scheduler", scheduler, "--scheduler-args", json.dumps(args),
         "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout-s", "1",
         "--state-dir", str(tmp_path / "state"), "--log-level", "CRITICAL"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert not marker.exists(), "the plan file's code ran"
    assert done.returncode == CONFIG_ERROR and why in done.stderr, (
        f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
