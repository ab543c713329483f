"""A pipeline job whose schedule the planner cannot model, through a real coordinator: a real
nats-server, an agent on simulated GPUs and a trainer speaking raw datagrams. The job stops
with an error status naming the action, and takes nothing more."""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.job import PipelineJob
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




async def test_an_unknown_action_stops_the_job_with_a_status_naming_it(
    nats_server: Any, agent: AgentServer, nc: Any, tmp_path: Any
) -> None:
    coord, task = await start(nats_server, tmp_path / "coord", dump_data=False,
                              scheduler="Perseus", scheduler_args={"p_block_w": 40.0})
    try:
        job_id = await register_job(nc, dp=1)
        statuses = await collect(nc, subjects.job_status(job_id), JobStatus)
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))).ok
        await wait_for(lambda: isinstance(coord.optimisers.get(job_id), PipelineJob), 10,
                       "the pipeline optimiser")
        job = coord.optimisers[job_id]
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            hello = await trainer.request(K.HELLO, {"job_id": job_id, "rank": 0,
                                                    "gpu_index": 0,
                                                    "join_token": JOIN_TOKENS[job_id]})
            assert hello.ok, hello
            names = ["forward:0:0", "recompute:0:0", "backward:0:0"]
            for step in range(3):
                await trainer.iteration(step, names, step * 3)
            await wait_for(lambda: any(s.state == "error" for s in statuses), 10,
                           "the job stopped")
        finally:
            trainer.close()
        error = next(s for s in statuses if s.state == "error")
        assert "unknown kind 'recompute'" in error.message
        assert "default clocks" in error.message
        assert isinstance(job, PipelineJob) and job.done and job.schedules == {}
    finally:
        await stop(coord, task)
