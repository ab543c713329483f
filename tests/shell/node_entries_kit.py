"""Node entries' shared helpers (layout 3): a job, its ranks and a state bucket of its own."""

from __future__ import annotations

import uuid
from typing import Any

from coordinator.jobs import JobRecord, RankRecord
from coordinator.state.buckets import bucket_keys
from coordinator.state.jetstream import JetStreamState
from zeus_agent.models import RankInfo
from zeus_agent.wire.messages import GpuBinding, JobInfo

JOB = "1765000000+dp16+pp1+tp1+PowerLimitOptimizer"


def rank_record(rank: int, node: str | None = None, gpu: int | None = None) -> RankRecord:
    return RankRecord(RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 210]),
                      GpuBinding(node=node or f"n{rank // 8}",
                                 gpu_index=rank % 8 if gpu is None else gpu))


def items(ranks: range) -> list[tuple[RankRecord, tuple[int, int] | None, float | None]]:
    return [(rank_record(r), (100, 300), 1.0) for r in ranks]


def job_record() -> JobRecord:
    info = JobInfo(dp_degree=16, pp_degree=1, tp_degree=1, world_size=16)
    info.job_id = JOB
    return JobRecord(JOB, info, "PowerLimitOptimizer", None, 0.0, 0.0)


async def states(nc: Any, n: int = 1) -> list[JetStreamState]:
    bucket = f"ne-{uuid.uuid4().hex[:12]}"
    states = [JetStreamState(nc, "zeus", bucket=bucket) for _ in range(n)]
    for state in states:
        await state.open()
    return states


async def keys(state: JetStreamState) -> list[str]:
    return sorted(await bucket_keys(state.kv))
