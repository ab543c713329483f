"""A GPU's node cap: the budget's ceiling on every power limit the agent sets (pure).

A budget reaches an agent as a cap per GPU with a lease of its own, held by the budget, not by
any job: the cap outlives the job's lease, the coordinator, the bus and the trainer, and ends
only when its lease runs out (the budget's end, or no renewal: the budget was lifted) or it is
replaced. While it holds, every limit is clamped to it; a cap above the GPU's maximum is no
cap, one below its minimum holds the minimum (the coordinator never sends one: it refuses caps
under the group's floor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeCap:
    """One GPU's cap (W), who set it (a budget id) and until when (monotonic ns)."""

    cap_w: int
    holder: str
    deadline_ns: int


class CapHolder:
    """The cap of one GPU, if any: set, renewed, expired, applied to limits."""

    def __init__(self, min_limit_w: int, max_limit_w: int) -> None:
        self.min_limit_w = min_limit_w
        self.max_limit_w = max_limit_w
        self.cap: NodeCap | None = None

    def set(self, cap_w: int, holder: str, lease_s: float, now_ns: int) -> NodeCap:
        """Hold `cap_w` for `lease_s` from `now_ns` (replacing any cap, whoever held it)."""
        if lease_s <= 0:
            raise ValueError(f"a node cap needs a positive lease, not {lease_s}")
        clamped = min(max(cap_w, self.min_limit_w), self.max_limit_w)
        self.cap = NodeCap(clamped, holder, now_ns + int(lease_s * 1e9))
        return self.cap

    def renew(self, holder: str, lease_s: float, now_ns: int) -> bool:
        """Extend the cap's lease if `holder` holds it."""
        if self.cap is None or self.cap.holder != holder or self.expired(now_ns):
            return False
        self.cap = NodeCap(self.cap.cap_w, holder, now_ns + int(lease_s * 1e9))
        return True

    def expired(self, now_ns: int) -> bool:
        """Whether a cap was held and its lease has run out."""
        return self.cap is not None and now_ns >= self.cap.deadline_ns

    def expire(self, now_ns: int) -> NodeCap | None:
        """Drop the cap if its lease ran out; the dropped cap (the limit may rise again)."""
        if self.cap is not None and self.expired(now_ns):
            dropped, self.cap = self.cap, None
            return dropped
        return None

    def lift(self, holder: str) -> bool:
        """Drop the cap at once if `holder` holds it."""
        if self.cap is None or self.cap.holder != holder:
            return False
        self.cap = None
        return True

    def drop(self) -> bool:
        """Drop the cap, whoever holds it (the agent stops); whether one was held."""
        dropped, self.cap = self.cap is not None, None
        return dropped

    def clamp(self, limit_w: int, now_ns: int) -> int:
        """The limit to apply for a wanted `limit_w`: at most the cap while it holds."""
        if self.cap is None or self.expired(now_ns):
            return limit_w
        return min(limit_w, self.cap.cap_w)
