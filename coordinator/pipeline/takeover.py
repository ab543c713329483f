"""What a replica taking a pipeline job over resumes from: its record, the rounds kept. Pure.

The record (`progress_record`, read back by `read_progress`) holds each rank's instruction
order, the observed rounds and the straggler notices. A replica taking a job over feeds its
scheduler the rounds of results the previous owner's observed (a scheduler is deterministic:
fed the same rounds, it reaches the same state). Every round that leads to a plan is kept (a
replay re-plans from them), and of the windows served under an unchanged plan (a scheduler
that keeps watching it, e.g. Perseus' drift watch) the first one (Perseus' baseline) and the
latest `SERVED_ROUNDS_KEPT` (or the scheduler's `replan_window`, at most
`MAX_SERVED_ROUNDS_KEPT`): the ones between are given back, so a plan served for ever keeps a
bounded number of rounds (`KeptRounds`). What is kept is charged to the job's `Kept`
(`coordinator.pipeline.memory`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.optimizer import WriteFile
from coordinator.pipeline.memory import Kept, result_bytes
from coordinator.pipeline.phase import Phase
from zeus_agent.models import ProfilingResult

if TYPE_CHECKING:
    from coordinator.optimizer import Action
    from coordinator.pipeline.job import PipelineJob

__all__ = [
    "MAX_SERVED_ROUNDS_KEPT",
    "MAX_VERSION_LEAD",
    "SERVED_ROUNDS_KEPT",
    "KeptRounds",
    "catch_up",
    "Progress",
    "progress_record",
    "read_progress",
    "replay",
    "resumed_version",
]

SERVED_ROUNDS_KEPT = 8
"""Latest served windows of a plan kept for a takeover to replay (besides its first one); at
least the scheduler's `replan_window` (Perseus), at most `MAX_SERVED_ROUNDS_KEPT`."""
MAX_SERVED_ROUNDS_KEPT = 64


class KeptRounds:
    """The rounds one job keeps (see the module docstring), oldest first, in `rounds`."""

    def __init__(self, kept: Kept) -> None:
        self.kept = kept
        self.rounds: list[list[ProfilingResult]] = []
        self.asked = []
        self._served_from: int | None = None
        """Index in `rounds` of the first window served under the current plan (None when
        no plan is being served with unchanged schedules)."""

    asked: list[int]
    """Where a re-profile was asked from outside (`budget_point.reprofile`): before the round
    of that index (the one it ends, not served: the rounds before it are not pruned since)."""

    def __len__(self) -> int:
        return len(self.rounds)

    def keep(self, results: list[ProfilingResult], served: bool, replan_window: int) -> str | None:
        """Keep one observed round, charged to `Kept`; why not, or None.

        `served`: a window served under an unchanged plan; `replan_window`: the scheduler's.
        """
        for result in results:
            why = self.kept.take(result.rank, result_bytes(result))
            if why is not None:
                return why
        if not served:
            self._served_from = None  # A new plan (or profiling): its rounds all count.
            self.rounds.append(results)
            return None
        if self._served_from is None:
            self._served_from = len(self.rounds)
        self.rounds.append(results)
        tail = min(max(SERVED_ROUNDS_KEPT, replan_window), MAX_SERVED_ROUNDS_KEPT)
        while len(self.rounds) - self._served_from - 1 > tail:
            for result in self.rounds.pop(self._served_from + 1):
                self.kept.give(result.rank, result_bytes(result))
        return None

    def clear(self) -> None:
        """Forget every round (what they were charged is let go with the job's `Kept`)."""
        self.rounds.clear()
        self.asked.clear()
        self._served_from = None


@dataclass(frozen=True)
class Progress:
    """A job's recorded progress, read back (`read_progress`)."""

    first_version: int | None
    """The first schedule version (None: not recorded)."""
    orders: dict[int, list[str]]
    """Rank -> its instruction names, in order."""
    rounds: list[list[ProfilingResult]]
    notices: dict[int, float]
    """Pipeline -> straggler factor noticed."""
    version: int | None = None
    """The last schedule version installed (None: none, or recorded before it was kept)."""
    asked: tuple[int, ...] = ()
    """Before which rounds a re-profile was asked from outside (`KeptRounds.asked`)."""


