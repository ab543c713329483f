"""Steps delimited by their begins only (Zeus's callbacks) over a real agent: measured, no gap.

Zeus 0.16's `GlobalPowerLimitOptimizer` and `HFGlobalPowerLimitOptimizer` send `on_step_begin`
and `on_epoch_end` and nothing else. The agent's meter learns that such a rank never ends its
steps (`RankMeter` rule 6): each step is measured from its begin to the next begin (the last of
an epoch to the epoch's end), and nothing is logged or counted as a measurement gap. A rank
that does end its steps and skips one end is still reported (`gap_never_ended`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.shell.agent_kit import Inbox, RawTrainer, running_agent, wait_for
from zeus_agent.wire import subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import ErrorEvent, Measurement
from zeus_agent.wire.node_batch import NodeMeasurementBatch

STEP_S = 0.02


async def _steps(inbox: Inbox, n: int, timeout_s: float = 5.0) -> dict[int, Measurement]:
    """Step measurements by step counter, until `n` have come."""
    steps: dict[int, Measurement] = {}
    deadline = time.monotonic() + timeout_s
    while len(steps) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{len(steps)} of {n} steps measured: {sorted(steps)}")
        batch = await inbox.next(NodeMeasurementBatch, left)
        steps.update({m.step: m for p in batch.gpus for m in p.measurements if m.kind == "step"})
    return steps


async def test_steps_without_ends_are_measured_begin_to_begin_and_report_no_gap(
    nats_server, nc, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zeus_agent")
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        meas = await Inbox.open(nc, subjects.job_measurements("jobZ", node))
        errors = await Inbox.open(nc, subjects.gpu_errors(node, 0))
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("jobZ", rank=0, gpu_index=0)).ok
            begins: dict[int, int] = {}
            ends: dict[int, int] = {}
            step = 0
            for epoch in range(3):  # as GlobalPowerLimitOptimizer sends them
                for _ in range(5):
                    begins[step] = trainer.event(dg.Kind.STEP_BEGIN, step, epoch)
                    step += 1
                    await asyncio.sleep(STEP_S)
                ends[epoch] = trainer.event(dg.Kind.EPOCH_END, epoch, 0)
                await asyncio.sleep(STEP_S)
            steps = await _steps(meas, 15)
            gpu = agent.agents[0]
            assert gpu.counters["gaps"] == 0
        finally:
            trainer.close()
    assert sorted(steps) == list(range(15))
    for s, m in steps.items():
        epoch = s // 5
        t1 = begins[s + 1] if s % 5 != 4 else ends[epoch]
        assert (m.epoch, m.t0_ns, m.t1_ns) == (epoch, begins[s], t1), s
        assert m.energy_j > 0
    with pytest.raises(TimeoutError):  # no error event for the rank at all
        await errors.next(ErrorEvent, timeout_s=0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_rank_that_ends_its_steps_and_skips_one_end_is_reported(
    nats_server, nc, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zeus_agent")
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        errors = await Inbox.open(nc, subjects.gpu_errors(node, 0))
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("jobE", rank=0, gpu_index=0)).ok
            for step in range(6):
                trainer.event(dg.Kind.STEP_BEGIN, step, 0)
                await asyncio.sleep(STEP_S)
                if step != 2:  # its end is lost
                    trainer.event(dg.Kind.STEP_END, step, 0)
            event = await errors.until(ErrorEvent, lambda e: e.code.startswith("gap_"))
            gpu = agent.agents[0]
            await wait_for(lambda: gpu.counters["gaps"] >= 1, 3, "the gap counted")
            assert gpu.counters["gaps"] == 1
        finally:
            trainer.close()
    assert (event.code, event.job_id, event.rank) == ("gap_never_ended", "jobE", 0)
    assert "Step 2 of epoch 0 began" in event.message
    logged = [r for r in caplog.records if "gap_never_ended" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
