"""The coordinator's checks on a node's measurement batch (`<p>.job.<job>.meas.<node>`), against
a real nats-server: each GPU's part is checked as a per-GPU batch was (its rank bound to that GPU
of the subject's node, the job's join token), a part that fails is dropped and counted, and the
good parts of the same batch still count; a batch whose node is not its subject's, or on
another job's subject, counts for nothing. Each in both layouts: rows (`NodeMeasurementBatch`,
older agents) and columns (`NodeColumnBatch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from coordinator.power_limit import PowerLimitError
from tests.shell.coordinator_kit import (
    JOIN_TOKENS,
    NODE,
    ask,
    rank_request,
    register_job,
    wait_for,
)
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import Mark, PowerLimitOptions, join_token_digest
from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch
from zeus_agent.wire.node_columns import NodeColumnBatch

Encode = Callable[[NodeMeasurementBatch], bytes]


@pytest.fixture(params=["rows", "columns"])
def encode(request: Any) -> Encode:
    """A batch as an older agent sends it (rows), or in columns (`NodeColumnBatch`)."""
    if request.param == "rows":
        return codec.encode
    return lambda batch: codec.encode(NodeColumnBatch.from_rows(batch))


def part(gpu: int, rank: int, digest: str | None, steps: range) -> GpuMeasurements:
    return GpuMeasurements(gpu=gpu, rank=rank, join_digest=digest, marks=[
        Mark(kind="step_begin", epoch=0, step=s, t_ns=s * 10**9, energy_j=float(s))
        for s in steps])


async def started_job(coord: Any, nc: Any) -> tuple[str, str]:
    """A job of 2 ranks on `NODE`'s GPUs 0 and 1, its optimiser started; (job id, digest)."""
    job_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())
    for r in (0, 1):
        assert (await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, r))).ok
    await wait_for(lambda: job_id in coord.optimisers)
    return job_id, join_token_digest(JOIN_TOKENS[job_id])


def kept(coord: Any, job_id: str, rank: int) -> int:
    """Marks of `rank` the job's window join holds."""
    return int(coord.optimisers[job_id]._join.kept(rank))


async def test_bad_parts_are_dropped_and_counted_and_the_good_ones_count(
        coord, nc, encode: Encode) -> None:
    job_id, digest = await started_job(coord, nc)
    wrong_node, no_token = coord.dropped["wrong_node"], coord.dropped["no_join_token"]
    batch = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=[
        part(1, 0, digest, range(1, 4)),  # rank 0 is bound to GPU 0, not GPU 1
        part(0, 0, join_token_digest("a-guessed-join-token-0000"), range(1, 4)),
        part(1, 1, None, range(1, 4)),  # a trainer that presented no token
        part(0, 0, digest, range(1, 3)),  # good
        part(1, 1, digest, range(1, 6)),  # good
        part(0, 0, digest, range(3, 3)),  # empty: skipped, not counted
    ])
    await nc.publish(subjects.job_measurements(job_id, NODE), encode(batch))
    await wait_for(lambda: kept(coord, job_id, 1) == 5)
    assert kept(coord, job_id, 0) == 2
    assert coord.dropped["wrong_node"] == wrong_node + 1
    assert coord.dropped["no_join_token"] == no_token + 2


async def test_a_batch_whose_node_or_job_is_not_its_subjects_counts_for_nothing(
        coord, nc, encode: Encode) -> None:
    job_id, digest = await started_job(coord, nc)
    other_id = await register_job(nc, dp=2, power_limit=PowerLimitOptions())  # (no rank yet)
    wrong_node, wrong_job = coord.dropped["wrong_node"], coord.dropped["wrong_job"]
    good = [part(0, 0, digest, range(1, 4)), part(1, 1, digest, range(1, 4))]
    # Names the ranks' node but comes on another node's subject (another node's agent).
    spoofed = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=good)
    await nc.publish(subjects.job_measurements(job_id, "evil"), encode(spoofed))
    # Says it is the other node's, on that node's subject: no rank of the job is bound there.
    evil = NodeMeasurementBatch(node="evil", job_id=job_id, gpus=good)
    await nc.publish(subjects.job_measurements(job_id, "evil"), encode(evil))
    # The job's batch on the other job's subject.
    await nc.publish(subjects.job_measurements(other_id, NODE),
                     encode(NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=good)))
    await wait_for(lambda: coord.dropped["wrong_node"] >= wrong_node + 3
                   and coord.dropped["wrong_job"] >= wrong_job + 1)
    assert coord.dropped["wrong_node"] == wrong_node + 3  # the spoofed one, evil's two parts
    assert [kept(coord, job_id, r) for r in (0, 1)] == [0, 0]
    # The same parts on the right subject count.
    await nc.publish(subjects.job_measurements(job_id, NODE),
                     encode(NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=good)))
    await wait_for(lambda: kept(coord, job_id, 0) == 3 and kept(coord, job_id, 1) == 3)


