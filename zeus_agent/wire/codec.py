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

import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin, overload

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WrapValidator,
)

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


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_REPLACING = (BeforeValidator, PlainValidator, WrapValidator)


def _replaces(metadata: Any) -> bool:
    """Whether a type's metadata may take a value the type would not, or read it raw.

    A validator that sees the raw value first; anything that builds its own schema
    (`SkipValidation`, `GetPydanticSchema`, `Discriminator`, ...) other than `AfterValidator`;
    a discriminator (pydantic prints a deep tag's `repr`: see `MAX_DEPTH`).
    """
    return any(isinstance(m, _REPLACING) or getattr(m, "discriminator", None) is not None
               or (hasattr(m, "__get_pydantic_core_schema__") and not isinstance(m, AfterValidator))
               for m in metadata)


_UNBOUNDED = MAX_DEPTH + 1
_schema_depths: dict[Any, int] = {}


def _type_depth(hint: Any) -> int:
    """How deep maps and lists nest in any value a type hint accepts (`_UNBOUNDED`: no limit)."""
    origin = get_origin(hint)
    if (isinstance(hint, type) and hint in _SCALARS) or origin is Literal:
        return 0
    if origin is Annotated:
        inner, *metadata = get_args(hint)
        if _replaces(metadata):
            return _UNBOUNDED  # (A validator that sees the raw value first may take anything.)
        return _type_depth(inner)
    if origin is Union or origin is types.UnionType:
        return max(_type_depth(arg) for arg in get_args(hint))
    if origin is list and len(get_args(hint)) == 1:
        return min(_UNBOUNDED, 1 + _type_depth(get_args(hint)[0]))
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return schema_depth(hint)
    return _UNBOUNDED  # Any, maps, anything else: taken as unbounded.


def schema_depth(model: Any) -> int:
    """How deep maps and lists nest in any payload `model` accepts (the payload's map: 1).

    `_UNBOUNDED` for a model that keeps fields it does not know (only `extra="forbid"` ones
    count), has a field of free-form data (`Any`, a map) or is a `TypeAdapter`. Such a model
    needs the depth check before validation; for any other, a payload deeper than
    `MAX_DEPTH` fails validation anyway, so it is looked for only then (see `_validate`).
    """
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return _UNBOUNDED  # (Not cached: a caller's own adapters would pile up.)
    depth = _schema_depths.get(model)
    if depth is None:
        _schema_depths[model] = _UNBOUNDED  # (A model that nests itself: unbounded.)
        bounded = (model.model_config.get("extra") == "forbid"
                   and not _sees_raw_input(model))
        depth = _UNBOUNDED if not bounded else min(_UNBOUNDED, 1 + max(
            (_UNBOUNDED if _replaces([*f.metadata, f]) else _type_depth(f.annotation)
             for f in model.model_fields.values()), default=0))
        _schema_depths[model] = depth
    return depth


def _sees_raw_input(model: type[BaseModel]) -> bool:
    """Whether a validator of `model` runs before (or instead of) its fields' own validation.

    (Pydantic 1's `validator(pre=True)` and `root_validator(pre=True)` too; and a model that
    builds its own schema.)
    """
    found = model.__pydantic_decorators__
    validators: list[Any] = [*found.model_validators.values(), *found.field_validators.values(),
                             *found.validators.values(), *found.root_validators.values()]
    own_schema = (getattr(model.__get_pydantic_core_schema__, "__func__", None)
                  is not BaseModel.__get_pydantic_core_schema__.__func__)  # type: ignore[attr-defined]
    return own_schema or any(d.info.mode != "after" for d in validators)


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


def _validate(model: Any, obj: Any, shallow: bool | None) -> Any:
    """`validate`; `shallow`: known not to nest too deep (not walked again; None: not known).

    A payload of a model of bounded depth (`schema_depth`) is walked only once it failed (a
    deeper one fails validation): the same error as when walked first, at no cost for the
    payloads that pass. `shallow` is then not needed.
    """
    if not isinstance(obj, dict):
        raise PayloadError(f"payload must be a map, got {type(obj).__name__}")
    if len(obj) > MAX_FIELDS:
        # Refused before validation: pydantic would build one error per unknown field.
        raise PayloadError(f"payload has {len(obj)} fields; no message has more than {MAX_FIELDS}")
    walk_first = schema_depth(model) > MAX_DEPTH
    if walk_first:
        _no_deeper(obj, shallow)
    version = obj.get("v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        if not walk_first:
            _no_deeper(obj, shallow)
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
        if not walk_first:
            _no_deeper(obj, shallow)
        field, message = _describe(e)
        raise PayloadError(message, field=field) from None


def _no_deeper(obj: dict[Any, Any], shallow: bool | None) -> None:
    """Raise `PayloadError` if `obj` nests more than `MAX_DEPTH` levels (unless `shallow`)."""
    if not shallow and _deeper_than(obj, MAX_DEPTH):
        raise PayloadError(f"payload nests maps or lists more than {MAX_DEPTH} levels deep")


def decode_either(data: bytes, model: type[M], other: type[N], key: str) -> M | N:
    """Decode msgpack bytes as `other` if they are a map with `key`, else as `model`.

    One unpack for payloads of two shapes on one subject (a `RegisterRank`, or a node's
    `RegisterRanks`); raises `PayloadError` as `decode` does.
    """
    return cast("M | N", decode_keyed(data, model, {key: other}))


def decode_keyed(data: bytes, model: type[BaseModel],
                 by_key: Mapping[str, type[BaseModel]]) -> BaseModel:
    """Decode msgpack bytes as the model of the first key of `by_key` the map has, else `model`.

    One unpack for payloads of several shapes on one subject; raises `PayloadError` as `decode`
    does.
    """
    obj = unpack(data)
    chosen = model
    if isinstance(obj, dict):
        chosen = next((m for k, m in by_key.items() if k in obj), model)
    return cast(BaseModel, _validate(chosen, obj, shallow=_shallow_unless_bounded(chosen, data)))


@overload
def decode(data: bytes, model: type[M]) -> M: ...
@overload
def decode(data: bytes, model: TypeAdapter[T]) -> T: ...
def decode(data: bytes, model: Any) -> Any:
    """Decode msgpack bytes and validate them (see `validate`)."""
    return _validate(model, unpack(data), shallow=_shallow_unless_bounded(model, data))


def _shallow_unless_bounded(model: Any, data: bytes) -> bool | None:
    """`_shallow(data)`, counted only for a model of unbounded depth (else None: not known)."""
    return _shallow(data) if schema_depth(model) > MAX_DEPTH else None
