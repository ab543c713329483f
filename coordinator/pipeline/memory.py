"""What pipeline jobs keep of their ranks' measurements, against caps per job and per node.

A rank that sent new instruction names every iteration made the coordinator keep ~275 bytes per
instruction for as long as its job lived (64 open steps x 100,000 instructions allowed ~1.7 GB
per rank, and a node may hold 256 jobs). `PipelineJob` charges what it keeps (an estimate:
`record_bytes` per instruction, `name_bytes` per name of a discovered or candidate order,
`result_bytes` per rank's result of each round it keeps for a takeover to replay) to a
`Kept`, which refuses past the job's cap or past its rank's node's cap in a `NodeBudget` shared
by the jobs of one coordinator; the job then stops with code `too_large`. Sans-I/O (and no
locks: see `NodeBudget`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeus_agent.models import ProfilingResult

__all__ = ["RECORD_BYTES", "Kept", "NodeBudget", "name_bytes", "record_bytes", "result_bytes"]

RECORD_BYTES = 272
"""One instruction measurement kept in a step (its dict slot, tuple, floats and a short name's
string): about 275 bytes measured with 3-letter names."""
NAME_BYTES = 64
"""One instruction name of an order (its list slot and string object)."""
VALUE_BYTES = 32
"""One float of a kept `ProfilingResult` (its float object and list slot)."""
MB = 1 << 20
CHUNK = 64 << 10
"""Room a job reserves on a node at a time (its reservation exceeds what it keeps by less)."""


def record_bytes(name: str) -> int:
    """Estimated bytes of one kept instruction measurement named `name`."""
    return RECORD_BYTES + len(name)


def name_bytes(names: Iterable[str]) -> int:
    """Estimated bytes of an order of instruction names."""
    return sum(NAME_BYTES + len(n) for n in names)


def result_bytes(result: ProfilingResult) -> int:
    """Estimated bytes of one kept `ProfilingResult` (a round of results a takeover replays)."""
    values = len(result.iter_time) + len(result.iter_energy)
    for breakdown in (result.time_breakdown, result.energy_breakdown):
        values += sum(len(per_iter) for lists in breakdown.values() for per_iter in lists)
        values += sum(len(lists) for lists in breakdown.values())  # (A list per iteration.)
    return values * VALUE_BYTES + 2 * name_bytes(result.time_breakdown)


class NodeBudget:
    """Caps what the pipeline jobs of one coordinator keep per node together (`per_node` bytes).

    Each job's `Kept` reserves room on a node in `CHUNK`s; only a reservation looks at the other
    jobs (their reservations, read as they stand). Nothing here is shared mutable state
    but the registry of holders, changed by single dict operations: jobs measure on the event
    loop and on worker threads at once, and a pure core takes no lock. Two reservations at the
    same instant may overshoot the cap by a chunk each.

    A job dropped without letting go (another replica took it over, it was removed) stops
    counting once `alive(job)` says so, or once it is collected (holders are weak references):
    the service need not tell the budget about every way a job goes.
    """

    def __init__(self, per_node: int, alive: Callable[[object], bool] = lambda _: True) -> None:
        if per_node < 1:
            raise ValueError(f"per_node must be >= 1 byte, got {per_node}")
        self.per_node = per_node
        self.alive = alive
        self._holders: dict[str, dict[int, weakref.ref[Kept]]] = {}
        """Node -> id(kept) -> the `Kept` of a job with a reservation there."""

    def _live(self, node: str) -> list[Kept]:
        refs = list(self._holders.get(node, {}).values())  # (One C call: a consistent copy.)
        live = [k for k in (r() for r in refs) if k is not None]
        return [k for k in live if (h := k.holder) is not None and self.alive(h)]

    def used(self, node: str) -> int:
        """Bytes the live jobs keep on `node`."""
        return sum(k.by_node.get(node, 0) for k in self._live(node))

    def reserve(self, kept: Kept, node: str, nbytes: int) -> bool:
        """Make `kept`'s reservation on `node` `nbytes`; False (unchanged) past the cap."""
        others = sum(k.reserved.get(node, 0) for k in self._live(node) if k is not kept)
        if others + nbytes > self.per_node:
            return False
        holders = self._holders.setdefault(node, {})
        key = id(kept)
        if key not in holders:
            holders[key] = weakref.ref(kept, lambda _: holders.pop(key, None))
        kept.reserved_on(node, nbytes)
        return True

    def forget(self, kept: Kept) -> None:
        """`kept` holds nothing any more."""
        for node in kept.release_reservations():
            self._holders.get(node, {}).pop(id(kept), None)


