"""Reproducers from an adversarial review: each test asserts the safe behaviour and fails while
the defect it names is present.

Real processes where it matters: an embedded `nats-server` (and one with the users generated
by `permissions.render_authorization`), `zeus-coordinator run`, `zeus-agent run --backend sim`
on two simulated nodes, and trainers speaking the datagram protocol on the agents' sockets
(raw datagrams, as any local process may send them; the agent takes the sender's pid from the
kernel, so trainers that must be told apart run as child processes). The GPU-level defects are
shown in-process on a `GpuAgent` over a simulated GPU.

Bounded: every wait has a deadline; every process and temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.e2e.adversarial_kit import (
    AGENT,
    COORDINATOR,
    DEFAULT_W,
    Raw,
    bye_everywhere,
    rank_payload,
    running_cluster,
    spawn_rank,
)
from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.broker import connect
from zeus_agent.errors import GPUError, GPUUnavailableError, PayloadError
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.threaded import GPUCaller
from zeus_agent.models import JobInfo
from zeus_agent.wire import codec, permissions, subjects
from zeus_agent.wire.messages import CommandEnvelope, InfoCmd, JobQuery, RegisterJob
from zeus_agent.wire.trainer import Kind, encode_request
from zeus_demo.cluster import (
    NatsServer,
    Processes,
    SimCluster,
    kill_group,
    wait_for,
    wait_for_async,
)

pytestmark = pytest.mark.timeout(60)


cluster_fixture = pytest.fixture(scope="module", name="cluster")(running_cluster)


# ---------------------------------------------------------------------- NATS with users
class AuthServer:
    """nats-server with the users `render_authorization(["a", "b"])` generates, and a
    coordinator connected as user `coordinator`."""

    def __init__(self) -> None:
        self.nodes = ["a", "b"]
        self.tmp = Path(tempfile.mkdtemp(prefix="zara-", dir="/tmp"))
        self.procs = Processes(self.tmp)
        (self.tmp / "auth.conf").write_text(permissions.render_authorization(self.nodes))
        (self.tmp / "server.conf").write_text(
            'listen: "127.0.0.1:-1"\ninclude ./auth.conf\n'
            'jetstream { store_dir: "' + str(self.tmp / "js") + '" }\n')
        self.passwords = {u.password_variable: f"z{os.urandom(12).hex()}"
                          for u in permissions.users(self.nodes)}
        self.server = NatsServer(self.tmp / "server.conf", self.procs,
                                 env=self.passwords).start()
        self.port = self.server.port

    def password(self, user: str) -> str:
        var = next(u.password_variable for u in permissions.users(self.nodes) if u.name == user)
        return self.passwords[var]

    def url(self, user: str) -> str:
        return f"nats://{user}:{self.password(user)}@127.0.0.1:{self.port}"

    @property
    def coord_log(self) -> str:
        return self.procs.text("coord")

    def start_coordinator(self) -> None:
        self.procs.spawn("coord", [
            *COORDINATOR, "run", "--nats-url", self.url("coordinator"),
            "--state-dir", str(self.tmp / "state"), "--dump-dir", str(self.tmp / "dump")],
            cwd=self.tmp)
        wait_for(lambda: "coordinator ready" in self.coord_log, 30, "the coordinator")

    def close(self) -> None:
        self.procs.close(grace_s=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    server = AuthServer()
    try:
        server.start_coordinator()
        yield server
    finally:
        server.close()


async def nats_as(server: AuthServer, user: str, role: str, node: str = "") -> tuple[Any, list]:
    import nats

    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(server.url(user), error_cb=on_error,
                            inbox_prefix=permissions.inbox(role, node).encode(),  # type: ignore[arg-type]
                            max_reconnect_attempts=0)
    return nc, errors


# ======================================================================= NATS credentials
async def test_coordinator_replies_cannot_be_reflected_onto_foreign_subjects(
    auth_server: AuthServer,
) -> None:
    """Node a's credentials may not publish on zeus.agent.ping nor on node b's subjects, but
    a query with that subject as its *reply* makes the coordinator (allow_responses) publish
    there for it: every agent re-announces on demand, and junk appears on node b's streams.
    The coordinator must answer only into the asker's own inbox prefix."""
    attacker, attacker_errors = await nats_as(auth_server, "agent-a", "agent", "a")
    spy_b, _ = await nats_as(auth_server, "agent-b", "agent", "b")
    spy_c, _ = await nats_as(auth_server, "coordinator", "coordinator")
    received: list[str] = []

    async def got(msg: Any) -> None:
        received.append(msg.subject)

    try:
        await spy_b.subscribe(subjects.agent_ping(), cb=got)
        await spy_c.subscribe(subjects.gpu_samples("b", 0), cb=got)
        await spy_b.flush()
        await spy_c.flush()
        await attacker.publish(subjects.agent_ping(), b"")  # refused, as it should be
        await attacker.flush()
        await asyncio.sleep(0.3)
        assert any("permissions violation" in e for e in attacker_errors), attacker_errors
        query = codec.encode(JobQuery())
        await attacker.publish(subjects.coord_job_query(), query, reply=subjects.agent_ping())
        await attacker.publish(subjects.coord_job_query(), query,
                               reply=subjects.gpu_samples("b", 0))
        await attacker.flush()
        await asyncio.sleep(1.0)
        assert received == [], (
            "node a's credentials made the coordinator publish on subjects they may not "
            f"publish on: {received}")
    finally:
        for nc in (attacker, spy_b, spy_c):
            await nc.close()


