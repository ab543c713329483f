"""An agent SIGKILLed while it serves a pipeline job's schedules, then started again.

Real processes (`zeus_demo.cluster.SimCluster`): nats-server, `zeus-coordinator run`
(`InstructionProfiler`), agents on two simulated nodes charging the h200 model's NVML costs
(the default `--sim-nvml-timing`) and the simulated 4-stage pipeline trainer. Once schedules
lock the clocks, node-a's agent is SIGKILLed: it restores nothing, so its GPUs stay locked. The
coordinator is frozen (SIGSTOP, well within its ownership lease) while the agent starts again,
so what the new agent does by itself is seen alone: it resets the clocks at start
(`--reset-on-start`, the default), and announces itself. Continued, the coordinator reconciles
on that announcement: the schedules are installed again (clocks locked again), node-a's ranks'
measurements flow again and the job goes on profiling to its plan, without an error.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import pytest

from zeus_agent.gpu.sim import SimGPU
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_demo.cluster import SimCluster, processes_with_mark

PROFILER_ARGS = {"clocks": 3, "warmup_iterations": 1, "min_profile_iterations": 2}


def locked(c: SimCluster, node: str) -> dict[int, tuple[int, int] | None]:
    """The locked SM clocks of each GPU of `node` (None: unlocked), from the simulated GPUs."""
    return {i: SimGPU.open(c.sim_dir(node), i).get_locked_sm_clocks_mhz()
            for i in range(c.gpus_per_node)}


@pytest.mark.timeout(150)
async def test_an_agent_killed_while_serving_schedules_resets_clocks_and_the_job_goes_on() -> None:
    c = SimCluster(coordinator_args=[
        "--scheduler", "InstructionProfiler", "--scheduler-args", json.dumps(PROFILER_ARGS),
        "--profiling-iterations", "3", "--switch-lead-steps", "2",
        # The coordinator is frozen a few seconds: its own lease must outlast that.
        "--ownership-lease-s", "30", "--lease-s", "60"])
    batches: list[tuple[float, str, int]] = []  # (time, node, measurements) of the job's
    coordinator_stopped = False
    try:
        await c.start()

        async def on_batch(msg: Any) -> None:
            batch = codec.decode(msg.data, NodeMeasurementBatch)
            for part in batch.gpus if batch.job_id.endswith(c.tag) else []:
                if part.measurements:
                    batches.append((time.monotonic(), batch.node, len(part.measurements)))

        await c.nc.subscribe(subjects.all_job_measurements(), cb=on_batch)
        c.start_pipeline_trainer(timeout_s=130)
        _, first = await c.wait_status(
            lambda s: s.state == "profiling" and (s.progress.get("schedule") or 0) >= 1, 60,
            "schedule 1 installed")
        job_id = first.job_id
        await c.wait(lambda: any(locked(c, "node-a").values()), 20)

        c.kill_agent("node-a")  # SIGKILL: it restores nothing.
        left = locked(c, "node-a")
        assert any(left.values()), left  # The dead agent's clocks stay locked.

        c.procs.kill("coordinator", signal.SIGSTOP)
        coordinator_stopped = True
        restarted_at = time.monotonic()
        await c.restart_agent("node-a")  # Its announcement: after its start's reset.
        for _ in range(10):  # Nobody reinstalled anything: the clocks stay unlocked.
            now = locked(c, "node-a")
            assert not any(now.values()), (now, c.procs.log("agent-node-a"))
            await asyncio.sleep(0.05)
        c.procs.kill("coordinator", signal.SIGCONT)
        coordinator_stopped = False
        seen = len(c.statuses)

        # Reconciled: the schedules are back on node-a, its ranks are measured again.
        await c.wait(lambda: any(locked(c, "node-a").values()), 30)
        await c.wait(lambda: any(t > restarted_at and n == "node-a" for t, n, _ in batches),
                     30)
        _, serving = await c.wait_status(lambda s: s.state == "serving", 90, "serving", seen)
        assert serving.job_id == job_id
        assert "error" not in c.states(), c.messages()
        assert serving.progress["schedule"] > first.progress["schedule"]
        proc = c.procs.procs["trainer"]
        assert proc.poll() in (None, 0), c.procs.log("trainer")  # Training on, or ended well.
        print("statuses after the restart:\n" + "\n".join(
            f"  {s.state}: {s.message}" for _, s in c.statuses[seen:]))
    finally:
        if coordinator_stopped:
            c.procs.kill("coordinator", signal.SIGCONT)
        await c.close()
    assert processes_with_mark(c.procs.mark) == []