def progress_record(first_version: int, orders: Mapping[int, list[str]],
                    rounds: Sequence[list[ProfilingResult]],
                    notices: Mapping[int, float], version: int | None = None,
                    asked: Sequence[int] = ()) -> dict[str, Any]:
    """The JSON-ready record of a job's progress (`asked` only when a re-profile was)."""
    return {
        "first_version": first_version,
        "version": version,
        **({"asked": list(asked)} if asked else {}),
        "orders": {str(r): names for r, names in sorted(orders.items())},
        "rounds": [[r.model_dump(mode="json") for r in results] for results in rounds],
        "notices": {str(d): f for d, f in sorted(notices.items())},
    }


def read_progress(state: Mapping[str, Any]) -> Progress:
    """A record `progress_record` wrote, read back.

    Raises:
        ValueError: The record is malformed.
    """
    try:
        first = state.get("first_version")
        return Progress(
            first_version=None if first is None else int(first),
            orders={int(r): [str(n) for n in names] for r, names in state["orders"].items()},
            rounds=[[ProfilingResult(**r) for r in results] for results in state["rounds"]],
            notices={int(d): float(f) for d, f in state.get("notices", {}).items()},
            version=None if state.get("version") is None else int(state["version"]),
            asked=tuple(sorted({int(i) for i in state.get("asked", ())})),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"recorded progress unreadable: {e}") from None


def replay(job: PipelineJob, recorded: Progress) -> list[Action]:
    """Feed a resumed job's scheduler the recorded rounds; the files it produced meanwhile.

    A re-profile asked from outside is asked again before the round it was asked before (one
    asked after the last round, again at the end). What the replay's other actions did is done
    already; the files its scheduler produced (a frontier planned again) are written when the
    job starts.
    """
    files: list[Action] = []
    for i, results in enumerate(recorded.rounds):
        if job.phase.final:
            break
        if i in recorded.asked and job.scheduler is not None:
            job.scheduler.reprofile()
        files += [a for a in job._observe(results) if isinstance(a, WriteFile)]
    if len(recorded.rounds) in recorded.asked and job.scheduler is not None:
        job.scheduler.reprofile()
    job.kept_rounds.asked = [i for i in recorded.asked if i <= len(job.kept_rounds)]
    return files


def resumed_version(replayed: int | None, recorded: int | None) -> int | None:
    """The schedule version a job taken over installs: above the last one installed before.

    The replay of the recorded rounds reaches the plans' versions, but not the versions of
    schedules installed for no round (a budget's frontier point, a straggler's): those put the
    agents ahead of the replay, and a trainer takes only a version above the one it runs. So
    the job's schedules go out as the next version after the recorded one (and the replay's
    own number where it is not behind).
    """
    if replayed is None or recorded is None or recorded <= replayed:
        return replayed
    return recorded + 1


MAX_VERSION_LEAD = 64
"""How far above a resumed job's version a rank's measurements may say their trainer runs for
the job to catch up (`catch_up`); a wilder version is dropped like a stale one."""


def catch_up(job: PipelineJob, version: int | None) -> list[Action]:
    """A resumed job's answer to a measurement of another schedule version than its own.

    A job's progress is recorded after its install goes out, so a replica that died in between
    left a record behind what the trainers run; they take only a version above theirs, and
    the new owner would drop every measurement of theirs for ever. A version ahead (within
    `MAX_VERSION_LEAD`) renumbers the job: its schedules go out again above it. Any other
    version (before the switch, stale) is not what is profiled: nothing.
    """
    current = job.version
    if (not job.resumed or current is None or version is None or not job.schedules
            or not current < version <= current + MAX_VERSION_LEAD):
        return []
    job.version = version
    state = "serving" if job.phase is Phase.SERVING else "profiling"
    return job._install([job.schedules[r] for r in sorted(job.schedules)], state,
                        f"the trainers run schedule {version}, recorded before the takeover "
                        "as an older one: its schedules again")
