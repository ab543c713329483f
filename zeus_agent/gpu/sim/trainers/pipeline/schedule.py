"""Synchronous 1F1B: each stage's instruction order, what it waits for, one iteration's timeline.

Pure functions (no process, no GPU), used by the simulated pipeline trainer's ranks
(`zeus_agent.gpu.sim.trainers.pipeline.job`) and by whoever needs the order it runs:

* `one_f_one_b(stage, num_stages, microbatches)`: one stage's instruction order
  (`zeus_agent.pipeline_order`, written once for the trainer and the coordinator's planner).
* `waits_for(stage, num_stages, instruction)`: the stage whose message an instruction waits
  for.
* `timeline(num_stages, microbatches, duration)`: start and end of every instruction of one
  iteration when each takes `duration(stage, name)` (what the processes do, without noise).
"""

from __future__ import annotations

from collections.abc import Callable

from zeus_agent.pipeline_order import BACKWARD, FORWARD, one_f_one_b

__all__ = ["BACKWARD", "FORWARD", "one_f_one_b", "timeline", "waits_for"]


def waits_for(stage: int, num_stages: int, instruction: str) -> int | None:
    """The stage whose message `instruction` of `stage` waits for (same microbatch), or None.

    A forward waits for the previous stage's activation (none at stage 0), a backward for the
    next stage's gradient (none at the last stage).

    Raises:
        ValueError: An instruction other than "forward" or "backward".
    """
    if instruction == FORWARD:
        return stage - 1 if stage > 0 else None
    if instruction == BACKWARD:
        return stage + 1 if stage < num_stages - 1 else None
    raise ValueError(f"unknown instruction {instruction!r} (forward or backward)")


def timeline(
    num_stages: int, microbatches: int, duration: Callable[[int, str], float]
) -> list[list[tuple[str, int, float, float]]]:
    """Start and end times of one iteration's instructions when each takes `duration(s, name)`.

    Each stage runs its `one_f_one_b` order; an instruction starts when the stage is free and
    the message it `waits_for` has arrived (messages take no time).

    Returns:
        Per stage, `(instruction, microbatch, start, end)` in the stage's order; the
        iteration's time is the largest end.

    Raises:
        ValueError: Arguments out of range (the order itself cannot deadlock).
    """
    orders = [one_f_one_b(s, num_stages, microbatches) for s in range(num_stages)]
    done: dict[tuple[int, str, int], float] = {}
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(num_stages)]
    position = [0] * num_stages
    free = [0.0] * num_stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while position[s] < len(orders[s]):
                name, mb = orders[s][position[s]]
                peer = waits_for(s, num_stages, name)
                if peer is not None and (peer, name, mb) not in done:
                    break
                start = max(free[s], done[(peer, name, mb)] if peer is not None else 0.0)
                end = start + duration(s, name)
                done[(s, name, mb)] = free[s] = end
                out[s].append((name, mb, start, end))
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B never deadlocks
            raise RuntimeError("the 1F1B orders deadlocked")
    return out
