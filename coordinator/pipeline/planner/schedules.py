"""Each rank's order of the pipeline schedules people run, by name, for offline planning. Pure.

A running job needs none of this: the coordinator learns each rank's order from what it
reports (`learned.LearnedSchedule`). `zeus-coordinator plan --schedule NAME` and the planner's
bench plan a schedule before it runs, so they write its orders from its definition:

* `1f1b`: synchronous 1F1B (`zeus_agent.pipeline_order.one_f_one_b`), bare names;
* `gpipe`: every forward, then every backward, bare names;
* `looped-bfs`: rank r runs stages r, r+P, ...: each stage's forwards in turn, then each
  stage's backwards, last stage first, microbatches in reverse;
* `interleaved-1f1b` (Megatron's interleaved schedule): microbatches go through the rank's
  stages in rounds of `per_round`; `(V-1) * per_round + 2 * (P-1-r)` warm-up forwards, then
  one forward and one backward at a time, then the remaining backwards;
* `zero-bubble` (interleaved zero bubble, ZB-H1 when V = 1): as interleaved 1F1B with
  `(V-1) * per_round + (P-1-r)` warm-up forwards and each backward split into its input part
  and its weight part, rank r running each weight part r steps after its input part.

Here `per_round` is M / max(1, M // P) (M must be a multiple of that count of rounds for the
interleaved ones, as PyTorch requires). Names other than bare are `kind:stage:microbatch`.
`tests/core/test_pipeline_named_schedules.py` checks these orders against PyTorch's own
`torch.distributed.pipelining` tables.
"""

from __future__ import annotations

from collections.abc import Callable

from zeus_agent.pipeline_order import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    format_action,
    one_f_one_b,
)

__all__ = ["SCHEDULES", "rank_orders"]

Order = list[str]


def _gpipe(rank: int, ranks: int, microbatches: int, chunks: int) -> Order:
    return [FORWARD] * microbatches + [BACKWARD] * microbatches


def _one_f_one_b(rank: int, ranks: int, microbatches: int, chunks: int) -> Order:
    return [name for name, _ in one_f_one_b(rank, ranks, microbatches)]


def _looped_bfs(rank: int, ranks: int, microbatches: int, chunks: int) -> Order:
    stages = [rank + c * ranks for c in range(chunks)]
    order = [format_action(FORWARD, s, m) for s in stages for m in range(microbatches)]
    order += [format_action(BACKWARD, s, m) for s in reversed(stages)
              for m in reversed(range(microbatches))]
    return order


def _per_round(ranks: int, microbatches: int) -> int:
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ValueError(f"interleaved schedules need the microbatches ({microbatches}) to be a "
                         f"multiple of their rounds ({rounds} of {ranks} or more)")
    return microbatches // rounds


def _slot(index: int, rank: int, ranks: int, chunks: int, per_round: int,
          backward: bool) -> tuple[int, int]:
    """(stage, microbatch) of a rank's `index`-th forward (or backward)."""
    chunk = (index // per_round) % chunks
    if backward:
        chunk = chunks - 1 - chunk
    return rank + chunk * ranks, (index // (per_round * chunks)) * per_round + index % per_round


def _interleaved(rank: int, ranks: int, microbatches: int, chunks: int) -> Order:
    per_round = _per_round(ranks, microbatches)
    total = microbatches * chunks
    warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - rank), total)

    def fwd(i: int) -> str:
        return format_action(FORWARD, *_slot(i, rank, ranks, chunks, per_round, False))

    def bwd(i: int) -> str:
        return format_action(BACKWARD, *_slot(i, rank, ranks, chunks, per_round, True))

    order = [fwd(i) for i in range(warmup)]
    for j in range(total - warmup):
        order += [fwd(warmup + j), bwd(j)]
    return order + [bwd(j) for j in range(total - warmup, total)]


def _zero_bubble(rank: int, ranks: int, microbatches: int, chunks: int) -> Order:
    per_round = _per_round(ranks, microbatches)
    total = microbatches * chunks
    warmup = min((chunks - 1) * per_round + (ranks - 1 - rank), total)

    def act(kind: str, i: int) -> str:
        backward = kind != FORWARD
        return format_action(kind, *_slot(i, rank, ranks, chunks, per_round, backward))

    order = [act(FORWARD, i) for i in range(warmup)]
    for j in range(total):
        if j < total - warmup:
            order.append(act(FORWARD, warmup + j))
        order.append(act(BACKWARD_INPUT, j))
        if j >= rank:  # The weight part waits `rank` steps behind its input part.
            order.append(act(BACKWARD_WEIGHT, j - rank))
    return order + [act(BACKWARD_WEIGHT, j) for j in range(max(total - rank, 0), total)]


_GENERATORS: dict[str, tuple[Callable[[int, int, int, int], Order], bool]] = {
    "1f1b": (_one_f_one_b, False),
    "gpipe": (_gpipe, False),
    "interleaved-1f1b": (_interleaved, True),
    "looped-bfs": (_looped_bfs, True),
    "zero-bubble": (_zero_bubble, True),
}
SCHEDULES = tuple(_GENERATORS)
"""The schedule names `rank_orders` knows."""


def default_virtual_stages(name: str) -> int:
    """Stages per rank when not given: 2 for the looped/interleaved schedules, else 1."""
    return 2 if name in ("interleaved-1f1b", "looped-bfs") else 1


def rank_orders(name: str, ranks: int, microbatches: int,
                virtual_stages: int | None = None) -> list[list[str]]:
    """Each rank's instruction names of one iteration of the named schedule.

    Args:
        name: One of `SCHEDULES`.
        ranks: Pipeline ranks P >= 1.
        microbatches: Microbatches M >= 1.
        virtual_stages: Stages per rank V (default `default_virtual_stages`); 1 for `1f1b`
            and `gpipe`, which run one stage per rank.

    Raises:
        ValueError: An unknown name or an argument out of range.
    """
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    chunks = default_virtual_stages(name) if virtual_stages is None else virtual_stages
    generate, multi = _GENERATORS[name]
    if ranks < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"need ranks, microbatches and virtual stages >= 1, got {ranks}, "
                         f"{microbatches} and {chunks}")
    if chunks > 1 and not multi:
        raise ValueError(f"{name} runs one stage per rank, not {chunks}")
    return [generate(rank, ranks, microbatches, chunks) for rank in range(ranks)]
