"""Straggler notices over NATS: the coordinator's `<p>.coord.jobs.straggler` endpoint against a
real nats-server and a simulated-GPU agent (coded refusals, a notice that reaches the GPUs'
schedules), and `zeus-coordinator straggler` as a subprocess."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from coordinator.service import CoordinatorService
from tests.shell.coordinator_kit import JOIN_TOKENS, NODE, ask, gpu_info, register_job, start, stop
from tests.shell.pipeline_kit import serve_two_pipelines
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.models import FrequencySchedule, ProfilingResult, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    PowerLimitOptions,
    RegisterRank,
    StragglerNotice,
)
from zeus_demo.cluster import wait_for_async

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def agent(nats_server, tmp_path_factory) -> AsyncIterator[AgentServer]:
    """One agent with two simulated A40s on node `NODE`."""
    tmp = tmp_path_factory.mktemp("agent")
    server = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=0, sim_state_dir=str(tmp / "gpus"),
        socket_path=str(tmp / "agent.sock"), node=NODE, sample_hz=20,
    ))
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.started.wait(), 10)
    yield server
    server.handle_exit()
    await task


@pytest.fixture
async def coord(nats_server, agent, tmp_path) -> AsyncIterator[CoordinatorService]:
    coord, task = await start(nats_server, tmp_path / "coord", dump_data=False)
    yield coord
    await stop(coord, task)


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[tuple[tuple[str, int], ...], ...]


FRONTIER = [Point(1.0, 100.0, ((("forward", 1740), ("backward", 1740)),)),
            Point(2.0, 50.0, ((("forward", 210), ("backward", 210)),))]


class Served(FrequencyScheduler):
    """Serves FRONTIER[0] from the start and keeps watching (a Perseus that has planned)."""

    frontier = FRONTIER
    chosen = FRONTIER[0]
    serving = True

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        while True:
            yield [FrequencySchedule(rank=i.rank, frequencies=list(FRONTIER[0].plan[0]))
                   for i in self.rank_infos]


def rank_request(job_id: str, rank: int) -> RegisterRank:
    return RegisterRank(job_id=job_id, join_token=JOIN_TOKENS.get(job_id), rank_info=RankInfo(
        rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0, available_frequencies=[1740, 210]),
        gpu=GpuBinding(node=NODE, gpu_index=rank))


async def pipeline_job(nc: Any, coord: CoordinatorService, ranks: int = 2) -> str:
    job_id = await register_job(nc, dp=2)
    for rank in range(ranks):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, rank))).ok
    if ranks == 2:
        await wait_for_async(lambda: isinstance(coord.optimisers.get(job_id), PipelineJob), 5,
                             fail=False)  # (100 x 0.05 s before)
        assert isinstance(coord.optimisers.get(job_id), PipelineJob)
    return job_id


def serve_plan(coord: CoordinatorService, job_id: str) -> PipelineJob:
    """Put the job in front of a served plan with a frontier (as Perseus gets there)."""
    return serve_two_pipelines(coord, job_id, lambda ji, ri: Served(ji, ri, None))


def notice(job_id: str, pipeline: int = 1, factor: float | None = 2.5) -> StragglerNotice:
    return StragglerNotice(job_id=job_id, pipeline=pipeline, factor=factor,
                           clear=factor is None)


async def test_a_notice_slows_the_other_pipeline_on_its_gpu_and_clears(nc, coord) -> None:
    job_id = await pipeline_job(nc, coord)
    job = serve_plan(coord, job_id)
    subject = subjects.coord_job_straggler()
    reply = await ask(nc, subject, notice(job_id))
    assert reply.ok, reply
    assert reply.result["stragglers"] == {"1": 2.5} and reply.result["slowed"] == {"0": 2.0}
    assert "pipeline 1 is a straggler" in reply.result["message"]
    assert job.schedules[0].frequencies == [("forward", 210), ("backward", 210)]
    assert job.schedules[1].frequencies == [("forward", 1740), ("backward", 1740)]
    for gpu in (0, 1):  # The agent has the new version (waiting for its step).
        assert (await gpu_info(nc, gpu))["gpu"]["schedule_version"] == job.version
    reply = await ask(nc, subject, notice(job_id, factor=None))
    assert reply.ok and reply.result["stragglers"] == {} and reply.result["slowed"] == {}
    assert job.schedules[0].frequencies == [("forward", 1740), ("backward", 1740)]


async def test_refusals_are_coded(nc, coord) -> None:
    subject = subjects.coord_job_straggler()
    reply = await ask(nc, subject, notice("no-such-job"))
    assert (reply.ok, reply.code) == (False, "unknown_job")
    power = await register_job(nc, dp=1, power_limit=PowerLimitOptions())
    reply = await ask(nc, subject, notice(power, pipeline=0))
    assert (reply.ok, reply.code) == (False, "not_supported")
    waiting = await pipeline_job(nc, coord, ranks=1)
    reply = await ask(nc, subject, notice(waiting))
    assert (reply.ok, reply.code) == (False, "unavailable")
    job_id = await pipeline_job(nc, coord)
    reply = await ask(nc, subject, notice(job_id, pipeline=2))
    assert (reply.ok, reply.code) == (False, "out_of_range") and "0..1" in reply.error
    reply = await ask(nc, subject, notice(job_id))  # Noted while the job discovers.
    assert reply.ok and "applied once a plan is served" in reply.result["message"]
    for payload in ({"v": 1, "job_id": job_id, "pipeline": 0, "factor": 0.5},
                    {"v": 1, "job_id": job_id, "pipeline": 0},
                    {"v": 1, "job_id": job_id, "pipeline": -1, "factor": 1.5},
                    {"v": 1, "job_id": job_id, "pipeline": 0, "factor": 1.2, "clear": True}):
        reply = await ask(nc, subject, codec.encode(payload))  # What a foreign client may send.
        assert (reply.ok, reply.code) == (False, "bad_request"), payload


# ------------------------------------------------------------------ the command line


async def cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator.cli", "straggler", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_the_command_line(nats_server, nc, coord) -> None:
    job_id = await pipeline_job(nc, coord)
    job = serve_plan(coord, job_id)
    url = ["--nats-url", nats_server.url]
    code, out = await cli(job_id, "--pipeline", "1", "--factor", "2.5", *url)
    assert code == 0, out
    assert "pipeline 1 is a straggler" in out and '"stragglers": {"1": 2.5}' in out
    assert job.notices == {1: 2.5}
    code, out = await cli(job_id, "--pipeline", "1", "--clear", *url)
    assert code == 0 and job.notices == {}, out
    code, out = await cli(job_id, "--pipeline", "7", "--factor", "1.5", *url)
    assert code == 1 and "refused (out_of_range)" in out, out
    code, out = await cli("nope", "--pipeline", "0", "--factor", "1.5", *url)
    assert code == 1 and "unknown_job" in out, out


async def test_the_command_line_help_and_usage() -> None:
    code, out = await cli("--help")
    assert code == 0 and "--factor F" in out and "--clear" in out and "all-reduce" in out
    code, out = await cli("j", "--pipeline", "0", "--factor", "1.5", "--clear")
    assert code == 2 and "not allowed with" in out
    code, out = await cli("j", "--pipeline", "0", "--factor", "0.5")
    assert code == 2 and "greater than or equal to 1" in out
    code, out = await cli("j", "--pipeline", "0", "--factor", "1.5", "--nats-url",
                          "nats://127.0.0.1:1", "--timeout", "1")
    assert code in (1, 3) and "straggler" in out
