"""The one msgpack codec of the wire contract, and validation into one error type.

* `encode(model)`: a pydantic model (or plain data) -> msgpack bytes.
* `decode(data, model)`: msgpack bytes -> a validated model; any problem (not msgpack, not a
  map, wrong schema version, a bad field) raises `PayloadError` naming the field.
* `validate(model, obj)`: the same validation for already-decoded data.

Error messages echo at most a short `shown` form of what the peer sent (`wire.text`): a reply
that repeats a 5 KB value would not fit the wire's bounded text.

`model` may be a pydantic model class or a `pydantic.TypeAdapter` (for unions of commands).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast, overload

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from zeus_agent.errors import PayloadError
from zeus_agent.wire.text import bounded, shown

SCHEMA_VERSION = 1
M = TypeVar("M", bound=BaseModel)
N = TypeVar("N", bound=BaseModel)
T = TypeVar("T")

MAX_FIELDS = 64
"""Most top-level fields of a payload (every message has far fewer)."""
MAX_DEPTH = 32
"""Deepest nesting of maps and lists in a payload (every message nests far less). Deeper values
are refused before validation: pydantic reports a discriminator it cannot read (a list nested
~1,000 deep as a command's `op`) by printing its `repr`, which fails near Python's recursion
limit (an "unraisable" RecursionError per request), and anything nested that deep cannot be
encoded again (msgpack's packer stops at 511 levels)."""


def encode(obj: BaseModel | Any) -> bytes:
    """Encode a model (or plain msgpack-able data) into msgpack bytes."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="python")
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode msgpack bytes into Python data, raising `PayloadError` if they are not msgpack."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage.
        raise PayloadError(
            f"payload is not valid msgpack ({type(e).__name__}: {bounded(e, 200)})"
        ) from None


def _describe(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    # A field's name is the peer's too (an unknown key, a map's key): cut like its value.
    field = bounded(".".join(str(part) for part in first["loc"]), 200)
    more = f" (and {err.error_count() - 1} more errors)" if err.error_count() > 1 else ""
    where = f"field '{field}'" if field else "payload"
    return field, f"{where}: {bounded(first['msg'], 500)} (got {shown(first.get('input'))}){more}"


_CONTAINERS = frozenset({dict, list})


def _deeper_than(obj: dict[Any, Any], limit: int) -> bool:
    """Whether maps and lists nest more than `limit` levels in `obj` (a map: level 1).

    Level by level; a map or list of scalars only is passed over at C speed.
    """
    level: list[Any] = [obj]
    depth = 1
    while level:
        below: list[Any] = []
        for value in level:
            items = value.values() if type(value) is dict else value
            if _CONTAINERS.isdisjoint(map(type, items)):
                continue
            below.extend(item for item in items if type(item) in _CONTAINERS)
        if below and depth >= limit:
            return True
        level = below
        depth += 1
    return False


_CONTAINER_HEADERS = bytes([*range(0x80, 0xA0), *range(0xDC, 0xE0)])
"""The first bytes of msgpack's maps and arrays (fixmap, fixarray, array 16/32, map 16/32)."""


def _shallow(data: bytes) -> bool:
    """Whether msgpack bytes cannot nest maps and lists more than `MAX_DEPTH` levels deep.

    Every map or list starts with one of `_CONTAINER_HEADERS`, so bytes holding at most
    `MAX_DEPTH` of them (other bytes may also have those values) hold at most that many maps
    and lists, nested or not. Counted at C speed: most payloads need no walk (`_deeper_than`).
    """
    return len(data) - len(data.translate(None, _CONTAINER_HEADERS)) <= MAX_DEPTH


@overload
def validate(model: type[M], obj: Any) -> M: ...
@overload
def validate(model: TypeAdapter[T], obj: Any) -> T: ...
def validate(model: Any, obj: Any) -> Any:
    """Validate decoded data against a model class or `TypeAdapter`.

    Raises:
        PayloadError: The data is not a map, has an unsupported schema version, or a field is
            invalid; the message and `.field` name the first bad field.
    """
    return _validate(model, obj, shallow=False)


def _validate(model: Any, obj: Any, shallow: bool) -> Any:
    """`validate`; `shallow`: known not to nest too deep (not walked again)."""
    if not isinstance(obj, dict):
        raise PayloadError(f"payload must be a map, got {type(obj).__name__}")
    if len(obj) > MAX_FIELDS:
        # Refused before validation: pydantic would build one error per unknown field.
        raise PayloadError(f"payload has {len(obj)} fields; no message has more than {MAX_FIELDS}")
    if not shallow and _deeper_than(obj, MAX_DEPTH):
        raise PayloadError(f"payload nests maps or lists more than {MAX_DEPTH} levels deep")
    version = obj.get("v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise PayloadError(
            f"schema version {shown(version)} is not supported (this build speaks "
            f"{SCHEMA_VERSION}); upgrade the older side",
            field="v",
        )
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(obj)
        return model.model_validate(obj)
    except ValidationError as e:
        field, message = _describe(e)
        raise PayloadError(message, field=field) from None


def decode_either(data: bytes, model: type[M], other: type[N], key: str) -> M | N:
    """Decode msgpack bytes as `other` if they are a map with `key`, else as `model`.

    One unpack for payloads of two shapes on one subject (a `RegisterRank`, or a node's
    `RegisterRanks`); raises `PayloadError` as `decode` does.
    """
    obj = unpack(data)
    chosen = other if isinstance(obj, dict) and key in obj else model
    return cast("M | N", _validate(chosen, obj, shallow=_shallow(data)))


@overload
def decode(data: bytes, model: type[M]) -> M: ...
@overload
def decode(data: bytes, model: TypeAdapter[T]) -> T: ...
def decode(data: bytes, model: Any) -> Any:
    """Decode msgpack bytes and validate them (see `validate`)."""
    return _validate(model, unpack(data), shallow=_shallow(data))
