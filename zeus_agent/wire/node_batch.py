"""`NodeMeasurementBatch`: one node's marks and measurements of one job, for all its GPUs.

An agent publishes one per job per flush on `<p>.job.<job>.meas.<node>`
(`subjects.job_measurements`) instead of one `MeasurementBatch` per GPU: a node of 8 GPUs
sends 8 times fewer messages, and a subscriber can follow one job's subject. Each GPU's part
(`GpuMeasurements`) carries what a `MeasurementBatch` carried (rank, marks, measurements and the
digest of the join token its trainer presented), so the coordinator checks each part as it
checked a per-GPU batch: the part's GPU must be the one its rank is bound to on the subject's
node, and its digest the job's. `per_gpu()` gives observers the per-GPU view.

Kept apart from `messages` (at its size limit); it depends on `messages` only.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from zeus_agent.wire.messages import (
    MAX_GPUS_PER_NODE,
    GpuIndex,
    Id,
    JoinDigest,
    Mark,
    Measurement,
    MeasurementBatch,
    Message,
    Name,
    Rank,
)

__all__ = ["FAIL_FAST", "MAX_ITEMS_PER_BATCH", "GpuMeasurements", "NodeMeasurementBatch"]

MAX_ITEMS_PER_BATCH = 1000
"""Most marks and measurements an agent puts in one batch (more go in the next message): a
measurement with the longest instruction name takes ~400 bytes, so a batch stays well under
nats-server's default 1 MB payload limit whatever a backlog holds."""
FAIL_FAST = Field(fail_fast=True)
"""On a list of a node's batch: validation stops at its first bad item. Pydantic otherwise
builds an error per bad item, and a coordinator refused a 1 MB batch of a million one-byte bad
marks in ~8 s of CPU on its event loop (tests/wire/test_node_batch_floods.py)."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GpuMeasurements(_Part):
    """One GPU's part of a node's batch: the marks and measurements of the rank bound to it."""

    gpu: GpuIndex
    rank: Rank
    marks: Annotated[list[Mark], FAIL_FAST] = []
    measurements: Annotated[list[Measurement], FAIL_FAST] = []
    join_digest: JoinDigest | None = Field(
        default=None,
        description="Digest of the join token the bound trainer presented in its HELLO (None: "
        "none): the coordinator counts a job's marks only from a trainer that had its token",
    )

    @property
    def items(self) -> int:
        """Marks and measurements in this part."""
        return len(self.marks) + len(self.measurements)


class NodeMeasurementBatch(Message):
    """Marks and measurements of one job's ranks on one node's GPUs, one part per GPU."""

    node: Name
    job_id: Id
    gpus: list[GpuMeasurements] = Field(default=[], max_length=MAX_GPUS_PER_NODE, fail_fast=True)

    def per_gpu(self) -> list[MeasurementBatch]:
        """Each part as the per-GPU `MeasurementBatch` observers used to receive, in order."""
        return [MeasurementBatch(node=self.node, gpu=p.gpu, job_id=self.job_id, rank=p.rank,
                                 marks=p.marks, measurements=p.measurements,
                                 join_digest=p.join_digest)
                for p in self.gpus]
