"""The examples run, on tiny sizes, against a real sim agent (and coordinator) so they cannot rot.

Each example runs as users run it: a subprocess of `python examples/<name>.py`, talking to an
agent (simulated GPU) started here on the test's event loop (the harness's `LocalCluster`).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.wire import codec
from zeus_agent.wire.messages import JobStatus, MeasurementBatch
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_demo.cluster import LocalCluster, wait_for_async

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class Cluster:
    """One sim agent (one GPU), optionally a coordinator, and what they published."""

    socket_path: str
    sim_state_dir: str
    statuses: list[JobStatus] = field(default_factory=list)
    measurements: list[MeasurementBatch] = field(default_factory=list)

    def step_measurements(self, job_id: str) -> dict[int, Any]:
        return {
            m.step: m
            for b in self.measurements
            if b.job_id == job_id
            for m in b.measurements
            if m.kind == "step"
        }

    def states(self, job_id: str) -> list[str]:
        return [s.state for s in self.statuses if s.job_id == job_id]


async def _cluster(
    nats_server: Any, tmp_path: Path, with_coordinator: bool
) -> AsyncIterator[Cluster]:
    cluster = Cluster(str(tmp_path / "agent.sock"), str(tmp_path / "sim"))
    services = LocalCluster(nats_url=nats_server.url, log_level=None)
    await services.start_broker()
    services.add_agent(f"ex-{tmp_path.name[-12:]}", {
        "sim_count": 1,
        "sim_energy_update_ms": 0,  # steps of a few ms: an exact counter
        "sim_preset": "A40",
        "sim_state_dir": cluster.sim_state_dir,
        "socket_path": cluster.socket_path,
        "sample_hz": 20,
    })
    coord = None
    if with_coordinator:
        coord = services.add_coordinator({"state_dir": str(tmp_path / "coord")})
    nc = await connect(nats_server.url, "examples-observer")

    async def on_status(msg: Any) -> None:
        cluster.statuses.append(codec.decode(msg.data, JobStatus))

    async def on_meas(msg: Any) -> None:
        cluster.measurements += codec.decode(msg.data, NodeMeasurementBatch).per_gpu()

    await nc.subscribe("zeus.job.*.status", cb=on_status)
    await nc.subscribe("zeus.job.*.meas.*", cb=on_meas)
    try:
        await services.wait_agents()
        if coord is not None:
            await services.wait_coordinator(*coord)
        yield cluster
        await confirm_subscriptions(nc)
        await asyncio.sleep(0.2)
    finally:
        await services.stop_services()
        await nc.drain()


@pytest.fixture
async def cluster(nats_server: Any, tmp_path: Path) -> AsyncIterator[Cluster]:
    async for c in _cluster(nats_server, tmp_path, with_coordinator=True):
        yield c


@pytest.fixture
async def agent_only(nats_server: Any, tmp_path: Path) -> AsyncIterator[Cluster]:
    async for c in _cluster(nats_server, tmp_path, with_coordinator=False):
        yield c


async def run_example(name: str, *args: str, timeout_s: float = 90) -> tuple[dict[str, Any], str]:
    """Run `examples/<name>` in a subprocess; return its last stdout line (JSON) and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / name),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    return json.loads(text.strip().splitlines()[-1]), text


async def test_pytorch_example_is_measured_and_optimised(cluster: Cluster) -> None:
    epochs, steps = 2, 40
    summary, text = await run_example(
        "pytorch_training.py",
        "--socket",
        cluster.socket_path,
        "--sim-state-dir",
        cluster.sim_state_dir,
        "--epochs",
        str(epochs),
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--hidden",
        "16",
        "--scale",
        "0.05",
        "--warmup-steps",
        "1",
        "--profile-steps",
        "3",
    )
    job_id = summary["job_id"]
    assert job_id and job_id.endswith("+pytorch-example"), text
    # The model really trained.
    assert summary["losses"][-1] < summary["losses"][0]
    # The agent measured every step of the job, each with the simulated GPU's energy. A step's
    # measurement goes out once a counter read brackets its end (the reads are phase-locked to
    # the 100 ms counter) and the next batch is published: the last ones come after the trainer.
    await wait_for_async(lambda: len(cluster.step_measurements(job_id)) >= epochs * steps, 10,
                         fail=False)
    measured = cluster.step_measurements(job_id)
    assert sorted(measured) == list(range(epochs * steps))
    assert all(m.energy_j > 0 and m.time_s > 0 for m in measured.values())
    # The profiling windows (one per epoch) measured energy too.
    assert len(summary["windows"]) == epochs
    assert all(w["energy_j"] > 0 and math.isfinite(w["energy_j"]) for w in summary["windows"])
    assert summary["dropped"] == 0
    # The coordinator registered the job and pinned a limit from the example's steps.
    states = cluster.states(job_id)
    assert states[0] == "registered" and "done" in states, states


async def test_pytorch_example_runs_against_an_agent_alone(agent_only: Cluster) -> None:
    summary, text = await run_example(
        "pytorch_training.py",
        "--socket",
        agent_only.socket_path,
        "--sim-state-dir",
        agent_only.sim_state_dir,
        "--epochs",
        "2",
        "--steps",
        "10",
        "--batch-size",
        "8",
        "--hidden",
        "8",
        "--scale",
        "0.05",
    )
    assert "no coordinator" in text
    assert summary["job_id"] is None
    assert summary["losses"][-1] < summary["losses"][0]
    # Without a job, windows are still measured by the agent.
    assert all(w["energy_j"] > 0 and math.isfinite(w["energy_j"]) for w in summary["windows"])


async def test_huggingface_example_callback_reaches_the_coordinator(cluster: Cluster) -> None:
    summary, text = await run_example(
        "huggingface_trainer.py",
        "--socket",
        cluster.socket_path,
        "--sim-state-dir",
        cluster.sim_state_dir,
        "--epochs",
        "2",
        "--samples",
        "256",
        "--batch-size",
        "8",
        "--warmup-steps",
        "1",
        "--profile-steps",
        "3",
        "--scale",
        "0.05",
        timeout_s=120,
    )
    await asyncio.sleep(0.3)
    job_id = summary["job_id"]
    assert job_id and "+dp1+pp1+tp1+" in job_id, text
    assert summary["steps"] == 2 * 256 // 8
    assert summary["train_loss"] < summary["first_loss"] or summary["train_loss"] < 4.0
    # The callback's step events drove the coordinator through profiling to a pinned limit...
    states = cluster.states(job_id)
    assert states[0] == "registered" and "profiling" in states and "done" in states, states
    done = [s for s in cluster.statuses if s.job_id == job_id and s.state == "done"][-1]
    optimum = done.progress["optimal_power_limit_w"]
    assert len(done.progress["measurements"]) == 9
    # ...and the limits it commanded reached the simulated GPU the trainer ran on.
    assert len(summary["power_limits_w"]) > 1
    assert optimum in summary["power_limits_w"]
    assert summary["dropped"] == 0
