"""The codec refuses payloads nested deeper than `MAX_DEPTH`, whether it walks them or not.

`decode` counts the bytes that may start a map or list: a payload with at most `MAX_DEPTH` of
them is not walked (`_shallow`); any other is, so a deep payload is refused either way. A
payload of a model of bounded depth is walked only once it failed validation: same errors."""

from __future__ import annotations

import sys
import warnings
from typing import Annotated, Any, Literal

import msgpack
import pytest
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    SkipValidation,
    model_validator,
    root_validator,
    validator,
)
from pydantic_core import core_schema

from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec
from zeus_agent.wire.messages import (
    ErrorEvent,
    Mark,
    Measurement,
    Reply,
    TrainerEventBatch,
)
from zeus_agent.wire.node_batch import NodeMeasurementBatch

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


# ---------------------------------------------------------------- models of bounded depth
BOUNDED = [NodeMeasurementBatch, TrainerEventBatch, Mark, Measurement]


@pytest.mark.parametrize("model", BOUNDED)
def test_the_stream_models_nest_a_bounded_depth(model: type[BaseModel]) -> None:
    """Their payloads are walked only when they fail (see `codec._validate`)."""
    assert codec.schema_depth(model) <= codec.MAX_DEPTH


class MarksOpen(BaseModel):
    """A model that keeps unknown fields (none on the wire does): deep data would pass."""

    model_config = ConfigDict(extra="allow")
    marks: list[Mark] = []


@pytest.mark.parametrize("model", [Reply, ErrorEvent, MarksOpen])
def test_models_with_free_form_or_open_fields_are_unbounded(model: type[BaseModel]) -> None:
    """Free-form data (`Any`, a map) or unknown fields kept: walked before validation."""
    assert codec.schema_depth(model) > codec.MAX_DEPTH


def _walked_first(data: bytes, model: type[BaseModel]) -> Any:
    """`decode` as it was before bounded models: always walked before validation."""
    obj = codec.unpack(data)
    if isinstance(obj, dict) and len(obj) <= codec.MAX_FIELDS and codec._deeper_than(  # noqa: SLF001
            obj, codec.MAX_DEPTH):
        raise PayloadError(f"payload nests maps or lists more than {codec.MAX_DEPTH} levels deep")
    return codec.validate(model, obj)


