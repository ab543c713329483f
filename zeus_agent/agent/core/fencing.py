"""`CommandFence`: which commands a GPU takes, by their sender's ownership lease (pure).

A command can reach a GPU long after its sender passed its own ownership check: held in a
TCP connection through a partition and delivered at the heal, or queued in a replica's
process while it was paused (SIGSTOP) and sent as it resumed. By then another replica may own
the job. The command's `Zeus-Lease` header (`zeus_agent.wire.fencing.SenderLease`) is its
fencing token, and the agent refuses it when:

* its lease has ended by the agent's clock, less `skew_s` (`until - skew_s <= now`): fencing by
  time assumes the agent's clock lags the coordinators' by at most `skew_s` (a lagging agent
  would otherwise take a command after another replica took the job); or
* the agent has already taken, for the same lease key on this GPU, a command under a newer
  revision from another owner (a monotonic token: the newer owner's commands win, whatever
  the clocks say). A lower revision from the owner and incarnation of the newest one is that
  owner's own earlier lease, checked by time only.

What is remembered of a key is forgotten once its newest lease has ended by the agent's clock:
every older lease ended before it (a replica takes a job only once its lease ran out), so the
time rule refuses their commands, and a key whose revisions start again (a state bucket made
anew) is not refused forever. At most `capacity` keys are remembered (oldest dropped first).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeus_agent.wire.fencing import SenderLease

__all__ = ["DEFAULT_SKEW_S", "CommandFence", "Fenced"]

DEFAULT_SKEW_S = 0.1
"""How far the agent's clock may lag the coordinators' (s), by default."""


@dataclass(frozen=True)
class Fenced:
    """Why a command was refused, in words for its sender."""

    reason: str


class CommandFence:
    """The newest lease taken per lease key on one GPU, and the refusal rules above."""

    def __init__(self, skew_s: float = DEFAULT_SKEW_S, capacity: int = 256) -> None:
        if not skew_s >= 0:  # (NaN too)
            raise ValueError(f"skew_s must be a number >= 0, not {skew_s!r}")
        self.skew_s = skew_s
        self.capacity = capacity
        self._newest: dict[str, SenderLease] = {}
        """Lease key -> the newest lease a command was taken under, oldest key first."""

    def admit(self, lease: SenderLease, now_s: float) -> Fenced | None:
        """None: take the command (its lease is remembered); else why it is refused."""
        left_s = lease.until - now_s
        if left_s <= self.skew_s:
            ended = (f"ended {-left_s:.3f} s ago" if left_s <= 0
                     else f"ends in {left_s:.3f} s, within the allowed clock skew of "
                          f"{self.skew_s:g} s")
            return Fenced(f"the sender's lease ({_who(lease)}) {ended} by this agent's clock")
        newest = self._newest.get(lease.key)
        if newest is not None and newest.until <= now_s:
            del self._newest[lease.key]
            newest = None
        if newest is not None and lease.revision < newest.revision and not _same(lease, newest):
            return Fenced(f"the sender's lease ({_who(lease)}) is older than {_who(newest)}'s, "
                          "whose commands this GPU already took")
        if newest is None or lease.revision >= newest.revision:
            self._newest.pop(lease.key, None)
            self._newest[lease.key] = lease
            while len(self._newest) > self.capacity:
                del self._newest[next(iter(self._newest))]
        return None

    def newest(self, key: str) -> SenderLease | None:
        """The newest lease taken for `key` and still remembered."""
        return self._newest.get(key)


def _same(a: SenderLease, b: SenderLease) -> bool:
    return a.owner == b.owner and a.incarnation == b.incarnation


def _who(lease: SenderLease) -> str:
    return f"{lease.owner}, revision {lease.revision}"