class Kept:
    """What one job keeps, per rank and per node, against the job's cap and a `NodeBudget`."""

    def __init__(self, holder: object, per_job: int, budget: NodeBudget | None = None,
                 nodes: Mapping[int, str] | None = None) -> None:
        if per_job < 1:
            raise ValueError(f"per_job must be >= 1 byte, got {per_job}")
        self._holder = weakref.ref(holder)  # (Not a cycle: a dropped job is freed at once.)
        self.per_job = per_job
        self.budget = budget
        self.nodes = dict(nodes or {})
        self.total = 0
        self.by_rank: dict[int, int] = {}
        self.by_node: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        """Node -> the room reserved there in `budget` (>= `by_node`, in `CHUNK`s)."""

    def reserved_on(self, node: str, nbytes: int) -> None:
        """The budget reserved `nbytes` for it on `node` (`NodeBudget.reserve`)."""
        self.reserved[node] = nbytes

    def release_reservations(self) -> list[str]:
        """Drop every reservation (`NodeBudget.forget`); the nodes they were on."""
        nodes = list(self.reserved)
        self.reserved.clear()
        return nodes

    @property
    def holder(self) -> object | None:
        """The job whose measurements these are (None once it is gone)."""
        return self._holder()

    def take(self, rank: int, nbytes: int) -> str | None:
        """Charge `nbytes` (a negative number gives back) to `rank`; why not, or None."""
        if nbytes <= 0:
            self.give(rank, -nbytes)
            return None
        if self.total + nbytes > self.per_job:
            return (f"its ranks' measurements would take more than {self.per_job / MB:.4g} MB "
                    "in the coordinator (the cap per job, max_pipeline_mb_per_job): does a "
                    "rank run other instructions every iteration, or iterations that never "
                    "end? Fix the trainer, or raise the cap")
        node = self.nodes.get(rank)
        if node is not None:
            want = self.by_node.get(node, 0) + nbytes
            if self.budget is not None and want > self.reserved.get(node, 0) and not (
                    self.budget.reserve(self, node, -(-want // CHUNK) * CHUNK)):
                return (f"the pipeline jobs of node {node} would keep more than "
                        f"{self.budget.per_node / MB:.4g} MB of measurements in the coordinator "
                        f"(the cap per node, max_pipeline_mb_per_node; this job: "
                        f"{self.by_node.get(node, 0) / MB:.3g} MB there): fix the trainers, "
                        "or raise the cap")
            self.by_node[node] = want
        self.total += nbytes
        self.by_rank[rank] = self.by_rank.get(rank, 0) + nbytes
        return None

    def give(self, rank: int, nbytes: int) -> None:
        """Give back `nbytes` kept for `rank`."""
        nbytes = min(nbytes, self.by_rank.get(rank, 0))
        if nbytes <= 0:
            return
        self.by_rank[rank] -= nbytes
        self.total -= nbytes
        node = self.nodes.get(rank)
        if node is None:
            return
        left = self.by_node[node] = max(0, self.by_node.get(node, 0) - nbytes)
        if self.reserved.get(node, 0) - left > 2 * CHUNK:  # Room others may use again.
            self.reserved[node] = -(-left // CHUNK) * CHUNK

    def release(self) -> None:
        """Give back everything (the job stopped: it keeps nothing of its measurements)."""
        self.total = 0
        self.by_rank.clear()
        self.by_node.clear()
        if self.budget is not None:
            self.budget.forget(self)
