"""A synthetic energy counter and the read loop in simulated time, for the `ReadPolicy` tests.

A counter updates every `period` (each instant jittered around its grid) to the energy spent so
far at constant power; a read samples it at the midpoint of its call, whose cost is drawn from a
few recorded-like values. Nothing sleeps."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from zeus_agent.agent.core.counter_phase import (
    Knot,
    ReadPolicy,
)

MS = 1_000_000
COSTS_MS = (2.2, 2.5, 3.0, 3.2, 3.5, 5.5, 7.0)


@dataclass
class Counter:
    """A counter that updates every `period_ns` (+- `jitter_ns`) at `power_w` from t = 0."""

    period_ns: int = 100 * MS
    phase_ns: int = 37 * MS
    jitter_ns: int = 1 * MS
    power_w: float = 700.0
    seed: int = 0
    duration_ns: int = 120_000 * MS
    jump_at_ns: int | None = None
    jump_ns: int = 0
    updates: list[int] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.updates = []
        k = 0
        while (t := self.phase_ns + k * self.period_ns) < self.duration_ns:
            if self.jump_at_ns is not None and t >= self.jump_at_ns:
                t += self.jump_ns
            self.updates.append(t + rng.randint(-self.jitter_ns, self.jitter_ns))
            k += 1

    def energy_at(self, t_ns: int) -> float:
        """The true energy spent by `t_ns` (J)."""
        return self.power_w * t_ns / 1e9

    def value_at(self, t_ns: int) -> float:
        """What the counter shows at `t_ns`: the energy at its last update (J)."""
        k = bisect.bisect_right(self.updates, t_ns) - 1
        return 0.0 if k < 0 else self.energy_at(self.updates[k])


@dataclass
class Run:
    reads: list[tuple[int, int]] = field(default_factory=list)  # (start, end)
    knots: list[tuple[int, Knot]] = field(default_factory=list)  # (available at, knot)
    locked_at: int | None = None


def drive(
    policy: ReadPolicy,
    read_value: object,
    until_ns: int,
    seed: int = 1,
    start_ns: int = 0,
    run: Run | None = None,
    anywhere: bool = False,
    stretched: tuple[float, float, float] | None = None,
) -> Run:
    """Run the read loop in simulated time: plan, read (at a drawn cost), feed.

    `anywhere`: the counter is sampled at a drawn instant of the call (a real read samples it
    somewhere within it), not at its midpoint. `stretched`: (probability, min ms, max ms) of a
    read whose call lasts that long (a loaded host: the thread waits for the CPU or the GIL).
    """
    rng = random.Random(seed)
    run = run or Run()
    now = start_ns
    while True:
        start = policy.next_read_at(now)
        if start >= until_ns:
            return run
        cost_ms = rng.choice(COSTS_MS)
        if stretched is not None and rng.random() < stretched[0]:
            cost_ms = rng.uniform(stretched[1], stretched[2])
        end = start + int(cost_ms * MS)
        at = start + int(rng.random() * (end - start)) if anywhere else (start + end) // 2
        knot = policy.on_read(start, end, read_value(at))  # type: ignore[operator]
        run.reads.append((start, end))
        if knot is not None:
            run.knots.append((end, knot))
        if run.locked_at is None and policy.locked:
            run.locked_at = end
        now = end
