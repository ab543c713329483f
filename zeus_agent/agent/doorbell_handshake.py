"""The doorbell's handshake: which of its reading thread and the event loop applies a change.

The loop, having handled instruction k, *arms* the doorbell for k + 1 (`Handshake.arm`). The
reading thread, finding k + 1's `instruction_begin`, *takes* the arm (`take`) and rings the GPU's
clock lane, which asks the handshake's last word (`accept`) just before it applies the change.
The loop, handling the same event, *claims* the instruction (`claim`): it learns the clock the
thread applied, or takes the arm itself, or *vetoes* a change taken and not yet accepted.

One instruction k is in one of five phases (`Handshake.phase(k)`):

* `IDLE`: nothing armed, taken or rung for k; the loop applies k's clock.
* `ARMED`: the loop armed k; the thread may take it, or the loop claim it first.
* `TAKEN`: the thread took k's arm; the lane has not accepted its change yet.
* `RUNG`: the lane accepted the thread's change for k; the loop's claim is told its clock.
* `VETOED`: the loop claimed k while it was taken: the lane's accept is refused.

Transitions (`TRANSITIONS`, (phase, event) -> (next phase, result); `arm_next` arms another
instruction; `tests/core/test_doorbell_handshake.py` holds this table and the code to each
other):

    phase   event     next    result
    IDLE    arm       ARMED   -
    IDLE    arm_next  IDLE    -
    IDLE    disarm    IDLE    -
    IDLE    forget    IDLE    -
    IDLE    take      IDLE    False
    IDLE    accept    RUNG    True
    IDLE    claim     IDLE    None
    ARMED   arm       ARMED   -
    ARMED   arm_next  IDLE    -
    ARMED   disarm    IDLE    -
    ARMED   forget    IDLE    -
    ARMED   take      TAKEN   True
    ARMED   claim     IDLE    None
    TAKEN   arm_next  TAKEN   -
    TAKEN   disarm    TAKEN   -
    TAKEN   forget    IDLE    -
    TAKEN   accept    RUNG    True
    TAKEN   claim     VETOED  None
    RUNG    arm_next  RUNG    -
    RUNG    disarm    RUNG    -
    RUNG    forget    IDLE    -
    RUNG    claim     IDLE    mhz
    VETOED  arm_next  VETOED  -
    VETOED  disarm    VETOED  -
    VETOED  forget    IDLE    -
    VETOED  accept    VETOED  False
    VETOED  claim     VETOED  None

Results: `take` and `accept` say whether the thread goes on; `claim` returns the clock the
thread applied (`mhz`) or None, and the loop then applies its own.

Invariants:

* Every transition runs under the doorbell's lock. The thread also reads `arm` without it (one
  attribute read) to decide whether to look for the instruction and when to spin; a stale read
  is settled by `take`, which takes only the arm still in place.
* Exactly one side applies an armed change. `take` and a claim of an `ARMED` instruction
  exclude each other (the arm leaves its slot); once taken, `accept` and `claim` exclude each
  other: accepted first (`RUNG`), the claim returns the thread's clock; claimed first
  (`VETOED`), the accept is refused. The lane may also drop a taken change before it asks
  (a newer change was asked for): the instruction stays `TAKEN` until claimed (`VETOED`) or
  forgotten, and the loop applies its own clock.
* An arm is a forecast: whatever `claim` returns, the loop applies the clock its event wants
  if it differs (the doorbell's caller does).
* `forget` (another schedule, trainer or none) returns every instruction to `IDLE`. A change
  taken before it may still be accepted (`IDLE` -> `RUNG`): the lane's own checks (`asked`, the
  epoch) drop a stale one.
* One slot per role: the arm (the next instruction), and the thread's last taken, rung and
  vetoed instruction. So an instruction `VETOED` or `RUNG` coexists with the next one `ARMED`.
* The protocol the table covers: the loop arms an instruction only while it is `IDLE` or
  `ARMED` (the one after the last it claimed, or the first after `forget`); only the thread
  that read an arm takes it; the lane accepts once per ring of a taken change. Outside it the
  phase of an instruction in several slots is the first of `RUNG`, `TAKEN`, `VETOED`, `ARMED`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, NamedTuple

__all__ = ["Arm", "Handshake", "Phase", "TRANSITIONS"]


class Arm(NamedTuple):
    """The change the next ring may apply: `pid`'s instruction `instruction`, named `name`."""

    pid: int
    instruction: int
    name: str
    mhz: int
    epoch: int
    asked: int
    """The lane's `asked` when armed: a change the loop asks for later makes this one stale."""
    spin: tuple[int, int] | None = None
    """When the reading thread spins for it (monotonic ns, from, until); None: it sleeps."""


class Phase(enum.Enum):
    """Where one instruction is in the handshake (see the module's docstring)."""

    IDLE = "IDLE"
    ARMED = "ARMED"
    TAKEN = "TAKEN"
    RUNG = "RUNG"
    VETOED = "VETOED"


