"""What the agents measured of a pipeline job, and the arithmetic on it (pure but for the bus).

* `JobObserver`: one job's status events and the agents' measurements (`StepRecord` per rank
  and step, `InstructionRecord` per instruction), by the job's metadata tag.
* `window_stats`, `Side`: energy per iteration summed over GPUs and per pipeline, time per
  iteration the slowest rank's, over a window of steps under given schedule versions.
* `pct_less`, `pct_more`: the savings' percentages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zeus_agent.wire import codec
from zeus_agent.wire.messages import JobStatus
from zeus_agent.wire.node_columns import as_rows, decode_measurements

LOG = logging.getLogger(__name__)

@dataclass
class StepRecord:
    """One rank's step as its agent measured it."""

    t0_ns: int
    t1_ns: int
    time_s: float
    energy_j: float
    version: int | None


@dataclass
class InstructionRecord:
    """One instruction of a rank's step as its agent measured it."""

    index: int
    name: str
    t0_ns: int
    t1_ns: int
    version: int | None


class JobObserver:
    """Status events and the agents' measurements of one job (by its metadata tag)."""

    def __init__(self, tag: str, on_status: Callable[[JobStatus], None] | None = None) -> None:
        self.tag = tag
        self.on_status = on_status
        self.job_id: str | None = None
        self.statuses: list[JobStatus] = []
        self.steps: dict[tuple[int, int], StepRecord] = {}
        self.instructions: dict[tuple[int, int], list[InstructionRecord]] = {}
        self.changed = asyncio.Event()

    def _ours(self, job_id: str) -> bool:
        return job_id.endswith("+" + self.tag)

    async def status(self, msg: Any) -> None:
        """A status event (NATS callback)."""
        try:
            ev = codec.decode(msg.data, JobStatus)
        except Exception as e:  # noqa: BLE001 - a foreign message on a shared bus
            LOG.debug("ignoring an undecodable status event: %s", e)
            return
        if not self._ours(ev.job_id):
            return
        self.job_id = ev.job_id
        self.statuses.append(ev)
        self.changed.set()
        if self.on_status is not None:
            self.on_status(ev)

    async def measurement(self, msg: Any) -> None:
        """A measurement batch (NATS callback)."""
        try:
            batch = as_rows(decode_measurements(msg.data))
        except Exception as e:  # noqa: BLE001
            LOG.debug("ignoring an undecodable measurement batch: %s", e)
            return
        if not self._ours(batch.job_id):
            return
        for part, m in ((p, m) for p in batch.gpus for m in p.measurements):
            if m.epoch != 0:
                continue
            key = (part.rank, m.step)
            if m.kind == "step":
                self.steps[key] = StepRecord(m.t0_ns, m.t1_ns, m.time_s, m.energy_j, m.schedule)
            else:
                self.instructions.setdefault(key, []).append(
                    InstructionRecord(m.index, m.name, m.t0_ns, m.t1_ns, m.schedule))
        self.changed.set()

    def versions(self, state: str) -> list[int]:
        """Schedule versions announced by status events of `state` ("serving", ...), in order."""
        out: list[int] = []
        for ev in self.statuses:
            version = (ev.progress or {}).get("schedule")
            if ev.state == state and isinstance(version, int) and version not in out:
                out.append(version)
        return out

    def last_step(self, rank: int = 0) -> int:
        """The latest step measured of `rank` (-1: none)."""
        return max((s for r, s in self.steps if r == rank), default=-1)

    def steps_at(self, version: int, rank: int = 0) -> int:
        """How many steps of `rank` ran under schedule `version`."""
        return sum(1 for (r, _), rec in self.steps.items() if r == rank and rec.version == version)


# ---------------------------------------------------------------------------- arithmetic
@dataclass(frozen=True)
class Side:
    """Per-iteration figures of a set of steps, as the agents measured them.

    Attributes:
        iterations: Steps averaged (each measured on every rank).
        first_step: First step included (None without steps).
        last_step: Last step included.
        time_s: Mean over steps of the slowest rank's step time (s).
        energy_j: Mean over steps of the energy summed over the job's GPUs (J).
        pipeline_energy_j: Pipeline (dp index) -> mean energy of its GPUs per step (J).
        versions: The schedule versions the steps ran under.
        median_time_s: Median over steps of the slowest rank's step time (s): what the
            iteration takes without the occasional hiccup of a busy machine.
    """

    iterations: int
    first_step: int | None
    last_step: int | None
    time_s: float
    energy_j: float
    pipeline_energy_j: dict[int, float]
    versions: list[int | None]
    median_time_s: float = math.nan

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN as None)."""
        return {
            "iterations": self.iterations, "first_step": self.first_step,
            "last_step": self.last_step, "time_per_iteration_s": finite(self.time_s),
            "median_time_per_iteration_s": finite(self.median_time_s),
            "energy_per_iteration_j": finite(self.energy_j),
            "energy_per_iteration_by_pipeline_j": {
                str(d): finite(e) for d, e in sorted(self.pipeline_energy_j.items())},
            "schedule_versions": self.versions,
        }


def finite(x: float | None) -> float | None:
    """`x` for a JSON summary: None when it is missing, NaN or infinite."""
    return x if x is not None and math.isfinite(x) else None


def window_stats(
    steps: Mapping[tuple[int, int], StepRecord],
    rank_pipeline: Mapping[int, int],
    versions: Sequence[int | None],
    skip: int = 0,
    after_step: int = -1,
    limit: int | None = None,
) -> Side:
    """Per-iteration time and energy of the steps every rank ran under one of `versions`.

    A step counts when every rank has a measurement of it, all under one of `versions`, and it
    is after `after_step`; the first `skip` of those are left out (the switch), then at most
    `limit` are kept. Energies telescope: over consecutive steps the coarse counter's error
    stays that of two counter updates per GPU.

    Args:
        steps: (rank, step) -> the agent's measurement.
        rank_pipeline: Rank -> its pipeline (dp index); the job's ranks.
        versions: Schedule versions accepted.
        skip: Leading qualifying steps left out.
        after_step: Only steps after this one.
        limit: Most steps kept (None: all).
    """
    ranks = sorted(rank_pipeline)
    wanted = set(versions)
    numbers = sorted({s for (_, s) in steps if s > after_step})
    picked: list[int] = []
    for n in numbers:
        recs = [steps.get((r, n)) for r in ranks]
        if any(rec is None for rec in recs):
            continue
        if all(rec is not None and rec.version in wanted for rec in recs):
            picked.append(n)
    picked = picked[skip:]
    if limit is not None:
        picked = picked[:limit]
    if not picked:
        return Side(0, None, None, math.nan, math.nan, {}, list(versions))
    times = [max(steps[(r, n)].time_s for r in ranks) for n in picked]
    energies = [sum(steps[(r, n)].energy_j for r in ranks) for n in picked]
    by_pipeline = {
        d: statistics.fmean(sum(steps[(r, n)].energy_j for r in ranks if rank_pipeline[r] == d)
                            for n in picked)
        for d in sorted(set(rank_pipeline.values()))
    }
    return Side(len(picked), picked[0], picked[-1], statistics.fmean(times),
                statistics.fmean(energies), by_pipeline, list(versions),
                statistics.median(times))


def pct_less(before: float, after: float) -> float:
    """(before - after) / before in % (NaN when undefined)."""
    return (before - after) / before * 100.0 if before > 0 and math.isfinite(after) else math.nan


def pct_more(before: float, after: float) -> float:
    """(after - before) / before in % (NaN when undefined)."""
    return (after - before) / before * 100.0 if before > 0 and math.isfinite(after) else math.nan