def test_coordinator_log_hides_its_nats_password(auth_server: AuthServer) -> None:
    """`coordinator ready on <url>` logs the URL with the password (journald keeps it)."""
    log = auth_server.coord_log
    assert "coordinator ready" in log
    assert auth_server.password("coordinator") not in log, [
        line for line in log.splitlines() if "ready" in line]


async def test_agent_cannot_subscribe_to_other_services_discovery(
    auth_server: AuthServer,
) -> None:
    """`$SRV.*` in an agent's subscribe allow-list also admits `$SRV.>`: node a then hears (and
    may answer) discovery requests for the coordinator's service."""
    nc, errors = await nats_as(auth_server, "agent-a", "agent", "a")
    try:
        await nc.subscribe("$SRV.>")
        await nc.flush()
        await asyncio.sleep(0.3)
        assert any("permissions violation" in e for e in errors), (
            "agent-a subscribed to $SRV.> (every service's discovery requests)")
    finally:
        await nc.close()


# ======================================================================= trainers vs nodes
def test_trainer_on_another_node_cannot_take_a_rank_of_a_job(cluster: SimCluster) -> None:
    """Any process on node a could list the jobs (QUERY_JOB) and register itself as a missing
    rank of a job running on node b: the legitimate rank was then refused (`duplicate`) and
    the coordinator commanded node b's GPUs on the intruder's measurements. Trainers cannot
    list jobs, and a rank joins only with the join token rank 0 got with the job id."""
    victim = Raw(cluster.socket_path("b"))
    intruder = Raw(cluster.socket_path("a"))
    try:
        listing = intruder.req(Kind.QUERY_JOB, {})
        assert (listing.ok, listing.code) == (False, "bad_request")  # trainers cannot list jobs
        job = {"job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 2,
                       "job_metadata": "victim"}}
        registered = victim.req(Kind.REGISTER_JOB, job).result
        job_id, token = registered["job_id"], registered["join_token"]
        assert victim.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0}).ok
        assert victim.req(Kind.REGISTER_RANK, rank_payload(job_id, 0, "b", 0, token)).ok
        assert intruder.req(Kind.HELLO, {"job_id": job_id, "rank": 1, "dp_rank": 1,
                                         "gpu_index": 0}).ok
        for guess in (None, "a-guessed-join-token-0000"):
            reply = intruder.req(Kind.REGISTER_RANK, rank_payload(job_id, 1, "a", 0, guess))
            assert (reply.ok, reply.code) == (False, "forbidden"), (
                "a trainer on node a joined node b's job as rank 1 with nothing but its id "
                f"(made from the clock): {reply}")
            assert "join token" in reply.error
        # The events of the intruder's bound pid are not the job's: rank 1 is still free, and
        # the job's own rank 1 (which has the token) takes it.
        assert victim.req(Kind.HELLO, {"job_id": job_id, "rank": 1, "dp_rank": 1,
                                       "gpu_index": 1, "join_token": token}).ok
        assert victim.req(Kind.REGISTER_RANK, rank_payload(job_id, 1, "b", 1, token)).ok
    finally:
        victim.close()
        intruder.close()
        bye_everywhere(cluster)


