"""The codec refuses payloads nested deeper than `MAX_DEPTH`, whether it walks them or not.

`decode` counts the bytes that may start a map or list: a payload with at most `MAX_DEPTH` of
them is not walked (`_shallow`); any other is, so a deep payload is refused either way."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec
from zeus_agent.wire.messages import Reply

pytestmark = pytest.mark.core


def nested(depth: int) -> dict[str, Any]:
    """A `Reply` whose result nests maps and lists `depth` levels deep (the payload's map: 1)."""
    value: Any = 1
    for level in range(depth - 2):
        value = [value] if level % 2 else {"k": value}
    return {"ok": True, "result": {"x": value}}


@pytest.mark.parametrize("depth", [2, 10, codec.MAX_DEPTH])
def test_payloads_up_to_the_limit_are_read(depth: int) -> None:
    data = msgpack.packb(nested(depth))
    assert codec._shallow(data)  # noqa: SLF001 - (too few maps and lists to nest deeper)
    assert codec.decode(data, Reply).ok


@pytest.mark.parametrize("depth", [codec.MAX_DEPTH + 1, 100])
def test_deeper_payloads_are_refused(depth: int) -> None:
    data = msgpack.packb(nested(depth))
    assert not codec._shallow(data)  # noqa: SLF001
    with pytest.raises(PayloadError, match="nests maps or lists"):
        codec.decode(data, Reply)


def test_many_shallow_maps_are_walked_and_read() -> None:
    """More maps than the limit, none deep: walked (`_shallow` cannot tell), and read."""
    data = msgpack.packb({"ok": True, "result": {f"k{i}": {"a": i} for i in range(100)}})
    assert not codec._shallow(data)  # noqa: SLF001
    assert codec.decode(data, Reply).result["k99"] == {"a": 99}


def test_bytes_that_look_like_maps_only_make_the_payload_walked() -> None:
    """Strings full of map-header byte values: counted, so walked; not deep, so read."""
    data = msgpack.packb({"ok": True, "error": "\u0080" * 100})
    assert not codec._shallow(data)  # noqa: SLF001
    assert codec.decode(data, Reply).error == "\u0080" * 100
