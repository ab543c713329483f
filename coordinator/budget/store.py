"""Budgets in the coordinator's JetStream state bucket: one key per budget, `budget.<id>`.

Outside the `v.` keys the replicas follow for jobs (`coordinator.state.records`), so a replica
that predates budgets never reads them; every replica, restarted or taking over, reads them
here. Values are versioned JSON (`{"v": 1, "budget": {...}, "set_at": ...}`), readable with
`nats kv get`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError

from zeus_agent.wire.budget import Budget

LOG = logging.getLogger(__name__)

PREFIX = "budget."
VERSION = 1


def budget_key(budget_id: str) -> str:
    """The key of one budget (ids are key-safe: `BudgetId`)."""
    return f"{PREFIX}{budget_id}"


def encode(budget: Budget, set_at: float) -> bytes:
    """A budget's value in the bucket."""
    return json.dumps({"v": VERSION, "budget": budget.model_dump(), "set_at": set_at}).encode()


def decode(raw: bytes) -> tuple[Budget, float]:
    """(budget, when it was set) from a value.

    Raises:
        ValueError: Not a budget this version wrote.
    """
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("v") != VERSION:
        raise ValueError("not a version-1 budget")
    try:
        return Budget.model_validate(data["budget"]), float(data.get("set_at", 0.0))
    except (KeyError, TypeError, ValidationError) as e:
        raise ValueError(f"unreadable budget: {e}") from e


class BudgetStore:
    """Read and write budgets through a JetStream KV bucket (nats-py's `KeyValue`)."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    async def put(self, budget: Budget, set_at: float) -> None:
        """Write (or replace) a budget."""
        await self.kv.put(budget_key(budget.budget_id), encode(budget, set_at))

    async def delete(self, budget_id: str) -> bool:
        """Remove a budget; False if there was none."""
        if await self.get(budget_id) is None:
            return False
        await self.kv.purge(budget_key(budget_id))
        return True

    async def get(self, budget_id: str) -> tuple[Budget, float] | None:
        """(budget, when it was set), or None."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(budget_key(budget_id))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return decode(entry.value)

    async def all(self) -> dict[str, tuple[Budget, float]]:
        """Every readable budget, by id (an unreadable one is logged and left out)."""
        from nats.js.errors import NoKeysError

        try:
            keys = [k for k in await self.kv.keys() if k.startswith(PREFIX)]
        except NoKeysError:
            return {}
        out: dict[str, tuple[Budget, float]] = {}
        for key in keys:
            try:
                found = await self.get(key[len(PREFIX) :])
            except ValueError as e:
                LOG.warning("budget %s in the state bucket: %s", key, e)
                continue
            if found is not None:
                out[found[0].budget_id] = found
        return out
