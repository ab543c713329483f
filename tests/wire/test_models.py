import json
import re

import pytest
from pydantic import ValidationError

from zeus_agent.models import (
    CSV_COLUMNS,
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    PowerLimitMeasurement,
    ProfilingResult,
    RankInfo,
    load_prof,
    load_ranks,
    load_sched,
    save_prof,
    save_ranks,
    save_sched,
)


def test_job_info_world_size_must_be_product():
    JobInfo(pp_degree=2, dp_degree=3, tp_degree=4, world_size=24)
    with pytest.raises(ValidationError, match="world_size"):
        JobInfo(pp_degree=2, dp_degree=3, tp_degree=4, world_size=23)


@pytest.mark.parametrize("field", ["pp_degree", "dp_degree", "tp_degree", "world_size"])
def test_job_info_degrees_at_least_one(field):
    args = dict(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    args[field] = 0
    with pytest.raises(ValidationError, match=field):
        JobInfo(**args)


def test_job_info_refuses_client_job_id():
    with pytest.raises(ValidationError, match="job_id"):
        JobInfo(job_id="mine", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)


def test_set_job_id_format():
    job = JobInfo(pp_degree=4, dp_degree=2, tp_degree=1, world_size=8, job_metadata="gpt3")
    job.set_job_id("PointSolution")
    assert re.fullmatch(
        r"\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2}\+dp2\+pp4\+tp1\+PointSolution\+gpt3", job.job_id
    )
    bare = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    bare.set_job_id("X")
    assert bare.job_id.endswith("+dp1+pp1+tp1+X")


def test_rank_info_and_schedule_validation():
    with pytest.raises(ValidationError):
        RankInfo(rank=-1, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[])
    sched = FrequencySchedule(rank=1, frequencies=[("forward", 1410), ("backward", 1200)])
    assert sched.frequencies[0] == ("forward", 1410)
    with pytest.raises(ValidationError):
        FrequencySchedule(rank=0, frequencies=[("forward", "fast")])


def test_power_limit_measurement_positive():
    PowerLimitMeasurement(power_limit=300, energy=1.0, time=2.0)
    with pytest.raises(ValidationError):
        PowerLimitMeasurement(power_limit=0, energy=1.0, time=2.0)


def _offline(rank: int, pp: int) -> OfflineProfilingResult:
    return OfflineProfilingResult(
        rank=rank,
        dp_rank=0,
        pp_rank=pp,
        tp_rank=0,
        forward_time={1410: 0.01, 1200: 0.012},
        forward_energy={1410: 2.5, 1200: 2.0},
        backward_time={1410: 0.02},
        backward_energy={1410: 5.25},
    )


def test_instruction_profiling_csv_round_trip(tmp_path):
    result = InstructionProfilingResult([_offline(0, 0), _offline(1, 1)])
    path = str(tmp_path / "prof.csv")
    result.to_csv(path)
    lines = (tmp_path / "prof.csv").read_text().splitlines()
    assert lines[0] == ",".join(CSV_COLUMNS)
    assert lines[1] == "0,0,0,0,0,forward,1410,0.01,2.5"
    assert lines[4] == "1,0,1,0,1,forward,1410,0.01,2.5"
    assert len(lines) == 1 + 2 * 3
    assert InstructionProfilingResult.from_csv(path) == result


def test_to_csv_requires_csv_suffix(tmp_path):
    with pytest.raises(ValueError, match="does not end with '.csv'"):
        InstructionProfilingResult([]).to_csv(str(tmp_path / "x.txt"))


def test_from_csv_rejects_other_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("rank,time\n0,1\n")
    with pytest.raises(ValueError, match="expected columns"):
        InstructionProfilingResult.from_csv(str(path))


def test_dump_helpers_round_trip(tmp_path):
    d = str(tmp_path / "dump")
    prof = [ProfilingResult(rank=0, iter_time=[1.0], iter_energy=[2.0])]
    sched = [FrequencySchedule(rank=0, frequencies=[("forward", 1000)])]
    ranks = [RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1000])]
    save_prof(prof, d, 3)
    save_sched(sched, d, 3)
    save_ranks(ranks, d)
    assert load_prof(d, 3) == prof
    assert load_sched(d, 3) == sched
    assert load_ranks(d) == ranks


def test_instruction_profiling_result_accepts_zeus_root_keyword():
    entry = _offline(0, 0)
    assert InstructionProfilingResult(__root__=[entry]) == InstructionProfilingResult([entry])
    assert InstructionProfilingResult.model_validate([entry.model_dump()]).root == [entry]


def _with_non_finite():
    inf, nan = float("inf"), float("nan")
    return [
        ProfilingResult(
            rank=1,
            iter_time=[1.0, inf],
            iter_energy=[-inf, nan],
            time_breakdown={"forward": [[0.5, inf]]},
            energy_breakdown={"forward": [[nan, -inf]]},
        )
    ]


def test_save_prof_writes_infinity_and_nan_as_python_json_does(tmp_path):
    # Zeus (pydantic v1's .json(), i.e. Python's json) writes Infinity/-Infinity/NaN; null
    # could be read back by neither Zeus's load_prof nor ours.
    save_prof(_with_non_finite(), str(tmp_path), 0)
    text = (tmp_path / "0.prof.json").read_text()
    assert "null" not in text
    assert "Infinity" in text and "-Infinity" in text and "NaN" in text
    # Python's json (what Zeus's parse_file uses) reads it to the same values.
    (data,) = json.loads(text)
    assert repr(data["iter_time"]) == "[1.0, inf]"
    assert repr(data["iter_energy"]) == "[-inf, nan]"
    assert repr(data["time_breakdown"]) == "{'forward': [[0.5, inf]]}"
    assert repr(data["energy_breakdown"]) == "{'forward': [[nan, -inf]]}"


def test_load_prof_reads_back_infinity_and_nan_both_ways(tmp_path):
    expected = repr(_with_non_finite())
    save_prof(_with_non_finite(), str(tmp_path), 1)
    assert repr(load_prof(str(tmp_path), 1)) == expected  # NaN != NaN: compare the reprs.
    # A file as Zeus writes it (Python's json.dumps defaults, with spaces).
    zeus_text = json.dumps([r.model_dump() for r in _with_non_finite()])
    assert "Infinity" in zeus_text and "NaN" in zeus_text
    (tmp_path / "2.prof.json").write_text(zeus_text)
    assert repr(load_prof(str(tmp_path), 2)) == expected
