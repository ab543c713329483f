"""A node's marks and measurements: the wire model and the pure core that batches them per job.

`NodeMeasurementBatch` (one job, one node, a part per GPU) and `PendingMeasurements` (what the
node's GPUs handed over since the last flush, taken as one batch per job, each GPU's items in
order, a backlog cut into batches of at most `max_items`).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from zeus_agent.agent.core.node_batch import PendingMeasurements
from zeus_agent.wire import codec
from zeus_agent.wire.messages import MAX_GPUS_PER_NODE, Mark, Measurement, join_token_digest
from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch

DIGEST = join_token_digest("a-join-token-of-the-job")


def mark(step: int) -> Mark:
    return Mark(kind="step_begin", epoch=0, step=step, t_ns=1000 * step, energy_j=float(step))


def measurement(step: int) -> Measurement:
    return Measurement(kind="step", name="", epoch=0, step=step, index=0, t0_ns=1000 * step,
                       t1_ns=1000 * step + 900, time_s=0.9e-6, energy_j=1.0)


def steps(batches: list[NodeMeasurementBatch], gpu: int) -> list[tuple[str, int]]:
    """GPU `gpu`'s items in the order the batches carry them: ("mark"/"meas", step)."""
    return [(kind, item.step) for b in batches for p in b.gpus if p.gpu == gpu
            for kind, items in (("mark", p.marks), ("meas", p.measurements)) for item in items]


# ---------------------------------------------------------------------------- the model
def test_a_node_batch_round_trips_and_gives_the_per_gpu_view() -> None:
    batch = NodeMeasurementBatch(node="n1", job_id="job-1", gpus=[
        GpuMeasurements(gpu=0, rank=4, marks=[mark(1)], join_digest=DIGEST),
        GpuMeasurements(gpu=3, rank=7, measurements=[measurement(2)]),
    ])
    back = codec.decode(codec.encode(batch), NodeMeasurementBatch)
    assert back == batch
    views = back.per_gpu()
    assert [(v.node, v.gpu, v.job_id, v.rank, v.join_digest) for v in views] == [
        ("n1", 0, "job-1", 4, DIGEST), ("n1", 3, "job-1", 7, None)]
    assert views[0].marks == [mark(1)] and views[1].measurements == [measurement(2)]


@pytest.mark.parametrize("bad", [
    {"gpus": [{"gpu": -1, "rank": 0}]},
    {"gpus": [{"gpu": 0, "rank": 0, "join_digest": "not-a-digest"}]},
    {"gpus": [{"gpu": 0, "rank": 0, "extra": 1}]},
    {"gpus": [{"gpu": 0, "rank": 0}] * (MAX_GPUS_PER_NODE + 1)},
    {"node": "a\nb"},
])
def test_a_node_batch_refuses_what_no_agent_sends(bad: dict[str, object]) -> None:
    data = {"v": 1, "node": "n1", "job_id": "j", "gpus": [], **bad}
    with pytest.raises(ValidationError):
        NodeMeasurementBatch.model_validate(data)


# ---------------------------------------------------------------------------- the core
def test_one_batch_per_job_with_a_part_per_gpu() -> None:
    pending = PendingMeasurements("n1")
    assert not pending and pending.take() == []
    pending.add(0, "job-a", 0, DIGEST, [mark(1)], [])
    pending.add(1, "job-a", 1, DIGEST, [mark(1)], [measurement(0)])
    pending.add(2, "job-b", 0, None, [], [measurement(5)])
    pending.add(3, "job-a", 3, DIGEST, [], [])  # nothing: no part
    assert pending and pending.items == 4
    batches = pending.take()
    assert not pending and pending.items == 0 and pending.take() == []
    assert [(b.node, b.job_id, [(p.gpu, p.rank) for p in b.gpus]) for b in batches] == [
        ("n1", "job-a", [(0, 0), (1, 1)]), ("n1", "job-b", [(2, 0)])]
    assert batches[0].gpus[1].join_digest == DIGEST and batches[1].gpus[0].join_digest is None


def test_a_gpus_hand_overs_merge_in_order_and_a_rebound_gpu_gets_a_part_per_rank() -> None:
    pending = PendingMeasurements("n1")
    pending.add(0, "job-a", 0, DIGEST, [mark(1)], [measurement(0)])
    pending.add(1, "job-a", 1, DIGEST, [mark(1)], [])
    pending.add(0, "job-a", 0, DIGEST, [mark(2)], [measurement(1)])
    pending.add(0, "job-a", 5, DIGEST, [mark(9)], [])  # GPU 0 now drives rank 5
    (batch,) = pending.take()
    assert [(p.gpu, p.rank) for p in batch.gpus] == [(0, 0), (1, 1), (0, 5)]
    assert [m.step for m in batch.gpus[0].marks] == [1, 2]
    assert [m.step for m in batch.gpus[0].measurements] == [0, 1]


def test_a_backlog_goes_out_in_batches_of_at_most_max_items_in_order() -> None:
    pending = PendingMeasurements("n1", max_items=4)
    pending.add(0, "job-a", 0, DIGEST, [mark(s) for s in range(5)],
                [measurement(s) for s in range(3)])
    pending.add(1, "job-a", 1, DIGEST, [mark(1)], [])
    batches = pending.take()
    assert [sum(p.items for p in b.gpus) for b in batches] == [4, 4, 1]
    assert steps(batches, 0) == [("mark", s) for s in range(5)] + [("meas", s) for s in range(3)]
    assert steps(batches, 1) == [("mark", 1)]
    assert all(b.job_id == "job-a" for b in batches)


def test_max_items_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_items"):
        PendingMeasurements("n1", max_items=0)
