"""The Perseus drop-in (`zeus_agent.integrations.perseus`): Zeus 0.16's errors and callbacks.

A fake publisher stands in for `zeus_agent.emit.Publisher` (its schedule API: `latest_schedule`,
`next_step`); `emit.init` is replaced to capture the registration arguments. The last tests run
the simulated pipeline trainer (`zeus_agent.gpu.sim.trainers.pipeline`, whose ranks use the
drop-in) as real processes against two real agents on simulated GPUs and a coordinator on a
real nats-server: its command line, a failing rank stopping the job, and clear failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from zeus_agent import emit
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.sim import create_sim_gpus
from zeus_agent.gpu.sim.trainers.pipeline import (
    NodeSpec,
    PipelineError,
    PipelineOptions,
    RankPlacement,
    place_ranks,
    run_pipeline,
)
from zeus_agent.integrations import perseus
from zeus_agent.integrations.perseus import (
    PerseusOptimizer,
    PipelineFrequencyOptimizer,
    socket_path_from_url,
)
from zeus_agent.wire.trainer import ScheduleNotice


def Notice(  # noqa: N802 - reads like the model it builds
    job_id: str, rank: int, version: int, from_step: int, frequencies: Any
) -> ScheduleNotice:
    return ScheduleNotice(
        job_id=job_id, rank=rank, version=version, from_step=from_step, frequencies=frequencies
    )


@dataclass
class FakePublisher:
    job_id: str | None = "job-1"
    join_token: str | None = "fake-join-token-0123"
    notices: list[ScheduleNotice] = field(default_factory=list)
    events: list[tuple[str, Any]] = field(default_factory=list)
    step: int = -1
    polls: int = 0

    @property
    def next_step(self) -> int:
        return self.step + 1

    def latest_schedule(self) -> ScheduleNotice | None:
        self.polls += 1
        return self.notices[-1] if self.notices else None

    def step_begin(self) -> None:
        self.step += 1
        self.events.append(("step_begin", self.step))

    def step_end(self) -> None:
        self.events.append(("step_end", self.step))

    def instruction_begin(self, name: str) -> None:
        self.events.append(("instruction_begin", name))

    def instruction_end(self, name: str) -> None:
        self.events.append(("instruction_end", name))

    def close(self) -> None:
        self.events.append(("close", None))


SCHEDULE = [("forward", 1740), ("forward", 1500), ("backward", 1740), ("backward", 1410)]
ORDER = [name for name, _ in SCHEDULE]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace `emit.init` with one returning a `FakePublisher`; record its arguments."""
    box: dict[str, Any] = {"publisher": FakePublisher()}

    def fake_init(**kwargs: Any) -> FakePublisher:
        box["kwargs"] = kwargs
        return box["publisher"]

    monkeypatch.setattr(emit, "init", fake_init)
    monkeypatch.setattr(perseus, "_warned_http", False)
    return box


def make(rank: int = 0, url: str = "unix:///tmp/agent.sock", **kw: Any) -> PerseusOptimizer:
    return PerseusOptimizer(
        rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, device_id=rank, dp_degree=1,
        pp_degree=2, tp_degree=1, world_size=2, server_url=url, **kw,
    )


def run_iteration(opt: PerseusOptimizer, names: list[str]) -> None:
    opt.on_step_begin()
    for name in names:
        opt.on_instruction_begin(name)
        opt.on_instruction_end(name)
    opt.on_step_end()


def activate(fake: dict[str, Any], opt: PerseusOptimizer, from_step: int = 0) -> None:
    fake["publisher"].notices.append(Notice("job-1", opt.rank, 1, from_step, SCHEDULE))


def test_registration_arguments(fake: dict[str, Any]) -> None:
    opt = make(rank=1, job_id="job-1", job_metadata="meta", sync_cuda=False)
    kw = fake["kwargs"]
    assert kw["job_id"] == "job-1"
    assert kw["rank"] == 1 and kw["pp_rank"] == 1 and kw["gpu_index"] == 1
    assert kw["socket_path"] == "/tmp/agent.sock"
    assert kw["sync_cuda"] is False
    assert "power_limit" not in kw  # a pipeline-frequency job
    info = kw["job_info"]
    assert (info.pp_degree, info.dp_degree, info.tp_degree, info.world_size) == (2, 1, 1, 2)
    assert info.job_metadata == "meta"
    assert opt.job_id == "job-1"
    assert PipelineFrequencyOptimizer is PerseusOptimizer


def test_sync_cuda_defaults_off_without_torch_cuda(fake: dict[str, Any]) -> None:
    make()
    import sys

    torch = sys.modules.get("torch")
    initialised = bool(torch and torch.cuda.is_available() and torch.cuda.is_initialized())
    assert fake["kwargs"]["sync_cuda"] is initialised


