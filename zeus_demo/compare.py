"""The power-limit part's arithmetic, pure: baseline (max limit) versus optimised steps.

`compare(...)` joins each rank's per-step power limits (from the trainer) with the agents'
per-step measurements by (rank, step): energy per step is the sum over the job's GPUs, time per
step the maximum over ranks (`job_steps`); `StepStats` and `Comparison` hold the result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zeus_demo.config import DemoError


@dataclass(frozen=True)
class StepStats:
    """Mean per-step energy and time of a set of job steps.

    Attributes:
        power_limit_w: The limit every GPU ran these steps at (W).
        energy_per_step_j: Mean over steps of the energy summed over the job's GPUs (J).
        time_per_step_s: Mean over steps of the time, maximum over ranks (s).
        steps: Number of steps averaged.
        first_step: First step index included (None without steps).
        last_step: Last step index included (None without steps).
    """

    power_limit_w: int
    energy_per_step_j: float
    time_per_step_s: float
    steps: int
    first_step: int | None
    last_step: int | None


@dataclass(frozen=True)
class Comparison:
    """Baseline (max limit) versus optimised steps, as the agents measured them.

    Attributes:
        baseline: The leading run of steps at the maximum limit (before profiling moved on).
        optimised: The trailing run of steps at the chosen limit (after it was pinned).
        energy_saving_pct: (baseline - optimised) / baseline energy per step, in %.
        time_change_pct: (optimised - baseline) / baseline time per step, in % (+ = slower).
        per_limit: Every limit the job ran at, all its measured steps.
        unmatched_steps: Steps without a measurement from every rank (left out).
    """

    baseline: StepStats
    optimised: StepStats
    energy_saving_pct: float
    time_change_pct: float
    per_limit: list[StepStats]
    unmatched_steps: int


def job_steps(
    step_limits_w: Mapping[int, Sequence[int]],
    measured: Mapping[tuple[int, int], tuple[float, float]],
) -> tuple[dict[int, tuple[int, float, float]], int]:
    """Join per-rank step limits with per-(rank, step) measurements into job steps.

    Args:
        step_limits_w: Rank -> the power limit (W) each of its steps ran at (index = step).
        measured: (rank, step) -> (time_s, energy_j) as the rank's agent measured it.

    Returns:
        Step -> (limit, time max over ranks, energy summed over ranks) for the steps every rank
        has a measurement of and ran at one limit; and how many steps were left out.

    Raises:
        ValueError: No ranks.
    """
    if not step_limits_w:
        raise ValueError("no ranks to join")
    n_steps = min(len(v) for v in step_limits_w.values())
    out: dict[int, tuple[int, float, float]] = {}
    for step in range(n_steps):
        limits = {step_limits_w[r][step] for r in step_limits_w}
        rows = [measured.get((r, step)) for r in step_limits_w]
        if len(limits) != 1 or any(row is None for row in rows):
            continue
        present = [row for row in rows if row is not None]
        out[step] = (
            limits.pop(),
            max(t for t, _ in present),
            sum(e for _, e in present),
        )
    return out, n_steps - len(out)


def _stats(limit: int, steps: Mapping[int, tuple[int, float, float]], idx: list[int]) -> StepStats:
    if not idx:
        return StepStats(limit, math.nan, math.nan, 0, None, None)
    return StepStats(
        power_limit_w=limit,
        energy_per_step_j=statistics.fmean(steps[i][2] for i in idx),
        time_per_step_s=statistics.fmean(steps[i][1] for i in idx),
        steps=len(idx),
        first_step=idx[0],
        last_step=idx[-1],
    )


def compare(
    step_limits_w: Mapping[int, Sequence[int]],
    measured: Mapping[tuple[int, int], tuple[float, float]],
    max_power_limit_w: int,
    chosen_power_limit_w: int,
) -> Comparison:
    """Compare the steps at the maximum limit with the steps at the chosen one.

    The baseline is the leading run of steps at `max_power_limit_w` (the job starts there and
    profiling starts at the top); the optimised steps are the trailing run at
    `chosen_power_limit_w` (after the optimum was pinned). The runs are found in the trainer's
    per-step limits (what each step really ran at); their energy and time come from the agents.

    Args:
        step_limits_w: Rank -> power limit of each step (W), from the trainer.
        measured: (rank, step) -> (time_s, energy_j), from the agents.
        max_power_limit_w: The GPUs' maximum limit (W).
        chosen_power_limit_w: The limit the optimizer pinned (W).

    Returns:
        The comparison; savings are NaN when either side has no measured step.

    Raises:
        DemoError: The job never ran at the maximum limit, or did not end at the chosen one.
    """
    steps, unmatched = job_steps(step_limits_w, measured)
    ranks = sorted(step_limits_w)
    limits = step_limits_w[ranks[0]]
    if not limits or limits[0] != max_power_limit_w:
        raise DemoError(
            f"the job did not start at the maximum power limit {max_power_limit_w} W "
            f"(first step ran at {limits[0] if limits else 'no step'}): was a GPU left "
            "throttled by an earlier run? Restart the agents."
        )
    if limits[-1] != chosen_power_limit_w:
        raise DemoError(
            f"the job ended at {limits[-1]} W, not at the chosen {chosen_power_limit_w} W: the "
            "optimum was pinned too late; raise --steps"
        )
    lead = next((i for i, w in enumerate(limits) if w != max_power_limit_w), len(limits))
    tail = len(limits)
    while tail > 0 and limits[tail - 1] == chosen_power_limit_w:
        tail -= 1
    if tail == 0:  # The limit never moved: the leading and trailing runs are the same steps.
        raise DemoError(
            "every step ran at one power limit: the optimizer never profiled; check the "
            "coordinator's log (--log-level INFO)"
        )
    baseline = _stats(max_power_limit_w, steps, [i for i in range(lead) if i in steps])
    optimised = _stats(
        chosen_power_limit_w, steps, [i for i in range(tail, len(limits)) if i in steps]
    )
    by_limit: dict[int, list[int]] = {}
    for i, (w, _, _) in sorted(steps.items()):
        by_limit.setdefault(w, []).append(i)
    per_limit = [_stats(w, steps, idx) for w, idx in sorted(by_limit.items(), reverse=True)]
    b_e, b_t = baseline.energy_per_step_j, baseline.time_per_step_s
    o_e, o_t = optimised.energy_per_step_j, optimised.time_per_step_s
    return Comparison(
        baseline=baseline,
        optimised=optimised,
        energy_saving_pct=(b_e - o_e) / b_e * 100.0 if b_e > 0 else math.nan,
        time_change_pct=(o_t - b_t) / b_t * 100.0 if b_t > 0 else math.nan,
        per_limit=per_limit,
        unmatched_steps=unmatched,
    )