def _intrude_as_nobody(path: Path, job_id: str, rank: dict[str, Any]) -> list[Any]:
    """HELLO + REGISTER_RANK from a forked child running as `nobody`; returns both replies."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, speak, report through the pipe, exit
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            r = Raw(path)
            out = [r.req(Kind.HELLO, {"job_id": job_id, "rank": 1, "dp_rank": 1,
                                      "gpu_index": 0}).model_dump(),
                   r.req(Kind.REGISTER_RANK, rank).model_dump()]
            os.write(write, json.dumps(out).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(write, json.dumps({"error": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        data = json.loads(f.read() or "null")
    os.waitpid(pid, 0)
    assert isinstance(data, list), data
    return data


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the intruder as another user")
def test_another_users_trainer_cannot_take_a_rank_of_a_job(cluster: SimCluster) -> None:
    """The agents stamp the kernel's uid on registrations; a job's ranks must share the uid
    of the trainer that registered it. The intruder runs as `nobody` on another node."""
    victim = Raw(cluster.socket_path("b"))
    try:
        job = {"job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 2,
                       "job_metadata": "victim"}}
        registered = victim.req(Kind.REGISTER_JOB, job).result
        job_id, token = registered["job_id"], registered["join_token"]
        os.chmod(cluster.root, 0o755)  # let `nobody` reach node a's socket (mode 0666)
        # Even with the token (leaked, say), another user is refused.
        hello, registered = _intrude_as_nobody(cluster.socket_path("a"), job_id,
                                               rank_payload(job_id, 1, "a", 0, token))
        assert hello["ok"], hello
        assert (registered["ok"], registered["code"]) == (False, "forbidden"), registered
        assert "another user" in registered["error"]
        # The job's own user still registers its rank 1.
        assert victim.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0}).ok
        assert victim.req(Kind.REGISTER_RANK, rank_payload(job_id, 0, "b", 0, token)).ok
    finally:
        victim.close()
        bye_everywhere(cluster)


def test_gpu_of_a_departed_rank_is_not_throttled_again(cluster: SimCluster) -> None:
    """Rank 1 leaves (BYE; SIGKILL is the same) while rank 0 keeps profiling: the coordinator
    keeps commanding rank 1's GPU to each profiled limit under the job's lease, renewed for
    `--lease-idle-s` (15 min) after the job's last event. Both trainers are gone, yet the GPU
    stays throttled, and the next job on it inherits the limit."""
    r = Raw(cluster.socket_path("a"))
    job = {"job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 2},
           "power_limit": {"warmup_steps": 1, "profile_steps": 3, "pl_step_w": 100}}
    registered = r.req(Kind.REGISTER_JOB, job).result
    job_id, token = registered["job_id"], registered["join_token"]
    r.close()
    ranks = [spawn_rank(cluster, (job_id, token), 0, "a", 1, steps=14, bye_at=None),
             spawn_rank(cluster, (job_id, token), 1, "a", 2, steps=14, bye_at=3)]
    try:
        for p in ranks:
            line = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            assert line["hello"] and line["rank"], line
        for p in ranks:
            p.stdin.write(b"go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        for p in ranks:
            p.wait(20)
        time.sleep(1.0)
        limits = {gpu: cluster.gpu_limit("a", gpu) for gpu in (1, 2)}
        assert limits == {1: DEFAULT_W, 2: DEFAULT_W}, (
            f"both trainers of the job are gone, yet its GPUs are at {limits} W "
            f"(default {DEFAULT_W} W)")
    finally:
        for p in ranks:
            kill_group(p)


async def test_hello_flips_do_not_flood_the_bus(cluster: SimCluster) -> None:
    """Every HELLO that changes a GPU's binding makes the agent announce the whole node
    (NVML reads of every GPU, a publish, a reconcile on the coordinator): unthrottled."""
    nc = await connect(cluster.url, "adversarial-spy")
    hellos = 0

    async def count(msg: Any) -> None:
        nonlocal hellos
        hellos += 1

    r = Raw(cluster.socket_path("b"))
    try:
        await nc.subscribe(subjects.agent_hello("b"), cb=count)
        await nc.flush()
        await asyncio.sleep(0.2)
        hellos = 0
        r.s.setblocking(False)
        sent = 0
        for i in range(600):
            data = encode_request(Kind.HELLO, 0, i, {"job_id": f"flip{i % 2}", "rank": 0,
                                                      "gpu_index": 2})
            with contextlib.suppress(BlockingIOError):
                r.s.send(data)
                sent += 1
            r.drain()
            if i % 20 == 0:
                await asyncio.sleep(0.005)
        await asyncio.sleep(1.5)
        assert hellos <= 30, f"{sent} HELLO datagrams made the agent announce itself {hellos} times"
    finally:
        r.close()
        await nc.close()
        bye_everywhere(cluster)


async def test_window_requests_cannot_stall_the_agent(cluster: SimCluster) -> None:
    """A WINDOW request may name GPU 0 1024 times: 1024 energy reads each. Sixty such
    datagrams from any local process (no HELLO needed) stall the agent's commands, lease
    expiry and measurements for seconds."""
    nc = await connect(cluster.url, "adversarial-probe")
    info = codec.encode(CommandEnvelope(cmd=InfoCmd()))

    async def latency() -> float:
        t = time.monotonic()
        await nc.request(subjects.gpu_command("b", 0), info, timeout=30)
        return time.monotonic() - t

    r = Raw(cluster.socket_path("b"))
    try:
        assert await latency() < 0.5
        now = time.monotonic_ns()
        data = encode_request(Kind.WINDOW, 0, 1, {"t0_ns": now, "t1_ns": now, "gpus": [0] * 1024})
        r.s.settimeout(5)
        for _ in range(60):
            r.s.send(data)
        stalled = await latency()
        # let the backlog drain before the next test
        await wait_for_async(lambda: fast(latency), 20, interval_s=0.2, fail=False)
        assert stalled < 1.0, f"a GPU command took {stalled:.1f} s after 60 WINDOW datagrams"
    finally:
        r.close()
        await nc.close()


async def fast(latency: Callable[[], Awaitable[float]]) -> bool:
    """Whether the coordinator answers a query within 0.2 s again (its backlog drained)."""
    return await latency() <= 0.2

async def test_step_counter_jumps_cannot_stall_the_coordinator(cluster: SimCluster) -> None:
    """Rank 0 of one's own job, with `warmup_steps` unbounded, sends step_begin with the step
    counter jumping by 100 000: each event replays 100 000 steps on the coordinator's event
    loop. Fifteen 20-byte datagrams freeze every job's handling (and lease renewals)."""
    nc = await connect(cluster.url, "adversarial-probe")
    query = codec.encode(JobQuery())

    async def latency() -> float:
        t = time.monotonic()
        await nc.request(subjects.coord_job_query(), query, timeout=60)
        return time.monotonic() - t

    r = Raw(cluster.socket_path("a"))
    try:
        refused = {"job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1},
                   "power_limit": {"warmup_steps": 10**15, "profile_steps": 10**15}}
        assert r.req(Kind.REGISTER_JOB, refused).code == "bad_request"  # step counts bounded
        job = {"job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1},
               "power_limit": {"warmup_steps": 100_000, "profile_steps": 100_000}}
        registered = r.req(Kind.REGISTER_JOB, job).result
        job_id = registered["job_id"]
        assert r.req(Kind.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0}).ok
        assert r.req(Kind.REGISTER_RANK,
                     rank_payload(job_id, 0, "a", 0, registered["join_token"])).ok
        await asyncio.sleep(1.0)  # the optimiser starts
        assert await latency() < 0.5
        for k in range(1, 16):
            r.event(Kind.STEP_BEGIN, k * 100_000)
        await asyncio.sleep(0.3)
        stalled = await latency()
        await wait_for_async(lambda: fast(latency), 30, interval_s=0.2, fail=False)  # drained
        assert stalled < 1.0, f"the coordinator answered a query after {stalled:.1f} s"
    finally:
        r.close()
        await nc.close()
        bye_everywhere(cluster)


