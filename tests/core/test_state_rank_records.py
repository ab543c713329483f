"""A rank's record carries its GPU's limits and energy-counter period, so the job's owner (which
may not be the replica that relayed the registration) never asks the GPU's agent again."""

from __future__ import annotations

import json
import math

import pytest

from coordinator.jobs import RankRecord
from coordinator.state import records
from zeus_agent.wire.messages import GpuBinding, RankInfo

pytestmark = pytest.mark.core

JOB = "job-1"


def rank_record() -> RankRecord:
    return RankRecord(RankInfo(rank=3, dp_rank=3, pp_rank=0, tp_rank=0,
                               available_frequencies=[]), GpuBinding(node="n1", gpu_index=3))


def decoded(value: bytes) -> records.Change:
    return records.decode(records.rank_key(JOB, 3), value, False, 0.0)


@pytest.mark.parametrize("period", [100.0, 0.0, None])
def test_a_described_gpu_records_its_period_even_when_unknown(period: float | None) -> None:
    change = decoded(records.encode_rank(JOB, rank_record(), (100, 300), period))
    assert change.limits == (100, 300)
    assert change.period_recorded and change.energy_period_ms == period


def test_without_a_description_nothing_is_recorded() -> None:
    change = decoded(records.encode_rank(JOB, rank_record()))
    assert change.limits is None and not change.period_recorded


def test_a_record_written_without_the_period_still_reads() -> None:
    """Records of an earlier version: the owner asks the GPU's agent for the period."""
    plain = {"job_id": JOB, **rank_record().plain(), "limits": [100, 300]}
    change = decoded(records._dump(plain))  # noqa: SLF001 - the earlier layout, by hand
    assert change.limits == (100, 300) and not change.period_recorded


@pytest.mark.parametrize("bad", [math.nan, -1.0, 1e9, True, "100"])
def test_an_impossible_period_is_a_bad_record(bad: object) -> None:
    plain = {"job_id": JOB, **rank_record().plain(), "limits": [100, 300],
             "energy_period_ms": bad}
    with pytest.raises(records.RecordError, match="energy_period_ms"):
        decoded(records._dump(plain))  # noqa: SLF001


@pytest.mark.parametrize("job_id",
                         ["job+1:abc", 'q"uo\\te', "n\u00e9\u4e2d\U0001f600", "\ud800x", ""])
def test_a_gpu_binding_is_encoded_as_the_general_encoder_would(job_id: str) -> None:
    rank = 4095
    assert records.encode_gpu(job_id, rank) == records._dump(  # noqa: SLF001
        {"job_id": job_id, "rank": rank}, records.RANK_VERSION)
    assert records.rank_of_gpu_value(records.encode_gpu(job_id, rank)) == rank


def test_a_rank_is_encoded_as_the_general_encoder_would_read_it() -> None:
    """`encode_rank` formats its JSON itself: it reads back as `_dump`'s value."""
    rank = RankRecord(RankInfo(rank=3, dp_rank=3, pp_rank=0, tp_rank=0,
                               available_frequencies=[1740, 210], instructions=["f\u00e9", "b"]),
                      GpuBinding(node="n\u00f6de\u4e2d", gpu_index=3, gpu_uuid="GPU-1"))
    for limits, period in (((100, 300), 12.5), ((100, 300), None), (None, None)):
        plain = {"job_id": JOB, **rank.plain(), "limits": list(limits) if limits else None}
        if limits:
            plain["energy_period_ms"] = period
        expected = json.loads(records._dump(plain, records.RANK_VERSION))  # noqa: SLF001
        assert json.loads(records.encode_rank(JOB, rank, limits, period)) == expected


@pytest.mark.parametrize("value", [None, 0, 7, -3, 2**70, 12.5, 1e-7, 1e300])
def test_a_number_is_written_as_the_general_encoder_writes_it(value: object) -> None:
    assert records._number(value) == records._ENCODE(value).encode()  # noqa: SLF001


RANK_VALUES = [
    {"limits": [100, 300], "energy_period_ms": 5},
    {"limits": [100, 300]},
    {"limits": None, "energy_period_ms": 5},
    {"limits": [], "energy_period_ms": "x"},
    {"limits": [100, True]},
    {"limits": [300, 100]},
    {"limits": [100.0, 300]},
    {"energy_period_ms": True, "limits": [1, 2]},
    {"v": 1},
    {"v": True},
    {"v": 3},
    {"v": "2"},
    {"job_id": 7},
    {"job_id": "another job"},
    {"info": {"rank": 4, "dp_rank": 3, "pp_rank": 0, "tp_rank": 0,
              "available_frequencies": []}},
    {"info": {"rank": "3", "dp_rank": 3.0, "pp_rank": 0, "tp_rank": 0,
              "available_frequencies": [], "extra": 1}},
    {"info": {"rank": 3, "dp_rank": 3, "pp_rank": 0, "tp_rank": 0}},
    {"info": [3]},
    {"gpu": {"node": "n1", "gpu_index": 3, "bad": 1}},
    {"gpu": {"node": "n1", "gpu_index": -1}},
    {"gpu": {"node": "n1", "gpu_index": "3"}},
    {"extra": {"x": [1, 2]}},
]


@pytest.mark.parametrize("change", RANK_VALUES)
def test_the_fast_rank_decoding_reads_what_the_general_one_reads(
        change: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's value decoded in one pass (`_rank_change`) is what `decode` makes of it, or
    left to it: the same change, or the same error."""
    value = {"v": 2, "job_id": JOB, **rank_record().plain(), **change}
    raw = json.dumps(value).encode()
    fast = records._rank_change(records.job_hash(JOB), "3", raw)  # noqa: SLF001
    monkeypatch.setattr(records, "_rank_change", lambda *_: None)
    try:
        general: records.Change | str = decoded(raw)
    except records.RecordError as e:
        general = f"{type(e).__name__}: {e}"
    assert fast is None or fast == general
    monkeypatch.undo()
    try:
        both: records.Change | str = decoded(raw)
    except records.RecordError as e:
        both = f"{type(e).__name__}: {e}"
    assert both == general


@pytest.mark.parametrize("limits, period", [((100, 300), 12.5), ((100, 300), None), (None, None)])
def test_what_encode_rank_writes_is_read_in_one_pass(limits: tuple[int, int] | None,
                                                     period: float | None) -> None:
    raw = records.encode_rank(JOB, rank_record(), limits, period)
    fast = records._rank_change(records.job_hash(JOB), "3", raw)  # noqa: SLF001
    assert fast is not None and fast == decoded(raw)
    assert fast.rank == rank_record() and fast.limits == limits