def test_bad_degrees_raise(fake: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="world_size"):
        PerseusOptimizer(0, 0, 0, 0, 0, 2, 2, 1, 3, "unix:///tmp/a.sock")


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("unix:///run/zeus-agent/agent.sock", "/run/zeus-agent/agent.sock"),
        ("UNIX:///tmp/a%20b.sock", "/tmp/a b.sock"),
        ("unix://agent.sock", "agent.sock"),
        ("http://127.0.0.1:7787", None),
        ("https://perseus.example:443/", None),
        ("localhost:7787", None),
    ],
)
def test_unix_url_parsing(url: str, path: str | None) -> None:
    assert socket_path_from_url(url) == path


def test_unix_url_without_path_is_refused() -> None:
    with pytest.raises(ValueError, match="names no socket path"):
        socket_path_from_url("unix://")


def test_conflicting_socket_path_and_url(fake: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="different"):
        make(socket_path="/tmp/other.sock")
    make(socket_path="/tmp/agent.sock")  # the same socket: fine
    assert fake["kwargs"]["socket_path"] == "/tmp/agent.sock"


def test_http_url_warns_once_and_uses_the_default_socket(
    fake: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="zeus_agent.integrations.perseus"):
        make(url="http://127.0.0.1:7787")
        make(url="http://127.0.0.1:7787")
        make(url="http://other:1")
    warnings = [r for r in caplog.records if "server_url" in r.getMessage()]
    assert len(warnings) == 1
    assert "http://127.0.0.1:7787" in warnings[0].getMessage()
    assert fake["kwargs"]["socket_path"] is None  # emit's default: env, else the default path
    make(url="http://x", socket_path="/tmp/explicit.sock")
    assert fake["kwargs"]["socket_path"] == "/tmp/explicit.sock"


def test_no_checks_before_a_schedule(fake: dict[str, Any]) -> None:
    opt = make()
    run_iteration(opt, ["forward", "backward", "anything"])
    run_iteration(opt, [])
    assert opt.schedule == [] and opt.schedule_version is None
    events = fake["publisher"].events
    assert events[:4] == [
        ("step_begin", 0), ("instruction_begin", "forward"), ("instruction_end", "forward"),
        ("instruction_begin", "backward"),
    ]
    assert events[-2:] == [("step_begin", 1), ("step_end", 1)]


def test_activation_at_from_step(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt, from_step=2)
    run_iteration(opt, ["other"])  # step 0: pending, not active
    assert opt.schedule_version is None
    run_iteration(opt, ["other", "names"])  # step 1
    assert opt.schedule_version is None
    run_iteration(opt, ORDER)  # step 2: active from its step_begin
    assert opt.schedule == SCHEDULE and opt.schedule_version == 1
    assert opt.frequency == 1410  # the last instruction's
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    assert opt.frequency == 1740
    opt.on_instruction_end("forward")
    opt.on_instruction_begin("forward")
    assert opt.frequency == 1500
    for name in ORDER[2:]:
        opt.on_instruction_begin(name)
    opt.on_step_end()
    run_iteration(opt, ORDER)
    with pytest.raises(RuntimeError):
        run_iteration(opt, ["other"])


def test_late_notice_activates_at_the_next_step(fake: dict[str, Any]) -> None:
    opt = make()
    run_iteration(opt, ["x"])
    run_iteration(opt, ["x"])
    activate(fake, opt, from_step=1)  # already past: the next step_begin activates it
    run_iteration(opt, ORDER)
    assert opt.schedule_version == 1


def test_activation_checked_before_the_event(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt, from_step=1)
    opt.on_step_begin()  # carries step 0: not yet
    assert opt.schedule_version is None
    opt.on_step_end()
    opt.on_step_begin()  # carries step 1
    assert opt.schedule_version == 1
    assert fake["publisher"].events[-1] == ("step_begin", 1)


