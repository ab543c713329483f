"""How `bench/tune_adaptive_search.py` scores settings: the bench's replay without the state
machine, and per-profile tallies of many settings, memoized and spread over processes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from _tune_adaptive_space import full, key_of, params_of
from power_limit_search import REFERENCE_STEPS, WARMUP_STEPS, Profile, Replay, Tally, tally

from coordinator.power_limit import Adaptive, OptimumSelector, SearchStrategy
from coordinator.power_limit.search import WindowResult, aggregate, resolve_search

SIGMA = 0.01


def fast_replay(
    profile: Profile,
    selector: OptimumSelector,
    search: str | SearchStrategy,
    *,
    rng: random.Random,
    sigma: float,
    windows: list[WindowResult] | None = None,
) -> Replay:
    """The bench's replay without the state machine (records at once, no epoch ends).

    Same probes, same noise draws (time then energy per window), same pick and same spent time
    as `power_limit_search.replay`. The recorded windows are appended to `windows` if given.
    """
    strategy = resolve_search(search)
    plan = strategy.plan(list(profile.limits), WARMUP_STEPS, REFERENCE_STEPS, selector)
    results: list[WindowResult] = []
    spent = 0.0
    while (probe := plan.next_probe(tuple(results), len(results))) is not None:
        limit, steps = probe.power_limit, probe.profile_steps
        for _ in range(probe.warmup_steps + steps):
            spent += profile.time[limit] / REFERENCE_STEPS
        scale = steps / REFERENCE_STEPS
        noise = sigma * math.sqrt(REFERENCE_STEPS / steps)
        t = profile.time[limit] * scale * (1 + rng.gauss(0, noise))
        e = profile.energy[limit] * scale * (1 + rng.gauss(0, noise))
        results.append(WindowResult(limit, steps, t, e))
    if windows is not None:
        windows.extend(results)
    pick = selector.select(aggregate(results, REFERENCE_STEPS))
    profiled = tuple(sorted({r.power_limit for r in results}, reverse=True))
    return Replay(pick, spent, len(results), profiled)


# Parallel evaluation ------------------------------------------------------------------------------

_PROFILES: list[Profile] = []
"""The profiles every process scores on (set once by `_init`: jobs carry only a setting's key)."""


def _init(profiles: list[Profile]) -> None:
    """Set this process's profiles (the pool's initializer, and the parent's for one job)."""
    global _PROFILES
    _PROFILES = profiles


def _per_profile(job: tuple[str, tuple[int, ...]]) -> list[Tally]:
    """One setting (or "exhaustive") on every profile, one tally per profile."""
    key, seeds = job
    search: str | SearchStrategy = key if key == "exhaustive" else Adaptive(**full(params_of(key)))
    return [tally([p], search, seeds, SIGMA, fast_replay) for p in _PROFILES]


class Evaluator:
    """Per-profile tallies of settings on every profile (tuning seeds), memoized."""

    def __init__(self, profiles: list[Profile], seeds: Sequence[int], workers: int) -> None:
        self.profiles = profiles
        self.seeds = tuple(seeds)
        self.memo: dict[str, list[Tally]] = {}
        self.pool = (
            ProcessPoolExecutor(workers, initializer=_init, initargs=(profiles,))
            if workers > 1
            else None
        )
        _init(profiles)

    def __call__(self, settings: Sequence[dict[str, Any] | str]) -> list[list[Tally]]:
        keys = [s if isinstance(s, str) else key_of(s) for s in settings]
        todo = [k for k in dict.fromkeys(keys) if k not in self.memo]
        jobs = [(k, self.seeds) for k in todo]
        done = self.pool.map(_per_profile, jobs) if self.pool else map(_per_profile, jobs)
        self.memo.update(zip(todo, done, strict=True))
        return [self.memo[k] for k in keys]

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()


def pooled(tallies: Sequence[Tally], mask: Sequence[bool]) -> Tally:
    """The per-profile tallies of the profiles in `mask`, added up."""
    out = Tally()
    for t, keep in zip(tallies, mask, strict=True):
        if keep:
            out.add(t)
    return out