async def test_a_batch_of_a_job_nobody_drives_reaches_no_replica(coord, nc) -> None:
    """A replica follows the measurements of its own jobs only: those of an unknown job reach
    nobody (nothing decoded, nothing counted). The barrier after them, on a subject every
    replica follows, is counted once they would have been."""
    before = dict(coord.dropped)
    await nc.publish(subjects.job_measurements("no-such-job", NODE), b"\xc1 not msgpack")
    await nc.publish(subjects.gpu_errors(NODE, 0), b"\xc1 barrier")
    await wait_for(lambda: coord.dropped["malformed"] == before.get("malformed", 0) + 1)
    moved = {k: v - before.get(k, 0) for k, v in coord.dropped.items() if v != before.get(k, 0)}
    assert moved == {"malformed": 1}, moved


def feeding(coord: Any, job_id: str, raises: Exception) -> list[int]:
    """Make the job's optimiser raise `raises` on rank 0's marks; the ranks it is fed, in order."""
    job = coord.optimisers[job_id]
    fed, ranks = job.on_mark, []

    def on_mark(rank: int, mark: Mark) -> Any:
        ranks.append(rank)
        if rank == 0:
            raise raises
        return fed(rank, mark)

    job.on_mark = on_mark
    return ranks


async def test_a_part_the_optimiser_fails_on_ends_the_job_and_feeds_no_later_part(
        coord, nc, encode: Encode) -> None:
    """As when each part was fed on its own: the job fails, the parts after it are not fed."""
    job_id, digest = await started_job(coord, nc)
    ranks = feeding(coord, job_id, RuntimeError("a bug in the optimiser"))
    batch = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=[
        part(0, 0, digest, range(1, 3)), part(1, 1, digest, range(1, 3))])
    await nc.publish(subjects.job_measurements(job_id, NODE), encode(batch))
    await wait_for(lambda: job_id not in coord.optimisers)
    assert ranks == [0]


async def test_an_input_the_power_limit_core_refuses_is_skipped_and_the_rest_are_fed(
        coord, nc, encode: Encode) -> None:
    job_id, digest = await started_job(coord, nc)
    job = coord.optimisers[job_id]
    ranks = feeding(coord, job_id, PowerLimitError("refused on purpose"))
    batch = NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=[
        part(0, 0, digest, range(1, 3)), part(1, 1, digest, range(1, 4))])
    await nc.publish(subjects.job_measurements(job_id, NODE), encode(batch))
    await wait_for(lambda: len(ranks) == 5)
    assert ranks == [0, 0, 1, 1, 1]
    assert coord.optimisers[job_id] is job
    assert kept(coord, job_id, 1) == 3


def flood(layout: str, job_id: str, items: int) -> bytes:
    """A node's batch of `items` one-byte bad marks (-1), in `layout`: refused as malformed."""
    if layout == "rows":
        return msgpack.packb({"v": 1, "node": NODE, "job_id": job_id, "gpus": [
            {"gpu": 0, "rank": 0, "marks": [-1] * items}]})
    return msgpack.packb({
        "v": 1, "columns": 1, "node": NODE, "job_id": job_id, "gpu": [0], "rank": [0],
        "join_digest": [None], "mark_count": [items], "measurement_count": [0],
        "marks": {f: [-1] * items for f in ("kind", "epoch", "step", "t_ns", "energy_j",
                                            "power_limit_w")}})


@pytest.mark.parametrize("layout", ["rows", "columns"])
async def test_a_flood_of_bad_items_is_one_malformed_drop_and_the_next_batch_counts(
        coord, nc, encode: Encode, layout: str) -> None:
    """Containment: the replica refuses the flood (~0.9 MB) whole and goes on with the job."""
    job_id, digest = await started_job(coord, nc)
    before = dict(coord.dropped)
    subject = subjects.job_measurements(job_id, NODE)
    await nc.publish(subject, flood(layout, job_id, 900_000 if layout == "rows" else 150_000))
    good = [part(0, 0, digest, range(1, 4)), part(1, 1, digest, range(1, 4))]
    await nc.publish(subject, encode(NodeMeasurementBatch(node=NODE, job_id=job_id, gpus=good)))
    await wait_for(lambda: kept(coord, job_id, 0) == 3 and kept(coord, job_id, 1) == 3)
    moved = {k: v - before.get(k, 0) for k, v in coord.dropped.items() if v != before.get(k, 0)}
    assert moved == {"malformed": 1}, moved
