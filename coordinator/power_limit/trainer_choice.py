"""A user's own optimum selector, run where the user's code lives (pure).

Zeus 0.16 lets users subclass `OptimumSelector`. Their code runs in the trainer, not here: when
the profile is complete, the job asks rank 0's process (`AskSelector`, carried to it by its
node's agent), whose drop-in runs the selector on the measurements and answers with a
`selection` event of its rank. Meanwhile the GPUs stay at the highest limit measured
(`DeferredSelector`, the machine's stand-in selector). A selector that fails, a limit that was
not profiled, a rank 0 that is gone (its agent says so) or that does not answer within
`selector_timeout_s` fall back to the built-in `ZeusCost` of the job's options, and the job's
status says why. The choice is recorded with the profile, so a replica taking the job over pins
it without asking again.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.optimizer import Action, AskSelector, StatusUpdate
from coordinator.power_limit.machine import (
    Effect,
    PowerLimitError,
    PowerLimitStateMachine,
    ProfileRangeError,
)
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.selectors import OptimumSelector, ZeusCost
from zeus_agent.wire.messages import PowerLimitOptions

__all__ = ["DeferredSelector", "TrainerChoice"]


class DeferredSelector(OptimumSelector):
    """The machine's stand-in while rank 0 chooses: the highest limit measured.

    (What GPUs run at between windows, too.)
    """

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        """The highest measured limit (W).

        Raises:
            ValueError: `measurements` is empty.
        """
        if not measurements:
            raise ValueError("measurements must not be empty: profile at least one power limit.")
        return max(m.power_limit for m in measurements)


@dataclass
class TrainerChoice:
    """Where the choice of one job stands: asked, answered, or fallen back.

    Attributes:
        rank: The rank whose process chooses (the job's first).
        description: The selector as its trainer shows it, for statuses.
        timeout_s: How long rank 0 has to answer.
        fallback: What chooses instead.
        chosen: The limit pinned (W), once known.
        asked: (request number, when) of the question awaiting its answer.
    """

    rank: int
    description: str
    timeout_s: float
    fallback: OptimumSelector
    chosen: int | None = None
    asked: tuple[int, float] | None = None
    requests: int = 0

    @classmethod
    def of(cls, options: PowerLimitOptions, rank: int, world_size: int,
           chosen: int | None = None) -> TrainerChoice:
        """The choice of a job with `options` (selector "Custom")."""
        return cls(rank=rank, description=options.custom_selector or "a custom selector",
                   timeout_s=options.selector_timeout_s,
                   fallback=ZeusCost(eta_knob=options.eta_knob,
                                     world_size=options.world_size or world_size),
                   chosen=chosen)

    @property
    def waiting(self) -> bool:
        """Whether a question awaits its answer."""
        return self.chosen is None and self.asked is not None

    def ask(self, measurements: list[PowerLimitMeasurement], now_s: float,
            progress: dict[str, object]) -> list[Action]:
        """Ask rank 0's process to choose from `measurements`."""
        self.requests += 1
        self.asked = (self.requests, now_s)
        return [
            AskSelector(self.rank, self.requests, tuple(measurements)),
            StatusUpdate("selecting", f"profile complete: asking rank {self.rank}'s process to "
                         f"choose with {self.description} (at its next step or epoch end; the "
                         f"GPUs stay at {max(m.power_limit for m in measurements)} W meanwhile)",
                         progress),
        ]

    def answers(self, rank: int, request: int) -> bool:
        """Whether a `selection` of `rank` answers the question awaiting (not a stale one)."""
        return self.waiting and rank == self.rank and self.asked is not None and (
            request == self.asked[0])

    def settle(self, machine: PowerLimitStateMachine, limit: int | None,
               why: str) -> tuple[list[Effect], str]:
        """Pin `limit` on the done `machine` (rank 0's choice), or the fallback's choice.

        The fallback chooses because of `why`, or when `limit` was not profiled. Returns the
        effects, and how the limit was chosen (for the status).
        """
        how = f"chosen by {self.description} in rank {self.rank}'s process"
        effects = None
        if limit is not None:
            try:
                effects = machine.choose(limit)
            except ProfileRangeError as e:
                why = f"{self.description} chose {limit} W: {e}"
        if effects is None:
            limit = self.fallback.select(machine.measurements)
            effects = machine.choose(limit)
            how = f"chosen by the built-in {self.fallback!r} instead: {why}"
        self.chosen = limit
        return effects, how

    def pin_recorded(self, machine: PowerLimitStateMachine) -> tuple[list[Effect] | None, str]:
        """Pin the choice recorded before a takeover on the done `machine`.

        Returns its effects and the status to say, or (None, why not) when there is none to
        pin (nothing recorded: "", or a record that does not match the profile: said).
        """
        if self.chosen is None:
            return None, ""
        limit = self.chosen
        try:
            effects = machine.choose(limit)
        except PowerLimitError as e:  # (A record that does not match its profile.)
            self.chosen = None
            return None, f"the recorded choice cannot be pinned ({e})"
        return effects, (f"optimal power limit {limit} W pinned (chosen with "
                         f"{self.description} before a takeover)")

    def overdue(self, now_s: float) -> bool:
        """Whether the question has waited longer than `timeout_s`."""
        return self.waiting and self.asked is not None and now_s - self.asked[1] > self.timeout_s
