"""A pipeline job's phases and the transitions between them, kept as data. Pure.

`PipelineJob` (`coordinator.pipeline.job`) is in one phase at a time:

* `discovering`: learning each rank's instruction order; nothing installed yet;
* `profiling`: running the scheduler's schedules, one version after another, and giving it
  their results;
* `serving`: running a plan: a finished scheduler's last schedules, or the plan a watching
  scheduler serves (Perseus), with the other pipelines slowed down while a straggler is known;
* `error`, `stopped`: the optimisation stopped and the job's schedules were cleared: `error`
  when something went wrong, `stopped` when the job went away (its trainers left).

`TRANSITIONS` lists the phases each phase may go to. The job checks every change against it
(`check_transition`): a change the table does not list is a bug, and raises `PhaseError`
instead of leaving the job in a state nobody designed. A phase is a `str` whose value is the
word the job's status and progress have always carried ("serving", ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

__all__ = ["TRANSITIONS", "Phase", "PhaseError", "check_transition"]


class Phase(StrEnum):
    """Where a pipeline job's optimisation stands (its value is the status's word)."""

    DISCOVERING = "discovering"
    PROFILING = "profiling"
    SERVING = "serving"
    ERROR = "error"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        """Whether the optimisation has stopped (`error` or `stopped`)."""
        return self in _FINAL


_FINAL = frozenset({Phase.ERROR, Phase.STOPPED})

TRANSITIONS: Mapping[Phase, frozenset[Phase]] = MappingProxyType({
    # Every rank's order is known: the scheduler's first schedules are installed.
    Phase.DISCOVERING: frozenset({Phase.PROFILING, *_FINAL}),
    # Schedule n + 1; the scheduler finished or serves a plan.
    Phase.PROFILING: frozenset({Phase.PROFILING, Phase.SERVING, *_FINAL}),
    # A new plan or a straggler's schedules; the scheduler profiles again (Perseus' drift).
    Phase.SERVING: frozenset({Phase.SERVING, Phase.PROFILING, *_FINAL}),
    # Stopped again (an abort of a stopped job clears its schedules again, says why again).
    Phase.ERROR: _FINAL,
    Phase.STOPPED: _FINAL,
})
"""Phase -> the phases it may change to (itself included where a phase repeats)."""


class PhaseError(RuntimeError):
    """A phase change `TRANSITIONS` does not allow (a bug in the job)."""


def check_transition(old: Phase, new: Phase | str) -> Phase:
    """`new` as a `Phase`, when `TRANSITIONS` lets `old` change to it.

    Raises:
        PhaseError: Not a phase, or a change the table does not list.
    """
    try:
        phase = Phase(new)
    except ValueError:
        raise PhaseError(f"{new!r} is not a pipeline job phase "
                         f"({', '.join(p.value for p in Phase)})") from None
    if phase not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(p.value for p in TRANSITIONS[old]))
        raise PhaseError(f"a pipeline job cannot go from {old.value} to {phase.value} "
                         f"(from {old.value}: {allowed})")
    return phase