def _deep(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def _hostile_batches() -> list[Any]:
    """Node batches: valid, deep in every place a peer could nest, and otherwise broken."""
    mark = {"kind": "step_begin", "epoch": 0, "step": 1, "t_ns": 5, "energy_j": 1.0}
    part = {"gpu": 0, "rank": 0, "marks": [mark]}
    batch = {"v": 1, "node": "n1", "job_id": "j", "gpus": [part]}
    deep = _deep(40)
    return [
        batch,
        {**batch, "node": deep},
        {**batch, "v": deep},
        {**batch, "v": 2, "x": deep},
        {**batch, "extra": deep},
        {**batch, "gpus": [{**part, "marks": [{**mark, "epoch": deep}]}]},
        {**batch, "gpus": [{**part, "marks": [{**mark, "energy_j": -1.0}]}]},
        {**batch, "gpus": [{**part, "marks": [deep]}]},
        {**batch, "gpus": deep},
        {**batch, "gpus": [part] * 9},
        {**batch, "v": 2},
        {"v": 1, "node": "n1"},
        {**batch, "gpus": [{**part, "marks": [_deep(20)]}]},
        [batch],
    ]


@pytest.mark.parametrize("payload", _hostile_batches())
def test_bounded_models_accept_and_refuse_as_when_walked_first(payload: Any) -> None:
    """Same result, same error (depth first when the payload is deep), walked first or not."""
    data = msgpack.packb(payload)
    try:
        expected: Any = _walked_first(data, NodeMeasurementBatch)
    except PayloadError as e:
        with pytest.raises(PayloadError) as got:
            codec.decode(data, NodeMeasurementBatch)
        assert (str(got.value), got.value.field) == (str(e), e.field)
    else:
        assert codec.decode(data, NodeMeasurementBatch) == expected


class _Loose(BaseModel):
    """A model whose validator sees the raw payload first (it could take any nesting)."""

    model_config = ConfigDict(extra="forbid")
    x: int = 0

    @model_validator(mode="before")
    @classmethod
    def _any(cls, data: Any) -> Any:
        return data


class _LooseField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: Annotated[int, BeforeValidator(lambda v: 0)] = 0


@pytest.mark.parametrize("model", [_Loose, _LooseField])
def test_models_whose_validators_see_raw_input_are_unbounded(model: type[BaseModel]) -> None:
    assert codec.schema_depth(model) > codec.MAX_DEPTH


_FORBID = ConfigDict(extra="forbid")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # (pydantic 1's decorators, on purpose)

    class _V1Pre(BaseModel):
        """Pydantic 1's `validator(pre=True)`: sees (and may drop) the raw value."""

        model_config = _FORBID
        x: int = 0

        @validator("x", pre=True)
        @classmethod
        def _any(cls, v: Any) -> Any:
            return 0

    class _RootPre(BaseModel):
        """Pydantic 1's `root_validator(pre=True)`: sees (and may drop) the raw payload."""

        model_config = _FORBID
        x: int = 0

        @root_validator(pre=True)
        @classmethod
        def _any(cls, data: Any) -> Any:
            return {}


class _Skipped(BaseModel):
    model_config = _FORBID
    x: SkipValidation[int] = 0


class _SkippedItems(BaseModel):
    model_config = _FORBID
    x: list[SkipValidation[int]] = []


class _OwnSchema(BaseModel):
    model_config = _FORBID
    x: Annotated[int, GetPydanticSchema(lambda _t, _h: core_schema.any_schema())] = 0


class _OwnModelSchema(BaseModel):
    """A model that builds its own schema (here: takes anything)."""

    model_config = _FORBID
    x: int = 0

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_plain_validator_function(lambda v: cls.model_construct())


@pytest.mark.parametrize("model", [_V1Pre, _RootPre, _Skipped, _SkippedItems, _OwnSchema,
                                   _OwnModelSchema])
def test_models_that_take_any_nesting_refuse_deep_payloads(model: type[BaseModel]) -> None:
    """Each takes a deep value validation does not check: walked before validation."""
    assert codec.schema_depth(model) > codec.MAX_DEPTH
    payload = {"x": [_deep(40)]} if model is _SkippedItems else {"x": _deep(40)}
    with pytest.raises(PayloadError, match="levels deep"):
        codec.decode(msgpack.packb(payload), model)


class _TagA(BaseModel):
    model_config = _FORBID
    op: Literal["a"]


class _TagB(BaseModel):
    model_config = _FORBID
    op: Literal["b"]


class _Tagged(BaseModel):
    model_config = _FORBID
    cmd: Annotated[_TagA | _TagB, Field(discriminator="op")]


class _TaggedItems(BaseModel):
    model_config = _FORBID
    cmds: list[Annotated[_TagA | _TagB, Field(discriminator="op")]]


@pytest.mark.parametrize(("model", "payload"), [
    (_Tagged, {"cmd": {"op": _deep(3000)}}),
    (_TaggedItems, {"cmds": [{"op": _deep(3000)}]}),
])
def test_deep_discriminators_are_refused_before_pydantic_prints_them(
        model: type[BaseModel], payload: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pydantic prints a tag it cannot read: near the recursion limit, an unraisable error."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    assert codec.schema_depth(model) > codec.MAX_DEPTH
    with pytest.raises(PayloadError, match="levels deep"):
        codec.validate(model, payload)
    assert unraisable == []


class _UnhashableMetadata(BaseModel):
    model_config = _FORBID
    x: list[Annotated[int, {"note": "metadata pydantic ignores"}]] = []


def test_unhashable_metadata_does_not_break_decoding() -> None:
    assert codec.schema_depth(_UnhashableMetadata) == 2
    assert codec.decode(msgpack.packb({"x": [1]}), _UnhashableMetadata).x == [1]