# ======================================================================= GPU settings
class FlakyResetGPU(SimGPU):
    """A simulated GPU whose power-limit reset fails `failures` times (a transient NVML
    error, or a call that timed out behind a queue of reads)."""

    failures = 0

    def reset_power_limit(self) -> None:
        if self.failures:
            self.failures -= 1
            raise GPUUnavailableError("reset_power_limit did not return within 2 s")
        super().reset_power_limit()


async def _noop_publish(subject: str, payload: bytes) -> None:
    return None


async def test_lapsed_lease_whose_restore_failed_is_retried(tmp_path: Path) -> None:
    """`expire_leases` removes the lease, then restores; when that restore fails once, nothing
    ever tries again: the GPU keeps a non-default limit with no lease at all."""
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = FlakyResetGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", _noop_publish)
    try:
        await agent.start()
        await agent.set_power_limit(150, "job", 0.2)
        gpu.failures = 1
        await asyncio.sleep(0.25)
        for _ in range(10):  # the agent's expiry loop, one second of ticks
            await agent.expire_leases()
            await asyncio.sleep(0.1)
        assert gpu.get_power_limit_w() == DEFAULT_W, (
            f"the lease lapsed and one restore failed: the GPU stays at "
            f"{gpu.get_power_limit_w()} W with leases {agent.leases.held()}")
    finally:
        agent.caller.close()


