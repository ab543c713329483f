"""A node's batch of ranks written together: one node entry per job (async shell).

An agent relays the ranks of its node that register together in one request (`RegisterRanks`);
each is checked as if it came alone, side by side. `NodeWrite` gathers the ranks that pass, and
once every rank of the batch has either been given to it or finished without (refused, a
retry), records them in one write (`JetStreamState.create_node_ranks`): one followed entry for
the node's ranks, so each replica's watch brings one entry per node, not one per rank. The
common batch (one known job, every rank described by its agent) is written in its request's
own task (`write_node`, from `Endpoints._register_node`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from coordinator.jobs import RankRecord
from coordinator.state.group_commit import REFUSED, Outcome

Item = tuple[RankRecord, tuple[int, int] | None, float | None]
"""A rank, its GPU's power-limit range and energy-counter period (`create_node_ranks`)."""


def distinct(items: list[Item]) -> bool:
    """Whether no rank and no GPU comes twice (else the batch would be refused whole; pure)."""
    ranks = {rank.info.rank for rank, _, _ in items}
    gpus = {(rank.gpu.node, rank.gpu.gpu_index) for rank, _, _ in items}
    return len(ranks) == len(gpus) == len(items)


async def write_node(state: Callable[[], Any], job_id: str, items: list[Item]) -> Outcome:
    """A job's ranks of one node in one write (`create_node_ranks`), in rank order.

    REFUSED (not committed) for ranks or GPUs that come twice, and for any failure: each rank
    is then recorded alone, which says why.
    """
    items = sorted(items, key=lambda i: i[0].info.rank)
    try:
        if distinct(items):
            outcome: Outcome = await state().create_node_ranks(job_id, items)
            return outcome
    except Exception:  # noqa: BLE001 - recorded alone, each rank learns why
        pass
    return REFUSED


class NodeWrite:
    """The ranks of one node's batch, written together once each rank is in or out.

    For the batches `Endpoints._register_node` leaves to one task per rank (a GPU to describe
    first, ranks of several jobs); the common batch is written in its request's own task.

    Each rank's handler (one task each) either gives its rank (`create`) or is done without
    (`skip`, or `finish` whatever happened); when none is left, the ranks given go in one write
    per job and each giver learns the outcome: not committed, it records its rank alone.
    """

    def __init__(self, state: Callable[[], Any], ranks: int) -> None:
        self.state = state
        """The state bucket (`Link.require_state`: raises without one)."""
        self.left = ranks
        self._items: dict[str, list[tuple[Item, asyncio.Future[Outcome]]]] = {}
        self._done: set[asyncio.Task[Any] | None] = set()
        self._task: asyncio.Task[None] | None = None

    async def create(self, job_id: str, item: Item) -> Outcome:
        """Give this task's rank to the node's write; its outcome once written."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._items.setdefault(job_id, []).append((item, future))
        self._out()
        return await future

    def skip(self) -> None:
        """This task's rank is recorded otherwise (or not at all): the others need not wait."""
        self._out()

    def finish(self) -> None:
        """This task is done (its rank given, skipped, or refused)."""
        if asyncio.current_task() not in self._done:
            self._out()

    def _out(self) -> None:
        task = asyncio.current_task()
        if task in self._done:
            return
        self._done.add(task)
        self.left -= 1
        if self.left == 0 and self._items:
            self._task = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        for job_id, given in self._items.items():
            outcome = await write_node(self.state, job_id, [item for item, _ in given])
            for _, future in given:
                if not future.done():
                    future.set_result(outcome)
