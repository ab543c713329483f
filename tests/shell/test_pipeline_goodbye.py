"""What the coordinator keeps of a pipeline job's measurements, with a real nats-server, an agent
on simulated GPUs and a trainer speaking raw datagrams: let go when the trainer says goodbye,
and capped (`too_large`).

Before, a BYE reached no one but the agent: the job stayed "discovering" and kept every
iteration it had seen (RSS 103 -> 197 MB over three jobs whose ranks sent new names).
"""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.job import MAX_DISCOVERY_CHANGES, PipelineJob
from coordinator.service import CoordinatorService
from tests.shell.agent_kit import RawTrainer, wait_for
from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    collect,
    rank_request,
    register_job,
    start,
    stop,
)
from zeus_agent.agent.server import AgentServer
from zeus_agent.wire import subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import JobStatus

K = dg.Kind



async def _coordinator(nats_server: Any, tmp_path: Any, **kw: Any) -> Any:
    return await start(nats_server, tmp_path / "coord", dump_data=False, **kw)




async def _one_rank_job(nc: Any, coord: CoordinatorService, agent: AgentServer
                        ) -> tuple[str, PipelineJob, RawTrainer, list[JobStatus]]:
    """A 1-rank pipeline job on GPU 0, its trainer bound (with the join token)."""
    job_id = await register_job(nc, dp=1)
    statuses = await collect(nc, subjects.job_status(job_id), JobStatus)
    assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))).ok
    await wait_for(lambda: isinstance(coord.optimisers.get(job_id), PipelineJob), 10,
                   "the pipeline optimiser")
    job = coord.optimisers[job_id]
    assert isinstance(job, PipelineJob)
    trainer = RawTrainer(agent.settings.socket_path)
    hello = await trainer.request(K.HELLO, {"job_id": job_id, "rank": 0, "gpu_index": 0,
                                            "join_token": JOIN_TOKENS[job_id]})
    assert hello.ok, hello
    return job_id, job, trainer, statuses


async def test_a_trainers_goodbye_lets_the_coordinator_go_of_what_it_kept(
    nats_server, agent, nc, tmp_path
) -> None:
    """A rank sending new instruction names every iteration, then BYE: the job (still
    discovering) stops and keeps nothing, on its node's budget too."""
    coord, task = await _coordinator(nats_server, tmp_path)
    try:
        job_id, job, trainer, statuses = await _one_rank_job(nc, coord, agent)
        try:
            # (One more iteration unlike the one before would stop the job by itself.)
            for step in range(MAX_DISCOVERY_CHANGES):
                await trainer.iteration(step, [f"op{step}_{k}" for k in range(200)], step * 200)
            last = MAX_DISCOVERY_CHANGES - 1
            await wait_for(lambda: job.kept.total > 0 and job._latest.get(0) == last, 10,
                           "the iterations measured")
            assert job.phase == "discovering"
            assert job.kept.total <= 2 * 200 * 300  # About one iteration, not five.
            assert coord.starter.budget.used(NODE) == job.kept.total
            assert (await trainer.request(K.BYE, {})).ok
            await wait_for(lambda: any(s.state == "stopped" for s in statuses), 5,
                           "the job stopped on the goodbye")
        finally:
            trainer.close()
        stopped = next(s for s in statuses if s.state == "stopped")
        assert "said goodbye" in stopped.message
        assert job.kept.total == 0 and coord.starter.budget.used(NODE) == 0
        assert not any(job._steps.values())
    finally:
        await stop(coord, task)


async def test_a_job_past_its_cap_stops_with_too_large(nats_server, agent, nc, tmp_path) -> None:
    """An iteration of 5,000 instructions is ~1.4 MB kept: past a 1 MB cap per job."""
    coord, task = await _coordinator(nats_server, tmp_path, max_pipeline_mb_per_job=1)
    try:
        job_id, job, trainer, statuses = await _one_rank_job(nc, coord, agent)
        try:
            await trainer.iteration(0, [f"op_{k:05d}" for k in range(5000)], 0)
            await wait_for(lambda: any(s.state == "error" for s in statuses), 10,
                           "the job stopped")
        finally:
            trainer.close()
        error = next(s for s in statuses if s.state == "error")
        assert error.progress.get("code") == "too_large"
        assert "max_pipeline_mb_per_job" in error.message and "raise the cap" in error.message
        assert job.kept.total == 0 and coord.starter.budget.used(NODE) == 0
    finally:
        await stop(coord, task)
