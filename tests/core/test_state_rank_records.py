"""A rank's record carries its GPU's limits and energy-counter period, so the job's owner (which
may not be the replica that relayed the registration) never asks the GPU's agent again."""

from __future__ import annotations

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
    assert records.encode_gpu(job_id, rank) == records._dump({"job_id": job_id, "rank": rank})
    assert records.rank_of_gpu_value(records.encode_gpu(job_id, rank)) == rank
