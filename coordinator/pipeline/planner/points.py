"""Frontier points: what a plan costs on a profile, the all-max plan, and choosing one. Pure.

* `FrontierPoint`: an iteration time, an energy and the plan (per stage, (instruction, MHz) in
  execution order) that has them.
* `evaluate(profile, plan, M)`: a plan's iteration time (the 1F1B critical path) and energy,
  counted as Perseus and lowtime 0.3.0 count it: every instruction's energy plus `P_block` for
  every second a stage's GPU waits.
* `max_frequency_plan(profile, M)`: every instruction at its highest profiled clock.
* `choose(frontier, ...)`: the point a target time, a slowdown or an eta knob picks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.pipeline.planner.dag import (
    PipelineDAG,
    PipelineSchedule,
    Synchronous1F1B,
    build_dag,
)
from coordinator.pipeline.planner.learned import node_kind
from coordinator.pipeline.planner.profile import DEFAULT_P_BLOCK_W, InstructionProfile, Plan

__all__ = ["FrontierPoint", "choose", "evaluate", "max_frequency_plan", "schedule_dag"]


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the frontier: iteration time (s), energy (J) and its plan."""

    time: float
    energy: float
    plan: Plan


def schedule_dag(
    num_stages: int, num_microbatches: int, schedule: PipelineSchedule | None = None
) -> PipelineDAG:
    """The DAG of one iteration of `schedule` (default: synchronous 1F1B of S and M).

    Raises:
        ValueError: `schedule` has another shape than (S, M), or cannot be built.
    """
    if schedule is None:
        return build_dag(Synchronous1F1B(num_stages, num_microbatches))
    if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
        raise ValueError(
            f"the schedule has {schedule.num_stages} stage(s) and {schedule.num_microbatches} "
            f"microbatch(es), not {num_stages} and {num_microbatches}")
    return build_dag(schedule)


def evaluate(
    profile: InstructionProfile,
    plan: Sequence[Sequence[tuple[str, int]]],
    num_microbatches: int,
    p_block_w: float = DEFAULT_P_BLOCK_W,
    schedule: PipelineSchedule | None = None,
) -> tuple[float, float]:
    """(iteration time, energy) of `plan` on the profile's rows.

    The time is the critical path of `schedule`'s DAG (default 1F1B) with every instruction
    taking its profiled time at its planned clock; the energy is the sum of instruction
    energies plus `p_block_w` for every second a stage's GPU waits:
    sum(e - P_block * t) + S * T * P_block.

    Raises:
        ValueError: The plan's rows do not follow the schedule's order.
        KeyError: A clock the profile has no row for.
    """
    num_stages = len(plan)
    dag = schedule_dag(num_stages, num_microbatches, schedule)
    profile = profile.for_stages(num_stages)
    durations = [0.0] * len(dag.nodes)
    busy_energy = busy_time = 0.0
    for stage, ids in enumerate(dag.stage_nodes):
        row = plan[stage]
        if len(row) != len(ids):
            raise ValueError(
                f"plan stage {stage} has {len(row)} instructions, the schedule's order "
                f"{len(ids)}"
            )
        for (name, freq), v in zip(row, ids, strict=True):
            if name != dag.nodes[v].instruction:
                raise ValueError(
                    f"plan stage {stage} runs {name!r} where the schedule runs "
                    f"{dag.nodes[v].instruction!r}"
                )
            time, energy = profile.lookup(stage, node_kind(dag.nodes[v]), int(freq))
            durations[v] = time
            busy_energy += energy
            busy_time += time
    iteration_time = dag.longest_path(durations)
    energy = busy_energy + p_block_w * (num_stages * iteration_time - busy_time)
    return iteration_time, energy


def max_frequency_plan(
    profile: InstructionProfile,
    num_microbatches: int,
    schedule: PipelineSchedule | None = None,
) -> Plan:
    """Every instruction at the highest profiled clock of its (stage, action kind)."""
    stages = profile.num_stages if schedule is None else schedule.num_stages
    dag = schedule_dag(stages, num_microbatches, schedule)
    profile = profile.for_stages(stages)
    return tuple(
        tuple(
            (dag.nodes[v].instruction, profile.entries[(s, node_kind(dag.nodes[v]))][0][0])
            for v in ids
        )
        for s, ids in enumerate(dag.stage_nodes)
    )


def choose(
    frontier: Sequence[FrontierPoint],
    *,
    target_time: float | None = None,
    max_slowdown: float | None = None,
    eta_knob: float | None = None,
    all_max_time: float | None = None,
    max_power_w: float | None = None,
) -> FrontierPoint:
    """Pick one point of a frontier (fastest first, energies decreasing).

    * `target_time`: the least energy with T <= target_time (the fastest point if none is).
    * `max_slowdown`: the least energy with T <= (1 + max_slowdown) * reference, where the
      reference is `all_max_time` (T with every clock at its maximum, see `max_frequency_plan`
      and `evaluate`) or, without it, the fastest point's T.
    * `eta_knob`: the least ZeusCost-style `eta * E + (1 - eta) * max_power_w * T`;
      `max_power_w` defaults to the highest average power E / T on the frontier.
    * None of them: no slowdown, the least energy with T <= `all_max_time` (the fastest point
      without `all_max_time`).

    Raises:
        ValueError: An empty frontier, more than one criterion, or one out of range.
    """
    if not frontier:
        raise ValueError("empty frontier")
    given = [x is not None for x in (target_time, max_slowdown, eta_knob)]
    if sum(given) > 1:
        raise ValueError("give at most one of target_time, max_slowdown, eta_knob")
    if eta_knob is not None:
        if not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"eta_knob must be in [0, 1], got {eta_knob}")
        power = max_power_w if max_power_w is not None else max(p.energy / p.time for p in frontier)
        return min(frontier, key=lambda p: eta_knob * p.energy + (1 - eta_knob) * power * p.time)
    reference = all_max_time if all_max_time is not None else frontier[0].time
    if max_slowdown is not None:
        if max_slowdown < 0:
            raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
        limit = (1.0 + max_slowdown) * reference
    elif target_time is not None:
        limit = target_time
    else:
        limit = reference
    feasible = [p for p in frontier if p.time <= limit * (1 + 1e-12)]
    if not feasible:
        return frontier[0]
    return min(feasible, key=lambda p: (p.energy, p.time))