def test_newer_version_replaces_the_schedule(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    run_iteration(opt, ORDER)
    new = [("forward", 1200), ("backward", 1200)]
    fake["publisher"].notices.append(Notice("job-1", 0, 2, 3, new))
    run_iteration(opt, ORDER)  # step 1
    run_iteration(opt, ORDER)  # step 2
    run_iteration(opt, ["forward", "backward"])  # step 3: version 2
    assert opt.schedule == new and opt.schedule_version == 2
    # An older or equal version is ignored.
    fake["publisher"].notices.append(Notice("job-1", 0, 2, 0, SCHEDULE))
    run_iteration(opt, ["forward", "backward"])
    assert opt.schedule == new


def test_schedule_for_another_rank(fake: dict[str, Any]) -> None:
    opt = make(rank=1, job_id="job-1")
    fake["publisher"].notices.append(Notice("job-1", 0, 1, 0, SCHEDULE))
    with pytest.raises(RuntimeError, match="for rank 0 to rank 1"):
        opt.on_step_begin()


def test_fewer_frequencies_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    for name in ORDER:
        opt.on_instruction_begin(name)
        opt.on_instruction_end(name)
    with pytest.raises(RuntimeError) as info:
        opt.on_instruction_begin("forward")
    assert str(info.value) == "Perseus server returned fewer frequencies than expected"


def test_wrong_name_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    with pytest.raises(RuntimeError) as info:
        opt.on_instruction_begin("backward")  # the schedule says forward
    assert str(info.value) == "The next expected instruction is not forward: forward"
    # Zeus's text says "forward" whatever the instruction; it names the expected one.
    opt2 = make()
    fake["publisher"].notices[-1] = Notice("job-1", 0, 5, 0, [("backward", 1000)])
    opt2.on_step_begin()
    with pytest.raises(RuntimeError) as info:
        opt2.on_instruction_begin("forward")
    assert str(info.value) == "The next expected instruction is not forward: backward"
    # A refused instruction is not emitted.
    assert fake["publisher"].events.count(("instruction_begin", "backward")) == 0


def test_more_frequencies_error_is_zeus(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    opt.on_step_begin()
    opt.on_instruction_begin("forward")
    opt.on_instruction_end("forward")
    with pytest.raises(RuntimeError) as info:
        opt.on_step_end()
    assert str(info.value) == (
        "Perseus server returned more frequencies than expected. "
        "Next expected instruction and frequency is ('forward', 1500)"
    )


def test_events_and_polls(fake: dict[str, Any]) -> None:
    opt = make()
    activate(fake, opt)
    run_iteration(opt, ORDER)
    pub = fake["publisher"]
    assert pub.polls == 1  # one non-blocking poll per step_begin, none on the hot path
    assert [e[0] for e in pub.events] == (
        ["step_begin"] + ["instruction_begin", "instruction_end"] * 4 + ["step_end"]
    )
    opt.close()
    assert pub.events[-1] == ("close", None)


def test_unreachable_coordinator_only_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(**kw: Any) -> Any:
        raise emit.RegistrationError("job", "unavailable", "no coordinator")

    monkeypatch.setattr(emit, "init", refuse)
    monkeypatch.setattr(emit, "get_publisher", lambda: FakePublisher(job_id=None))
    with caplog.at_level(logging.WARNING):
        opt = make()
    assert opt.job_id is None
    assert "unreachable" in caplog.text

    def forbid(**kw: Any) -> Any:
        raise emit.RegistrationError("job", "forbidden", "no")

    monkeypatch.setattr(emit, "init", forbid)
    with pytest.raises(emit.RegistrationError):
        make()


# ---------------------------------------------------------------------- real processes
# The simulated pipeline trainer against real agents (two nodes) and a coordinator on a real
# nats-server; its command line in a subprocess, as a user would run it.

NODES = ("pa", "pb")
TRAINER = [sys.executable, "-m", "zeus_agent.gpu.sim.trainers.pipeline"]


@contextlib.asynccontextmanager
async def cluster(url: str) -> AsyncIterator[Path]:
    """Two agents (2 sim A40s each) and a coordinator; yields the directory of their files."""
    root = Path(tempfile.mkdtemp(prefix="pp-", dir="/tmp"))  # short AF_UNIX paths
    agents = []
    for node in NODES:
        settings = AgentSettings(
            nats_url=url, backend="sim", sim_count=2, sim_preset="A40",
            sim_state_dir=str(root / node), socket_path=str(root / f"{node}.sock"), node=node,
            sample_hz=20,
        )
        server = AgentServer(settings)
        agents.append((server, asyncio.create_task(server.serve())))
    coord = CoordinatorService(
        CoordinatorSettings(
            nats_url=url, state_dir=str(root / "coord"), dump_dir=str(root / "dump")
        )
    )
    coord_task = asyncio.create_task(coord.serve())
    try:
        for server, _ in agents:
            await asyncio.wait_for(server.started.wait(), 10)
        await asyncio.wait_for(coord.started.wait(), 10)
        yield root
    finally:
        for server, _ in agents:
            server.handle_exit()
        coord.should_exit.set()
        await asyncio.gather(coord_task, *(t for _, t in agents), return_exceptions=True)
        shutil.rmtree(root, ignore_errors=True)


def node_args(root: Path) -> list[str]:
    return [arg for n in NODES for arg in ("--node", f"{n}:{root}/{n}.sock:{root}/{n}:0,1")]


async def run_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *TRAINER, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_pipeline_trainer_cli_on_two_agents(nats_server: Any, tmp_path: Path) -> None:
    output = tmp_path / "result.json"
    async with cluster(nats_server.url) as root:
        code, log = await run_cli(
            "--profile", "synthetic", "--stages", "2", "--dp", "2", "--microbatches", "3",
            "--iterations", "6", "--time-scale", "0.02", "--straggler", "1:1.5",
            "--output", str(output), *node_args(root),
        )
    assert code == 0, log
    assert "iteration 6/6" in log and "mean" in log
    result = json.loads(output.read_text())
    assert "+dp2+pp2+tp1+" in result["job_id"]
    assert result["job_id"].endswith("+simulated-pipeline")
    assert result["iterations"] == 6
    ranks = result["ranks"]
    assert [(r["rank"], r["pp_rank"], r["dp_rank"], r["node"], r["gpu_index"]) for r in ranks] == [
        (0, 0, 0, "pa", 0), (1, 0, 1, "pa", 1), (2, 1, 0, "pb", 0), (3, 1, 1, "pb", 1)
    ]
    for r in ranks:
        assert len(r["iteration_time_s"]) == 6 and len(r["clocks_mhz"]) == 6
        assert all(len(clocks) == 6 for clocks in r["clocks_mhz"])  # 2 x 3 microbatches
        assert r["dropped_events"] == 0
    # The straggler replica (dp 1) did more work per iteration than replica 0 (x1.5 energy).
    assert ranks[1]["work_energy_j"][0] > 1.3 * ranks[0]["work_energy_j"][0]


async def test_the_launcher_can_stop_every_rank_at_one_iteration(nats_server: Any) -> None:
    """`on_iteration` saying enough stops the job early, every rank after the same iteration."""
    async with cluster(nats_server.url) as root:
        nodes = [NodeSpec(n, f"{root}/{n}.sock", f"{root}/{n}", (0, 1)) for n in NODES]
        places = place_ranks(nodes, 2, 2)
        options = PipelineOptions(stages=2, dp=2, microbatches=2, iterations=200,
                                  time_scale=0.02, ipc_timeout_s=30)
        seen: list[int] = []

        def enough_at_4(count: int, elapsed: float) -> bool:
            seen.append(count)
            return count >= 4

        result = await asyncio.to_thread(run_pipeline, places, options, enough_at_4, 60)
    # Rank 0 learns it at an iteration's end a little later (the launcher polls its queue):
    # the job stops there, well before 200.
    assert 4 <= result.iterations < 50, result.iterations
    assert {len(r.iteration_time_s) for r in result.ranks} == {result.iterations}
    assert seen == list(range(1, result.iterations + 1))
    assert multiprocessing.active_children() == []


async def test_a_failing_rank_stops_the_job(nats_server: Any) -> None:
    async with cluster(nats_server.url) as root:
        nodes = [NodeSpec(n, f"{root}/{n}.sock", f"{root}/{n}", (0, 1)) for n in NODES]
        places = place_ranks(nodes, 2, 2)
        # Rank 3's GPU does not exist: it fails at start while its peers wait for it.
        bad = RankPlacement(**{**places[3].__dict__, "gpu_index": 7})
        options = PipelineOptions(stages=2, dp=2, microbatches=2, iterations=50,
                                  time_scale=0.02, ipc_timeout_s=30)
        with pytest.raises(PipelineError) as info:
            await asyncio.to_thread(run_pipeline, [*places[:3], bad], options, None, 60)
    message = str(info.value)
    assert message.startswith("rank 3 (dp 1, stage 1, node pb GPU 7) failed: "), message
    assert "GPUUnavailableError" in message  # the root cause, not a peer's broken barrier
    assert multiprocessing.active_children() == []  # its peers were stopped


async def test_cli_without_an_agent_fails_clearly(tmp_path: Path) -> None:
    create_sim_gpus(tmp_path / "sim", 2)
    code, log = await run_cli(
        "--profile", "synthetic", "--stages", "2", "--iterations", "2",
        "--socket", str(tmp_path / "none.sock"), "--sim-dir", str(tmp_path / "sim"),
        "--ipc-timeout", "20",
    )
    assert code == 1, log
    assert "rank 0 (dp 0, stage 0, node local GPU 0) failed: RuntimeError: the job could not " \
        "be registered" in log
    code, log = await run_cli("--stages", "2", "--socket", "/tmp/x.sock",
                              "--sim-dir", str(tmp_path / "missing"))
    assert code == 1 and "cannot open simulated GPU 0" in log, log
    code, log = await run_cli("--stages", "3", "--socket", "/tmp/x.sock",
                              "--sim-dir", str(tmp_path / "sim"), "--gpus", "0,1")
    assert code == 2 and "need 3 GPUs" in log, log
