"""A user's own optimum selector through a real agent and coordinator (issue 34, item 1).

Zeus 0.16: "Users can inherit from `OptimumSelector` to implement their custom optimum
selector." The trainer's `GlobalPowerLimitOptimizer` (the drop-in, on the trainer's thread)
registers the job with selector "Custom"; once profiling is over the coordinator asks rank 0's
process through its agent, the drop-in runs the selector at its next step, and the coordinator
pins the answer on the GPU. A selector that raises falls back to the built-in ZeusCost, said in
the job's status.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tests.shell.coordinator_kit import collect, start, stop, wait_for
from zeus_agent import emit
from zeus_agent.integrations import GlobalPowerLimitOptimizer, OptimumSelector
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.messages import JobStatus

pytestmark = pytest.mark.timeout(60)


class SecondHighest(OptimumSelector):
    """Picks the second-highest limit measured: no built-in selector's rule."""

    def __init__(self) -> None:
        self.seen: list[PowerLimitMeasurement] = []

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        self.seen = list(measurements)
        return sorted((m.power_limit for m in measurements), reverse=True)[1]

    def __repr__(self) -> str:
        return "SecondHighest()"


class Broken(OptimumSelector):
    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        raise ZeroDivisionError("the user's bug")


def train(agent_socket: str, selector: OptimumSelector, stop_event: threading.Event,
          out: dict) -> None:
    """A one-GPU training loop written as Zeus documents it (steps of 30 ms)."""
    import os

    before = os.environ.get(emit.ENV_SOCKET)
    os.environ[emit.ENV_SOCKET] = agent_socket
    try:
        plo = GlobalPowerLimitOptimizer(SimpleNamespace(gpu_indices=[0]),
                                        optimum_selector=selector, wait_steps=0,
                                        warmup_steps=0, profile_steps=2, pl_step=100)
        out["job_id"] = plo.job_id
        while not stop_event.is_set():
            plo.on_step_begin()
            time.sleep(0.03)
            plo.on_step_end()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = e
    finally:
        emit.close()
        if before is None:  # (The worker's later tests, and their children, must not see it.)
            os.environ.pop(emit.ENV_SOCKET, None)
        else:
            os.environ[emit.ENV_SOCKET] = before


@pytest.mark.parametrize("kind", ["custom", "broken"])
async def test_a_users_selector_chooses_in_rank_0s_process(nats_server, agent, nc,  # noqa: F811
                                                           tmp_path, kind):
    statuses = await collect(nc, "zeus.job.*.status", JobStatus)
    coord, task = await start(nats_server, tmp_path / "coord")
    selector = SecondHighest() if kind == "custom" else Broken()
    halt, out = threading.Event(), {}
    trainer = threading.Thread(target=train, args=(agent.settings.socket_path, selector, halt,
                                                   out), daemon=True)
    trainer.start()
    try:
        def done() -> bool:
            return any(s.state == "done" and s.job_id == out.get("job_id") for s in statuses)

        await wait_for(lambda: "error" in out or done(), timeout_s=40)
        assert "error" not in out, out
        job_id = out["job_id"]
        states = [s.state for s in statuses if s.job_id == job_id]
        assert "selecting" in states
        final = next(s for s in statuses if s.job_id == job_id and s.state == "done")
        limit = final.progress["optimal_power_limit_w"]
        if kind == "custom":
            assert limit == 200  # of 300, 200, 100 W: the user's rule, in the user's process
            assert "SecondHighest() in rank 0's process" in final.message
            assert sorted(m.power_limit for m in selector.seen) == [100, 200, 300]
        else:
            assert "ZeroDivisionError: the user's bug" in final.message
            assert "ZeusCost" in final.message
        await wait_for(lambda: agent.agents[0].gpu.get_power_limit_w() == limit)
        assert not task.done()
    finally:
        halt.set()
        await asyncio.to_thread(trainer.join, 10)
        await stop(coord, task)
        agent.agents[0].gpu.reset_power_limit()
