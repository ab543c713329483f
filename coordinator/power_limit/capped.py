"""Profiling under a power budget's cap: only the limits at or under it (pure).

A budget caps a job's GPUs while it is still profiling (`coordinator.budget`): the agents clamp
every limit to the cap, so a window at a limit above it would measure the cap, not its limit.
`CapDetour` is the part of `PowerLimitStateMachine` that keeps the search under the cap:

* while capped, every limit at or under the cap that was neither measured nor tried yet is
  profiled first, one full window each, highest first (Zeus's sweep, restricted to the
  share): a *detour* from the search;
* then the search goes on as long as it asks for limits at or under the cap; the first probe
  it asks for above the cap is *held*, and the machine parks: it waits, at the best limit
  measured at or under the cap (`parked_limit`), for the cap to lift (or rise);
* a redo queued for a limit above the cap waits in its queue;
* once the cap is lifted, the held probe, the waiting redos and the rest of the search run as
  they would have: the job ends at its own optimum over every limit, as without a budget.

The search counts the windows it started (`Search.next_probe(results, started)`): the detour's
windows are not its own, so it is told `started - offset` (`offset`: detour windows less the
exhaustive search's probes skipped because the detour measured their limit: Zeus's sweep never
measures a limit twice).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from coordinator.power_limit.errors import PowerLimitError
from coordinator.power_limit.search import Probe, Search, WindowResult
from coordinator.power_limit.selectors import OptimumSelector
from zeus_agent.models import PowerLimitMeasurement

if TYPE_CHECKING:  # (The machine imports this module.)
    from coordinator.power_limit.machine import PowerLimitStateMachine


class Limited(Protocol):
    """A window closed but not recorded yet (the machine's pending windows)."""

    @property
    def power_limit(self) -> int: ...  # noqa: D102


class CapDetour:
    """The cap a job's GPUs are held to (None: none) and the detour it makes in the search."""

    def __init__(self, offset: int = 0) -> None:
        self.cap_w: int | None = None
        self.offset = offset
        """Windows the detour added less the search's probes skipped (`resume_state`)."""
        self.held: Probe | None = None
        """The search's probe above the cap, run once the cap lifts."""
        self.parked = False
        """The last `next_probe` found nothing at or under the cap while more remains."""
        self.last_was_detour = False
        self._tried: set[int] = set()

    def above(self, power_limit: int) -> bool:
        """Whether `power_limit` is above the cap (never, without one)."""
        return self.cap_w is not None and power_limit > self.cap_w

    def first_redo(self, queue: Sequence[Probe]) -> int | None:
        """Index of the first queued redo at or under the cap, None if none."""
        self.parked = False
        return next((i for i, p in enumerate(queue) if not self.above(p.power_limit)), None)

    def next_probe(self, search: Search, results: Sequence[WindowResult], started: int,
                   limits: Sequence[int], window: tuple[int, int], exhaustive: bool,
                   pending: Iterable[Limited] = ()) -> Probe | None:
        """The next probe: the held one, a detour's, or the search's at or under the cap.

        `limits`: the candidates, highest first; `window`: a detour's (warm-up, profile) steps;
        `exhaustive`: the search is Zeus's sweep; `pending`: the windows closed but not
        recorded yet (their limits count as measured). None with `parked` set: nothing more under
        the cap, the rest waits for the lift; None without: the search is over.
        """
        self.parked = False
        self.last_was_detour = False
        if self.held is not None and not self.above(self.held.power_limit):
            held, self.held = self.held, None
            return held
        # (Zeus's sweep asks before a window is recorded: a pending one is measured.)
        measured = {r.power_limit for r in results} | {p.power_limit for p in pending}
        if self.cap_w is not None:
            detour = next((w for w in limits if w <= self.cap_w and w not in measured
                           and w not in self._tried), None)
            if detour is not None:
                self._tried.add(detour)
                self.offset += 1
                self.last_was_detour = True
                return Probe(detour, *window)
        if self.held is not None:  # (Above the cap: it waits.)
            self.parked = True
            return None
        probe = search.next_probe(results, started - self.offset)
        while exhaustive and probe is not None and (probe.power_limit in measured
                                                    or probe.power_limit in self._tried):
            self.offset -= 1  # (Zeus's sweep never measures a limit twice.)
            probe = search.next_probe(results, started - self.offset)
        if probe is not None and self.above(probe.power_limit):
            self.held, self.parked = probe, True
            return None
        return probe

    def put_back(self, probe: Probe, redos: list[Probe] | None) -> None:
        """A probe begun above a new cap is abandoned, not counted: back where it came from.

        `redos`: the machine's redo queue if it was a redo (it goes first again).
        """
        if redos is not None:
            redos.insert(0, probe)
        elif self.last_was_detour:
            self.offset -= 1
            self._tried.discard(probe.power_limit)
        elif self.held is None:
            self.held = probe

    def waiting_limit(self, limits: Sequence[int], measured: Sequence[PowerLimitMeasurement],
                      selector: OptimumSelector) -> int:
        """The limit to run at while nothing is measured (`limits`: highest first).

        Uncapped: the highest (as Zeus's GPUs between windows). Capped: the selector's choice
        among the limits measured at or under the cap, else the highest limit at or under it.
        """
        if self.cap_w is None:
            return limits[0]
        under = [m for m in measured if not self.above(m.power_limit)]
        try:
            return selector.select(under) if under else self._highest_under(limits)
        except (ValueError, PowerLimitError):  # (A user's own selector, say.)
            return self._highest_under(limits)

    def _highest_under(self, limits: Sequence[int]) -> int:
        under = [w for w in limits if not self.above(w)]
        return under[0] if under else limits[-1]


def cap_message(machine: PowerLimitStateMachine) -> str:
    """What a job's status says of its cap (just set, changed or lifted)."""
    measured = {m.power_limit for m in machine.measurements}
    left = [w for w in machine.power_limits if w not in measured]
    cap = machine.cap_w
    if cap is None:
        return (f"power budget lifted: profiling goes on over every limit "
                f"({len(left)} not measured yet)")
    above = [w for w in left if w > cap]
    wait = (f"; the {len(above)} above it ({above[0]}..{above[-1]} W) are profiled once the "
            "budget lifts" if above else "")
    if machine.parked:
        return (f"capped at {cap} W by a power budget: every limit at or under it is measured, "
                f"the GPUs run at {machine.current_power_limit} W meanwhile{wait}")
    under = len(left) - len(above)
    return (f"capped at {cap} W by a power budget: profiling only the limits at or under it "
            f"({under} to measure){wait}")
