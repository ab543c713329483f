"""The ownership bucket's compare-and-set semantics and the shell's ownership loop, for the pure
`OwnershipBook`."""

from __future__ import annotations

from coordinator.state import OwnershipBook


class Leases:
    """The ownership bucket's compare-and-set semantics, for the pure book (one key per job)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[bytes, int]] = {}
        self.seq = 0

    def take(self, key: str, value: bytes, revision: int) -> int | None:
        current = self.values.get(key)
        if (current[1] if current else 0) != revision:
            return None
        self.seq += 1
        self.values[key] = (value, self.seq)
        return self.seq


def step(book: OwnershipBook, bucket: Leases, jobs: dict[str, str], now: float) -> None:
    """What the shell's ownership loop does: renew, then take what is claimable (its watch
    of the bucket keeps it up to date meanwhile)."""
    for h, (value, revision) in bucket.values.items():
        book.observe(h, value, revision)
    for h, lease in book.renewals():
        value = book.value(lease.job_id, now)
        revision = bucket.take(h, value, lease.revision)
        if revision is not None:
            book.observe(h, value, revision)
    for h, revision in book.claimable(list(jobs), now):
        value = book.value(jobs[h], now)
        new = bucket.take(h, value, revision)
        if new is not None:
            book.observe(h, value, new)
    for h, (value, revision) in bucket.values.items():  # The watch catches up.
        book.observe(h, value, revision)
