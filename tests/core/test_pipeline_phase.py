"""A pipeline job's phases: the transition table is data, and the job keeps to it."""

from __future__ import annotations

import itertools
import json

import pytest

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.phase import TRANSITIONS, Phase, PhaseError, check_transition
from coordinator.pipeline.schedulers import FrequencyScheduler, ScheduleGenerator
from zeus_agent.models import FrequencySchedule, JobInfo, RankInfo

ALLOWED = sorted((old, new) for old, news in TRANSITIONS.items() for new in news)
FORBIDDEN = sorted((old, new) for old, new in itertools.product(Phase, Phase)
                   if new not in TRANSITIONS[old])


def test_the_phases_keep_the_words_of_the_status() -> None:
    assert [p.value for p in Phase] == ["discovering", "profiling", "serving", "error", "stopped"]
    assert Phase.SERVING == "serving" and f"{Phase.PROFILING}" == "profiling"
    assert json.dumps({"phase": Phase.ERROR}) == '{"phase": "error"}'
    assert [p for p in Phase if p.final] == [Phase.ERROR, Phase.STOPPED]


def test_the_table_covers_every_phase_and_nothing_leaves_a_final_one() -> None:
    assert set(TRANSITIONS) == set(Phase)
    for phase in Phase:
        if phase.final:
            assert all(new.final for new in TRANSITIONS[phase])
        else:
            assert {Phase.ERROR, Phase.STOPPED} <= TRANSITIONS[phase]  # Any phase may stop.
    assert Phase.DISCOVERING not in set().union(*TRANSITIONS.values())  # Never back.


@pytest.mark.parametrize(("old", "new"), ALLOWED)
def test_every_allowed_transition_works(old: Phase, new: Phase) -> None:
    assert check_transition(old, new) is new
    assert check_transition(old, new.value) is new  # By its word too.


@pytest.mark.parametrize(("old", "new"), FORBIDDEN)
def test_every_forbidden_transition_raises(old: Phase, new: Phase) -> None:
    with pytest.raises(PhaseError, match=f"cannot go from {old.value} to {new.value}"):
        check_transition(old, new)


def test_not_a_phase_raises() -> None:
    with pytest.raises(PhaseError, match="'served' is not a pipeline job phase"):
        check_transition(Phase.PROFILING, "served")


class Once(FrequencyScheduler):
    """Yields one schedule at the top clock and finishes."""

    def _run(self) -> ScheduleGenerator:
        yield [FrequencySchedule(rank=i.rank, frequencies=[(n, 1500) for n in i.instructions or []])
               for i in self.rank_infos]


def job() -> PipelineJob:
    info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    ranks = [RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1500])]
    return PipelineJob("j", info, ranks, lambda i, r: Once(i, r, None), profiling_iterations=1)


def test_the_job_checks_every_change() -> None:
    j = job()
    assert j.phase is Phase.DISCOVERING
    with pytest.raises(PhaseError, match="from discovering to serving"):
        j.phase = Phase.SERVING
    assert j.phase is Phase.DISCOVERING  # Unchanged by the refused change.
    j.phase = "profiling"
    j.phase = Phase.SERVING
    j.abort("stop")
    assert j.phase is Phase.ERROR and j.done
    with pytest.raises(PhaseError, match="from error to profiling"):
        j.phase = Phase.PROFILING
    j.abort("again")  # A stopped job stopped again: allowed, says why again.
    assert j.phase is Phase.ERROR


def test_the_status_and_progress_carry_plain_words() -> None:
    j = job()
    status = j.start()[0]
    assert type(status.state) is str and status.state == "discovering"  # type: ignore[union-attr]
    assert type(j.progress()["phase"]) is str
