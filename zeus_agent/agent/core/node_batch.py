"""`PendingMeasurements`: what a node's GPUs measured since the last flush, grouped by job.

Each GPU's measurer hands over the marks and measurements reads now bracket (`add`); the node's
publisher takes them all at each flush (`take`) as one `NodeMeasurementBatch` per job, a part
per GPU (and per rank: a GPU rebound meanwhile has a part for each rank), each GPU's items in
the order they were handed over. A batch holds at most `max_items` items: a backlog goes out
in several messages, in order. Pure: no asyncio, NATS or clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from zeus_agent.wire.messages import Mark, Measurement
from zeus_agent.wire.node_batch import MAX_ITEMS_PER_BATCH, GpuMeasurements, NodeMeasurementBatch

__all__ = ["PendingMeasurements"]

_Key = tuple[int, int, str | None]
"""(GPU, rank, join digest) of a part."""


class PendingMeasurements:
    """The node's pending marks and measurements: job -> part key -> (marks, measurements)."""

    def __init__(self, node: str, max_items: int = MAX_ITEMS_PER_BATCH) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, not {max_items}")
        self.node = node
        self.max_items = max_items
        self._jobs: dict[str, dict[_Key, tuple[list[Mark], list[Measurement]]]] = {}

    def __bool__(self) -> bool:
        """Whether anything waits to be published."""
        return bool(self._jobs)

    @property
    def items(self) -> int:
        """Marks and measurements waiting to be published."""
        return sum(len(marks) + len(meas) for parts in self._jobs.values()
                   for marks, meas in parts.values())

    def add(self, gpu: int, job_id: str, rank: int, join_digest: str | None,
            marks: Iterable[Mark], measurements: Iterable[Measurement]) -> None:
        """Keep what GPU `gpu` measured for `job_id`'s `rank` (bound with `join_digest`)."""
        marks, measurements = list(marks), list(measurements)
        if not marks and not measurements:
            return
        held = self._jobs.setdefault(job_id, {}).setdefault((gpu, rank, join_digest), ([], []))
        held[0].extend(marks)
        held[1].extend(measurements)

    def take(self) -> list[NodeMeasurementBatch]:
        """Everything pending as batches (one per job unless it holds more than `max_items`)."""
        jobs, self._jobs = self._jobs, {}
        return [batch for job_id, parts in jobs.items() for batch in self._batches(job_id, parts)]

    def _batches(self, job_id: str,
                 parts: dict[_Key, tuple[list[Mark], list[Measurement]]]
                 ) -> list[NodeMeasurementBatch]:
        """One job's parts cut into batches of at most `max_items` items."""
        batches: list[NodeMeasurementBatch] = []
        current: list[GpuMeasurements] = []
        room = self.max_items
        for (gpu, rank, digest), (marks, measurements) in parts.items():
            while marks or measurements:
                if room == 0:
                    batches.append(self._batch(job_id, current))
                    current, room = [], self.max_items
                taken_marks, marks = marks[:room], marks[room:]
                left = room - len(taken_marks)
                taken_meas, measurements = measurements[:left], measurements[left:]
                current.append(GpuMeasurements(gpu=gpu, rank=rank, marks=taken_marks,
                                               measurements=taken_meas, join_digest=digest))
                room -= len(taken_marks) + len(taken_meas)
        if current:
            batches.append(self._batch(job_id, current))
        return batches

    def _batch(self, job_id: str, parts: list[GpuMeasurements]) -> NodeMeasurementBatch:
        return NodeMeasurementBatch(node=self.node, job_id=job_id, gpus=parts)