class SlowSetGPU(SimGPU):
    """A GPU whose driver takes longer than the caller's timeout to set a limit, then does."""

    calls_block = True
    delay_s = 0.0

    def set_power_limit_w(self, power_limit_w: int) -> None:
        time.sleep(self.delay_s)
        super().set_power_limit_w(power_limit_w)


async def test_timed_out_power_limit_is_still_leased(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A set that times out (GPUUnavailableError) is rolled back in the lease table, but the
    call keeps running in its thread and applies the limit: a setting with no lease, not in
    `_changed`, never restored (not even at agent shutdown)."""
    monkeypatch.setitem(GPUCaller.call.__kwdefaults__, "timeout_s", 0.3)
    SimGPU.create(tmp_path, 0, preset="A40")
    gpu = SlowSetGPU.open(tmp_path, 0)
    agent = GpuAgent(gpu, "n", _noop_publish)
    try:
        await agent.start()
        gpu.delay_s = 0.6
        with pytest.raises(GPUError):
            await agent.set_power_limit(150, "job", 0.5)
        await asyncio.sleep(0.7)
        for _ in range(5):
            await agent.expire_leases()
            await asyncio.sleep(0.1)
        await agent.restore(reason="agent shutting down")
        assert gpu.get_power_limit_w() == DEFAULT_W, (
            f"the GPU is at {gpu.get_power_limit_w()} W with no lease "
            f"({agent.leases.held()}) and nothing left to restore ({agent._changed})")
    finally:
        agent.caller.close()


# ======================================================================= unlucky operators
def test_socket_path_never_deletes_a_regular_file(cluster: SimCluster) -> None:
    """`--socket-path` naming an existing regular file: the agent (root) deletes it."""
    tmp = Path(tempfile.mkdtemp(prefix="zarf-", dir="/tmp"))
    precious = tmp / "precious.db"
    precious.write_text("operator data\n")
    procs = Processes(tmp)
    proc = procs.spawn("agent", [
        *AGENT, "run", "--nats-url", cluster.url, "--node", "zf", "--backend", "sim",
        "--sim-state-dir", str(tmp / "sim"), "--socket-path", str(precious)])
    try:
        def settled() -> bool:
            if proc.poll() is not None:
                return True
            return not precious.exists() or stat.S_ISSOCK(precious.lstat().st_mode)
        with contextlib.suppress(AssertionError):
            wait_for(settled, 15, "the agent to start or refuse")
        assert precious.exists() and stat.S_ISREG(precious.lstat().st_mode), (
            "the agent replaced a regular file at its --socket-path")
        assert precious.read_text() == "operator data\n"
    finally:
        procs.close(grace_s=10)
        shutil.rmtree(tmp, ignore_errors=True)


def test_stopping_agent_does_not_remove_a_newer_agents_socket(cluster: SimCluster) -> None:
    """A second agent on the same socket path silently takes it over; when the first one then
    stops, it unlinks the path: the running agent can no longer be reached by any trainer."""
    tmp = Path(tempfile.mkdtemp(prefix="zars-", dir="/tmp"))
    sock = tmp / "agent.sock"
    procs = Processes(tmp)

    def agent(node: str) -> subprocess.Popen[bytes]:
        return procs.spawn(node, [
            *AGENT, "run", "--nats-url", cluster.url, "--node", node, "--backend", "sim",
            "--sim-state-dir", str(tmp / f"sim-{node}"), "--socket-path", str(sock),
            "--sample-hz", "5"])

    def started(node: str) -> bool:
        return "GPU(s)" in procs.text(node)

    try:
        first = agent("z1")
        wait_for(lambda: started("z1"), 20, "the first agent")
        second = agent("z2")
        wait_for(lambda: started("z2") or second.poll() is not None, 20, "the second agent")
        first.send_signal(signal.SIGTERM)
        first.wait(15)
        if second.poll() is None:
            assert sock.exists(), (
                "the first agent's shutdown removed the socket of the agent still running")
    finally:
        procs.close(grace_s=10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("content", ["null", "[]", '{"jobs": [], "power_limit_windows": []}'])
def test_wrong_shaped_state_file_is_not_a_traceback(content: str) -> None:
    """A jobs.json that is JSON but not the expected shape crashes the start with a traceback
    (exit 1), instead of being moved aside like a corrupt one."""
    tmp = Path(tempfile.mkdtemp(prefix="zarj-", dir="/tmp"))
    try:
        (tmp / "state").mkdir()
        (tmp / "state" / "jobs.json").write_text(content)
        done = subprocess.run(
            [*COORDINATOR, "run", "--state-dir", str(tmp / "state"), "--dump-dir",
             str(tmp / "dump"), "--nats-url", "nats://127.0.0.1:1", "--connect-timeout-s", "1",
             "--log-level", "CRITICAL"],
            cwd=tmp, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert "Traceback" not in done.stderr, done.stderr[-600:]
        assert done.returncode in (2, 3), (done.returncode, done.stderr[-300:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_tiny_lease_is_refused_or_the_coordinator_still_stops(cluster: SimCluster) -> None:
    """`--lease-s 1e-9` is accepted (gt=0): the renewal loop never yields, the coordinator
    spins a core and ignores SIGTERM (the same holds for the agent's --heartbeat-s and
    --publish-interval-s)."""
    tmp = Path(tempfile.mkdtemp(prefix="zarl-", dir="/tmp"))
    procs = Processes(tmp)
    proc = procs.spawn("coord", [
        *COORDINATOR, "run", "--nats-url", cluster.url, "--lease-s", "1e-9",
        "--state-dir", str(tmp / "state"), "--dump-dir", str(tmp / "dump"),
        "--prefix", "zeustiny"], cwd=tmp)
    try:
        wait_for(lambda: proc.poll() is not None or "coordinator ready" in procs.text("coord"),
                 20, "the coordinator to start or refuse")
        if proc.poll() is None:
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(4)
        assert proc.poll() is not None, "the coordinator ignored SIGTERM for 4 s"
    finally:
        procs.close()
        shutil.rmtree(tmp, ignore_errors=True)


# ======================================================================= payloads
def test_job_ids_carry_no_control_characters() -> None:
    """`job_metadata` and `scheduler` are free text: the job id they make is logged and
    printed by `zeus-coordinator watch` verbatim (forged log lines, terminal escapes)."""
    from coordinator.jobs import JobRegistry

    try:
        request = RegisterJob(
            job=JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1,
                        job_metadata="x\n2026-01-01 00:00:00,000 ERROR coordinator: forged"),
            scheduler="S\x1b[2J")
    except ValueError:
        return  # refused: fine
    job_id = JobRegistry().register_job(request, 0.0, "a").job_id
    assert job_id.isprintable(), repr(job_id)


def test_a_map_of_unknown_keys_is_refused_cheaply() -> None:
    """An 800 KB map of 80 000 unknown keys (under NATS's 1 MB) costs ~0.3 s of the
    coordinator's loop to refuse (every extra field becomes a pydantic error): thirty of them
    from an observer's or any agent's credentials stall it ~8 s."""
    big = msgpack.packb({"v": 1, **{f"k{i}": i for i in range(80_000)}})
    # Refused by its shape, before pydantic builds 80,000 errors (no timing in a unit test).
    with pytest.raises(PayloadError, match="80001 fields; no message has more than"):
        codec.decode(big, JobQuery)
