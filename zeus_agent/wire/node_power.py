"""`NodePower`: the latest power of each of a node's GPUs, one message per node.

An agent publishes one per publish interval on `<p>.agent.<node>.power`
(`subjects.agent_power`) beside its per-GPU `SampleBatch`es. The coordinator's power budgets
need only each GPU's latest draw: from this message a replica decodes one small message per
node instead of one batch of samples per GPU (8 times fewer, each a fraction of the size), so a
100,000-GPU cluster costs each replica 12,500 messages a second instead of 100,000. Observers
that want every sample still follow the per-GPU subjects. An agent older than this message
sends none: the coordinator then follows that node's per-GPU samples
(`coordinator.budget.service`).

Kept apart from `messages` (at its size limit); it depends on `messages` only.
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import Field, model_validator

from zeus_agent.wire.messages import MAX_GPUS_PER_NODE, MAX_POWER_W, GpuIndex, Message, Name

__all__ = ["NodePower"]

PowerReading = Annotated[float, Field(ge=0, le=MAX_POWER_W)]


class NodePower(Message):
    """Each GPU's latest power draw on one node: `power_w[i]` is GPU `gpus[i]`'s (W)."""

    node: Name
    gpus: list[GpuIndex] = Field(max_length=MAX_GPUS_PER_NODE, fail_fast=True)
    power_w: list[PowerReading] = Field(max_length=MAX_GPUS_PER_NODE, fail_fast=True)

    @model_validator(mode="after")
    def _one_reading_per_gpu(self) -> Self:
        if len(self.gpus) != len(self.power_w):
            raise ValueError(f"{len(self.gpus)} GPUs but {len(self.power_w)} power readings")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError("a GPU appears twice")
        return self

    def readings(self) -> list[tuple[int, float]]:
        """(GPU index, power W) pairs, in order."""
        return list(zip(self.gpus, self.power_w, strict=True))
