"""Synchronous 1F1B: the order in which a pipeline stage runs its instructions. Pure.

Written once, for both sides of a pipeline job: the simulated pipeline trainer runs it
(`zeus_agent.gpu.sim.trainers.pipeline`) and the coordinator's Perseus planner builds its
iteration DAG from it and checks that a rank's observed instructions follow it
(`coordinator.pipeline.planner.dag`, `coordinator.pipeline.schedulers.perseus`). The
instruction names are those a trainer reports ("forward", "backward").
"""

from __future__ import annotations

__all__ = ["BACKWARD", "FORWARD", "one_f_one_b"]

FORWARD = "forward"
BACKWARD = "backward"


def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """One stage's synchronous 1F1B instruction order for one iteration.

    Stage `s` of `S` with `M` microbatches runs `min(S - s - 1, M)` warm-up forwards, then
    alternates one forward and one backward while forwards remain, then the remaining
    backwards. Microbatches are numbered from 0 in each direction.

    Args:
        stage: This stage, 0 <= stage < num_stages.
        num_stages: Pipeline stages S >= 1.
        microbatches: Microbatches M >= 1.

    Returns:
        `(instruction, microbatch)` pairs, `2 * M` of them.

    Raises:
        ValueError: An argument out of range.
    """
    if num_stages < 1 or microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"need 0 <= stage < num_stages and microbatches >= 1, got stage={stage}, "
            f"num_stages={num_stages}, microbatches={microbatches}"
        )
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(FORWARD, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order.append((FORWARD, warmup + i))
        order.append((BACKWARD, i))
    order.extend((BACKWARD, mb) for mb in range(microbatches - warmup, microbatches))
    return order