_I, _A, _T, _R, _V = Phase.IDLE, Phase.ARMED, Phase.TAKEN, Phase.RUNG, Phase.VETOED

TRANSITIONS: Final[Mapping[tuple[Phase, str], tuple[Phase, str]]] = {
    (_I, "arm"): (_A, "-"),
    (_I, "arm_next"): (_I, "-"),
    (_I, "disarm"): (_I, "-"),
    (_I, "forget"): (_I, "-"),
    (_I, "take"): (_I, "False"),
    (_I, "accept"): (_R, "True"),
    (_I, "claim"): (_I, "None"),
    (_A, "arm"): (_A, "-"),
    (_A, "arm_next"): (_I, "-"),
    (_A, "disarm"): (_I, "-"),
    (_A, "forget"): (_I, "-"),
    (_A, "take"): (_T, "True"),
    (_A, "claim"): (_I, "None"),
    (_T, "arm_next"): (_T, "-"),
    (_T, "disarm"): (_T, "-"),
    (_T, "forget"): (_I, "-"),
    (_T, "accept"): (_R, "True"),
    (_T, "claim"): (_V, "None"),
    (_R, "arm_next"): (_R, "-"),
    (_R, "disarm"): (_R, "-"),
    (_R, "forget"): (_I, "-"),
    (_R, "claim"): (_I, "mhz"),
    (_V, "arm_next"): (_V, "-"),
    (_V, "disarm"): (_V, "-"),
    (_V, "forget"): (_I, "-"),
    (_V, "accept"): (_V, "False"),
    (_V, "claim"): (_V, "None"),
}
"""(phase of instruction k, event for k) -> (its next phase, the event's result), as data."""


class Handshake:
    """The handshake's state: four slots, changed only under the doorbell's lock.

    Pure: no lock, thread or clock of its own; `ClockDoorbell` holds the lock around each call.

    Attributes:
        arm: The armed change (the loop's forecast of the next instruction), or None.
        taken: The instruction whose arm the thread took and the lane has not accepted yet.
        rung: (instruction, MHz) of the last change the thread took and the lane accepted,
            until the loop's claim of it or `forget`.
        vetoed: An instruction the loop claimed while it was taken: never accepted.
    """

    __slots__ = ("arm", "rung", "taken", "vetoed")

    def __init__(self) -> None:
        self.arm: Arm | None = None
        self.taken: int | None = None
        self.rung: tuple[int, int] | None = None
        self.vetoed: int | None = None

    # The loop's side.
    def set_arm(self, arm: Arm | None) -> None:
        """`arm` (`arm`, `arm_next`) or, with None, `disarm`: the next ring applies nothing."""
        self.arm = arm

    def forget(self) -> None:
        """Every instruction back to `IDLE`."""
        self.arm = None
        self.rung = self.taken = self.vetoed = None

    def claim(self, instruction: int) -> tuple[Phase, int | None]:
        """The loop handles `instruction`'s event: its phase then, and the thread's clock.

        `RUNG`: the clock the thread applied. `TAKEN`: vetoed, None. `ARMED`: the arm is the
        loop's, None. Otherwise nothing changes, None. On None the loop applies its clock.
        """
        if self.rung is not None and self.rung[0] == instruction:
            mhz = self.rung[1]
            self.rung = None
            return Phase.RUNG, mhz
        if self.taken == instruction:  # Taken, not accepted yet: it never will be.
            self.vetoed, self.taken = instruction, None
            return Phase.TAKEN, None
        if self.arm is not None and self.arm.instruction == instruction:
            self.arm = None
            return Phase.ARMED, None
        return (Phase.VETOED if self.vetoed == instruction else Phase.IDLE), None

    # The thread's side.
    def take(self, arm: Arm) -> bool:
        """The thread found `arm`'s instruction: take it, unless it is no longer the arm."""
        if self.arm is not arm:
            return False  # The loop claimed it (its event came first), re-armed or disarmed.
        self.arm = None
        self.taken = arm.instruction
        return True

    def accept(self, instruction: int, mhz: int) -> bool:
        """The lane is about to apply the thread's change: go on, unless the loop vetoed it."""
        if self.vetoed == instruction:
            return False  # The loop handled the event first: its clock stands.
        self.rung, self.taken = (instruction, mhz), None  # The loop's claim will say so.
        return True

    # A view.
    def phase(self, instruction: int) -> Phase:
        """Where `instruction` is (several slots: the first of RUNG, TAKEN, VETOED, ARMED)."""
        if self.rung is not None and self.rung[0] == instruction:
            return Phase.RUNG
        if self.taken == instruction:
            return Phase.TAKEN
        if self.vetoed == instruction:
            return Phase.VETOED
        if self.arm is not None and self.arm.instruction == instruction:
            return Phase.ARMED
        return Phase.IDLE
