"""Shared pieces of the tests of a node's batch of described ranks (`_register_node`)."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.shell.coordinator_kit import NODE, ask
from zeus_agent.wire import subjects
from zeus_agent.wire.messages import GpuDescription, PowerLimitOptions, RegisterRank, Reply
from zeus_agent.wire.rank_batch import RegisterRanks

OPTIONS = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=1, profile_steps=2)


def described(request: RegisterRank) -> RegisterRank:
    """`request` as the node's agent relays it: with its GPU's description (no `info` asked)."""
    index = request.gpu.gpu_index
    return request.model_copy(update={"gpu_info": GpuDescription(
        index=index, uuid=f"GPU-{index}", name="A40", architecture="Ampere",
        min_power_limit_w=100, max_power_limit_w=300, default_power_limit_w=300,
        supported_memory_clocks_mhz=[7251], supported_graphics_clocks_mhz=[1740, 210],
        has_energy_counter=True, power_limit_w=300)})


async def ask_batch(nc: Any, requests: list[RegisterRank]) -> list[Reply]:
    """Send `requests` as one node batch; each rank's reply (the batch itself must succeed)."""
    reply = await asyncio.wait_for(
        ask(nc, subjects.coord_register_rank(NODE), RegisterRanks(ranks=requests)), 8)
    assert reply.ok, reply
    return [Reply.model_validate(r) for r in reply.result["replies"]]
