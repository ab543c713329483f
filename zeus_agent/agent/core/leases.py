"""Failsafe leases: every non-default GPU setting is held under a lease that must be renewed.

Pieces:

* `LeaseKind`, `LEASE_KINDS`: what a lease covers: "power_limit", "sm_clocks", "schedule".
* `Lease`: who holds which setting until when (frozen).
* `LeaseTable`: one GPU's leases. The shell grants a lease when it applies a setting, renews on
  the holder's heartbeats, arms one timer at `next_deadline_ns()`, and on `expire(now)` restores
  the default of every lease returned (a dead coordinator, a killed trainer or a lost
  job restores defaults within the lease time).

Invariants (everything that decides whether a setting survives lives in this file):

1. At most one lease per kind. A new grant of a kind replaces the previous holder's lease of it;
   the setting stays non-default, so there is nothing to restore.
2. A lease is lapsed at `now_ns >= deadline_ns`. A lapsed lease is never revived: `renew` skips
   it even if `expire` has not yet removed it, so the outcome does not depend on whether the
   shell's timer or the renewal was processed first.
3. `expire(now)` removes exactly the lapsed leases and returns them, earliest deadline first; the
   caller restores those settings. Calling it again at the same time returns nothing
   (idempotent).
4. `ttl_s` is a finite number of seconds > 0 and at most the table's `max_ttl_s`
   (`MAX_TTL_S`, one hour, by default); deadlines are integers in monotonic ns
   (`now_ns + round(ttl_s * 1e9)`, at least `now_ns + 1`). A bad ttl raises before the table
   changes, so the shell grants the lease first and applies the setting only when that worked
   (and puts the previous lease back with `reinstate` if applying fails).

No clock is read here: every time is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["LEASE_KINDS", "MAX_TTL_S", "Lease", "LeaseKind", "LeaseTable", "check_ttl"]

LeaseKind = Literal["power_limit", "sm_clocks", "schedule"]
"""What a lease covers."""

LEASE_KINDS: tuple[LeaseKind, ...] = get_args(LeaseKind)
"""Every lease kind, in the order `held()` lists them."""

MAX_TTL_S = 3600.0
"""Longest lease a table grants by default (s): a setting nobody renews comes back within it."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A non-default GPU setting held by someone until a deadline.

    Attributes:
        kind: The setting covered ("power_limit", "sm_clocks" or "schedule").
        holder: Who holds it, e.g. a coordinator id or a job id.
        deadline_ns: Monotonic time (ns) at which the lease lapses unless renewed.
    """

    kind: LeaseKind
    holder: str
    deadline_ns: int


class LeaseTable:
    """The leases on one GPU's settings (see the module docstring for the invariants)."""

    def __init__(self, max_ttl_s: float = MAX_TTL_S) -> None:
        """Create a table with no lease held.

        Args:
            max_ttl_s: Longest ttl `grant` and `renew` accept (s), finite and > 0.
        """
        self.max_ttl_s = check_ttl(max_ttl_s, math.inf)
        self._leases: dict[LeaseKind, Lease] = {}

    def grant(self, kind: str, holder: str, now_ns: int, ttl_s: float) -> Lease:
        """Grant `holder` the lease of `kind` for `ttl_s` seconds, replacing any previous one.

        Args:
            kind: "power_limit", "sm_clocks" or "schedule".
            holder: Non-empty id of the holder.
            now_ns: Current monotonic time (ns).
            ttl_s: Lease time (s), finite, > 0 and <= `max_ttl_s`.

        Returns:
            The new lease.

        Raises:
            ValueError: Unknown kind, empty holder or a bad ttl; the table is unchanged.
        """
        k = _check_kind(kind)
        if not isinstance(holder, str) or not holder:
            raise ValueError(f"Lease holder must be a non-empty string, got {holder!r}.")
        lease = Lease(k, holder, self._deadline(now_ns, ttl_s))
        self._leases[k] = lease
        return lease

    def renew(self, holder: str, now_ns: int, ttl_s: float) -> list[LeaseKind]:
        """Extend every live lease of `holder` to `now_ns + ttl_s`.

        Args:
            holder: Id of the holder renewing.
            now_ns: Current monotonic time (ns).
            ttl_s: New lease time from now (s), finite, > 0 and <= `max_ttl_s`.

        Returns:
            The kinds renewed, in `LEASE_KINDS` order; empty for an unknown holder. Lapsed
            leases (deadline <= now) are not renewed: `expire` returns them.

        Raises:
            ValueError: A bad ttl; nothing is renewed.
        """
        deadline = self._deadline(now_ns, ttl_s)
        renewed: list[LeaseKind] = []
        for kind in LEASE_KINDS:
            lease = self._leases.get(kind)
            if lease is None or lease.holder != holder or lease.deadline_ns <= now_ns:
                continue
            self._leases[kind] = Lease(kind, holder, deadline)
            renewed.append(kind)
        return renewed

    def release(self, kind: str, holder: str | None = None) -> Lease | None:
        """Remove the lease of `kind` (the caller restores the default).

        Args:
            kind: The lease kind.
            holder: If given, release only if this holder holds it.

        Returns:
            The lease removed, or None if none was held (by `holder`, when given).

        Raises:
            ValueError: Unknown kind.
        """
        k = _check_kind(kind)
        lease = self._leases.get(k)
        if lease is None or (holder is not None and lease.holder != holder):
            return None
        del self._leases[k]
        return lease

    def reinstate(self, kind: str, lease: Lease | None) -> None:
        """Put back the lease of `kind` held before a grant (None: no lease at all).

        The shell grants a lease before it applies the setting; when applying fails, the
        setting did not change, so whatever covered it before covers it again.

        Raises:
            ValueError: Unknown kind, or a lease of another kind.
        """
        k = _check_kind(kind)
        if lease is None:
            self._leases.pop(k, None)
            return
        if lease.kind != k:
            raise ValueError(f"Cannot reinstate a {lease.kind} lease as {k}.")
        self._leases[k] = lease

    def release_holder(self, holder: str) -> list[Lease]:
        """Remove every lease of `holder` (e.g. its job ended); return them in kind order."""
        gone = [lease for lease in self.held() if lease.holder == holder]
        for lease in gone:
            del self._leases[lease.kind]
        return gone

    def expire(self, now_ns: int) -> list[Lease]:
        """Remove and return the leases lapsed at `now_ns`, earliest deadline first."""
        lapsed = [lease for lease in self.held() if lease.deadline_ns <= now_ns]
        lapsed.sort(key=lambda lease: lease.deadline_ns)  # stable: ties stay in kind order
        for lease in lapsed:
            del self._leases[lease.kind]
        return lapsed

    def next_deadline_ns(self) -> int | None:
        """Return the earliest deadline of a held lease (monotonic ns), or None if none."""
        if not self._leases:
            return None
        return min(lease.deadline_ns for lease in self._leases.values())

    def held(self) -> list[Lease]:
        """Return the leases held, in `LEASE_KINDS` order."""
        return [self._leases[k] for k in LEASE_KINDS if k in self._leases]

    def get(self, kind: str) -> Lease | None:
        """Return the lease of `kind`, or None.

        Raises:
            ValueError: Unknown kind.
        """
        return self._leases.get(_check_kind(kind))

    def __len__(self) -> int:
        return len(self._leases)

    def _deadline(self, now_ns: int, ttl_s: float) -> int:
        return now_ns + max(1, round(check_ttl(ttl_s, self.max_ttl_s) * 1e9))


def _check_kind(kind: str) -> LeaseKind:
    for k in LEASE_KINDS:
        if kind == k:
            return k
    raise ValueError(f"Unknown lease kind {kind!r}; expected one of {', '.join(LEASE_KINDS)}.")


def check_ttl(ttl_s: float, max_ttl_s: float = MAX_TTL_S) -> float:
    """Return `ttl_s` if it is a finite number of seconds > 0 and <= `max_ttl_s`.

    Raises:
        ValueError: Not a number (bools neither), NaN, infinite, <= 0 or above `max_ttl_s`.
    """
    shown = f"{ttl_s!r:.40}"
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        raise ValueError(f"Lease ttl_s must be a finite number of seconds > 0, got {shown}.")
    try:
        finite = math.isfinite(ttl_s)
    except OverflowError:  # an int beyond any float: finite, and far above any maximum
        finite = True
    if not finite or ttl_s <= 0:
        raise ValueError(f"Lease ttl_s must be a finite number of seconds > 0, got {shown}.")
    if ttl_s > max_ttl_s:
        raise ValueError(f"Lease ttl_s must be at most {max_ttl_s:g} s, got {shown}.")
    return ttl_s
