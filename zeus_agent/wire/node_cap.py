"""`NodeCapCmd`: a power budget's cap on one GPU, with a lease of its own (a GPU command).

A budget reaches an agent as this command on the GPU's command subject, beside the other GPU
commands (`zeus_agent.wire.messages.GpuCommand`). Its lease is the budget's, not a job's: the
agent clamps every power limit it sets to the cap (a job's, a reset's, a restore's) while the
lease holds, whatever happens to the job, its trainer, the coordinator or the bus, and drops
the cap when the lease runs out or its holder lifts it (`cap_w` None). The holder renews it
with the same command, or with a `RenewLeasesCmd` / lease renewal naming the holder.

Kept apart from `messages` (which imports it for the command union), so it depends only on
`zeus_agent.models`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from zeus_agent.models import MAX_ID_CHARS, NO_CONTROL_CHARS, PowerW

MAX_CAP_LEASE_S = 3600.0
"""Longest lease of a node cap (s): the agents' `MAX_LEASE_S` (a test holds them equal)."""

CapHolder = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS,
                                             pattern=NO_CONTROL_CHARS)]


class NodeCapCmd(BaseModel):
    """Hold (or lift) a budget's cap on this GPU's power limit.

    Replies with the cap now held (None: none) and the power limit now applied. A lift by
    another holder than the cap's changes nothing (`lifted` False).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    op: Literal["node_cap"] = "node_cap"
    holder: CapHolder = Field(description="Who holds the cap: `budget:<budget id>`")
    cap_w: PowerW | None = Field(
        description="The highest power limit (W) the GPU may have; None: lift the holder's cap"
    )
    lease_s: float = Field(
        default=30.0, gt=0, le=MAX_CAP_LEASE_S,
        description="The cap holds this long unless renewed (s); ignored by a lift",
    )
