"""Stand-ins shared by the budget loop's core tests."""

from __future__ import annotations

from typing import Any


class EmptyKv:
    """A state bucket with nothing in it (writes accepted, reads find nothing)."""

    async def get(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        raise KeyNotFoundError

    async def put(self, key: str, value: bytes) -> None:
        return None

    async def purge(self, key: str) -> None:
        return None
