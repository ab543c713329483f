"""Compile the planner's kernels into numba's cache before a first plan needs them.

numba compiles each kernel at its first call (about 20 CPU-s for all of them on a 2-core VM)
and keeps the machine code in its cache (`kernels`): without this, the first Perseus job a
fresh install plans pays that, and so does the first test that plans in a fresh clone of the
repository (`make install` runs this module once). A small synthetic pipeline is planned: its
sweep takes every path of the kernels (capacity-scale changes included), so every kernel is
compiled; the plan itself is thrown away.

    python -m coordinator.pipeline.planner.warm
"""

from __future__ import annotations

from coordinator.pipeline.planner.frontier import PlannerStats, plan_frontier
from coordinator.pipeline.planner.profile import InstructionProfile

CLOCKS_MHZ = (1410, 1305, 1200, 1095, 990, 885, 780)
"""SM clocks of the synthetic profile (an A100's range, in its 105 MHz steps)."""


def synthetic_profile(stages: int = 4) -> InstructionProfile:
    """Forward and backward of `stages` stages, time ~ 1/f^0.8, power ~ f^2 (pure)."""
    rows = []
    for stage in range(stages):
        for name, base_s, base_w in (("forward", 0.010, 250.0), ("backward", 0.021, 270.0)):
            base_s *= 1 + 0.07 * stage  # (Unequal stages: a critical path to cut.)
            for f in CLOCKS_MHZ:
                ratio = f / CLOCKS_MHZ[0]
                seconds = base_s / ratio**0.8
                rows.append((stage, name, f, seconds, (80 + base_w * ratio**2) * seconds))
    return InstructionProfile.from_rows(rows)


def warm() -> PlannerStats:
    """Plan the synthetic pipeline (compiling every kernel once); what the sweep did."""
    stats = PlannerStats()
    plan_frontier(synthetic_profile(), 16, stats=stats)
    return stats


def main() -> None:
    """Warm the cache and say what was planned (the first time, mostly compiling)."""
    stats = warm()
    print(f"planner kernels ready in numba's cache ({stats.iterations} sweep steps planned)")


if __name__ == "__main__":
    main()
