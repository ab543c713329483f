"""A node's agent sends its GPUs' marks and measurements together (real nats-server, real
socket): one `NodeMeasurementBatch` per job per flush on `<p>.job.<job>.meas.<node>`, a part per
GPU, each GPU's items in order; what is pending when the agent stops goes out at its shutdown.
"""

from __future__ import annotations

import asyncio

from tests.shell.agent_kit import Inbox, RawTrainer, running_agent, wait_for
from zeus_agent.wire import subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch
from zeus_agent.wire.node_columns import NodeColumnBatch, decode_measurements

STEPS = 3
ITEMS_PER_GPU = 3 * STEPS
"""Per step: the step_begin and step_end marks and the step's measurement."""


async def _steps(trainer: RawTrainer) -> None:
    for s in range(STEPS):
        trainer.event(dg.Kind.STEP_BEGIN, s, 0)
        await asyncio.sleep(0.02)
        trainer.event(dg.Kind.STEP_END, s, 0)
        await asyncio.sleep(0.02)


def _in_order(part_list: list[GpuMeasurements]) -> None:
    """One GPU's parts, in the order received, carry every step's marks and measurement once."""
    marks = [(m.kind, m.step) for p in part_list for m in p.marks]
    meas = [(m.kind, m.step) for p in part_list for m in p.measurements]
    assert marks == [(k, s) for s in range(STEPS) for k in ("step_begin", "step_end")]
    assert meas == [("step", s) for s in range(STEPS)]


async def test_one_batch_per_job_carries_each_gpus_part_and_shutdown_sends_it(nats_server,
                                                                              nc) -> None:
    async with running_agent(nats_server.url, sim_count=3) as agent:
        node = agent.settings.node
        inbox = await Inbox.open(nc, subjects.all_node_measurements(node))
        agent.measurements.delay_s = 3600.0  # Nothing goes out before the agent stops.
        trainer = RawTrainer(agent.settings.socket_path)  # (its events reach its 3 GPUs)
        try:
            for job, rank, gpu in (("jobN", 0, 0), ("jobN", 1, 1), ("jobO", 0, 2)):
                assert (await trainer.hello(job, rank=rank, gpu_index=gpu)).ok
            await _steps(trainer)
            await wait_for(lambda: agent.measurements.pending.items >= 3 * ITEMS_PER_GPU, 5.0,
                           "every GPU's marks and measurements handed over")
            assert agent.measurements.published == 0
        finally:
            trainer.close()
    # The agent has stopped: its shutdown published what was pending.
    batches = [await inbox.next(NodeMeasurementBatch) for _ in range(2)]
    await nc.flush()
    assert inbox.sub.pending_msgs == 0  # one batch per job, no more
    by_job = {b.job_id: b for b in batches}
    assert sorted(by_job) == ["jobN", "jobO"]
    assert {b.node for b in batches} == {node}
    # (In the order the GPUs handed their items over.)
    assert sorted((p.gpu, p.rank) for p in by_job["jobN"].gpus) == [(0, 0), (1, 1)]
    assert [(p.gpu, p.rank) for p in by_job["jobO"].gpus] == [(2, 0)]
    for p in (*by_job["jobN"].gpus, *by_job["jobO"].gpus):
        _in_order([p])


async def test_with_the_default_flush_every_gpus_items_come_in_order(nats_server, nc) -> None:
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        inbox = await Inbox.open(nc, subjects.job_measurements("jobD", node))
        trainer = RawTrainer(agent.settings.socket_path)
        parts: dict[int, list[GpuMeasurements]] = {0: [], 1: []}
        try:
            for gpu in (0, 1):
                assert (await trainer.hello("jobD", rank=gpu, gpu_index=gpu)).ok
            await _steps(trainer)
            received = 0
            while sum(p.items for g in parts.values() for p in g) < 2 * ITEMS_PER_GPU:
                batch = await inbox.next(NodeMeasurementBatch, 5.0)
                assert (batch.node, batch.job_id) == (node, "jobD")
                assert len({p.gpu for p in batch.gpus}) == len(batch.gpus)  # a part per GPU
                for p in batch.gpus:
                    assert p.rank == p.gpu and p.join_digest is None
                    parts[p.gpu].append(p)
                received += 1
            assert agent.measurements.published >= received
        finally:
            trainer.close()
    for gpu in (0, 1):
        _in_order(parts[gpu])


async def test_with_measurement_columns_the_batches_go_out_in_columns(nats_server, nc) -> None:
    """`--measurement-columns`: the same batches as `NodeColumnBatch`, the same rows in them."""
    async with running_agent(nats_server.url, sim_count=2, measurement_columns=True) as agent:
        node = agent.settings.node
        sub = await nc.subscribe(subjects.all_node_measurements(node))
        await nc.flush()
        agent.measurements.delay_s = 3600.0  # Nothing goes out before the agent stops.
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            for rank in (0, 1):
                assert (await trainer.hello("jobC", rank=rank, gpu_index=rank)).ok
            await _steps(trainer)
            await wait_for(lambda: agent.measurements.pending.items >= 2 * ITEMS_PER_GPU, 5.0,
                           "every GPU's marks and measurements handed over")
        finally:
            trainer.close()
    parts: dict[int, list[GpuMeasurements]] = {0: [], 1: []}
    while sum(p.items for g in parts.values() for p in g) < 2 * ITEMS_PER_GPU:
        msg = await sub.next_msg(timeout=5.0)
        batch = decode_measurements(msg.data)
        assert isinstance(batch, NodeColumnBatch) and batch.node == node
        for part in batch.rows().gpus:
            parts[part.gpu].append(part)
    for gpu in (0, 1):
        _in_order(parts[gpu])
