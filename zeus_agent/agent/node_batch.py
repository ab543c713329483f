"""`NodeMeasurements`: the node's one publisher of its GPUs' marks and measurements.

Each GPU's `RankMeasurer` hands over what reads now bracket (`add`) where it used to publish a
`MeasurementBatch` per GPU; this publishes them `delay_s` later as one `NodeMeasurementBatch`
per job on `<p>.job.<job>.meas.<node>` (`PendingMeasurements` groups them; in columns, a
`NodeColumnBatch`, while `in_columns(job)`: `--measurement-columns`). A GPU's reads come
every counter update (~100 ms) at its own phase, so without the delay each GPU's hand-over would
still be a message of its own: with 8 GPUs and the default 50 ms, a node sends ~16 batches a
second per job instead of ~73, each mark ~30 ms later (p50 90 ms instead of 61, p99 229 instead
of 197: the reads that bracket it already take 60-200 ms; `bench/node_batches.py`). `flush()`
publishes at once (shutdown, tests).

Trainer events are not batched here: they go out at once on their rank's subject (rank 0 paces
the power-limit machine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeAlias

from zeus_agent.agent.core.node_batch import PendingMeasurements
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import Mark, Measurement
from zeus_agent.wire.node_columns import NodeColumnBatch

__all__ = ["FLUSH_DELAY_S", "NodeMeasurements"]

Publish = Callable[[str, bytes], Awaitable[None]]

InColumns: TypeAlias = Callable[[str], bool]
"""Whether a job's batches go out in columns now (`ColumnsChoice.columns` at the time)."""

FLUSH_DELAY_S = 0.05
"""How long after the first hand-over the node's batches go out (s): half a counter update."""


class NodeMeasurements:
    """Publishes the node's pending marks and measurements, one batch per job per flush."""

    def __init__(self, node: str, prefix: str, publish: Publish,
                 delay_s: float = FLUSH_DELAY_S, columns: bool | InColumns = False) -> None:
        """Publish through `publish(subject, payload)`, `delay_s` after a hand-over.

        0: at the next turn of the event loop (what GPUs handed over in one turn goes together).
        `columns`: each batch as a `NodeColumnBatch` (`--measurement-columns`); a callable:
        asked of each job's batch at every flush (the trainer events' measurers ask it too:
        `in_columns(job_id)`).
        """
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, not {delay_s}")
        self.node = node
        self.prefix = prefix
        self.delay_s = delay_s
        self.in_columns: InColumns = columns if callable(columns) else (lambda _job: columns)
        self._publish = publish
        self.pending = PendingMeasurements(node)
        self._timer: asyncio.TimerHandle | None = None
        self._order = asyncio.Lock()
        """One flush at a time: a GPU's items go out in the order they were handed over."""
        self._tasks: set[asyncio.Future[None]] = set()
        self.published = 0
        """Batches published so far."""

    def add(self, gpu: int, job_id: str, rank: int, join_digest: str | None,
            marks: Iterable[Mark], measurements: Iterable[Measurement]) -> None:
        """Keep what `gpu` measured for `job_id`'s `rank`; publish it with the next flush."""
        self.pending.add(gpu, job_id, rank, join_digest, marks, measurements)
        if self.pending and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._due)

    def _due(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Publish everything pending now, one batch per job (several for a large backlog)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        async with self._order:
            for batch in self.pending.take():
                subject = subjects.job_measurements(batch.job_id, self.node, self.prefix)
                payload = (NodeColumnBatch.from_rows(batch) if self.in_columns(batch.job_id)
                           else batch)
                await self._publish(subject, codec.encode(payload))
                self.published += 1
