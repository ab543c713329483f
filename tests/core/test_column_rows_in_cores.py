"""The cores take a columnar batch's rows (`MarkRow`, `MeasurementRow`) as they take the models.

A node's `NodeColumnBatch` reaches the cores as tuples with the rows' field names, never a
pydantic model per item: fed the same items, as models or as the rows a columnar batch of them
gives (encoded, decoded), the power-limit and the pipeline cores produce the same actions and
end in the same state.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.pipeline.job import PipelineJob
from coordinator.pipeline.schedulers import FrequencyScheduler
from coordinator.power_limit.job import PowerLimitJob
from zeus_agent.models import FrequencySchedule, JobInfo, RankInfo
from zeus_agent.wire import codec
from zeus_agent.wire.messages import Mark, Measurement, PowerLimitOptions, TrainerEvent
from zeus_agent.wire.node_batch import GpuMeasurements, NodeMeasurementBatch
from zeus_agent.wire.node_columns import (
    MarkRow,
    MeasurementRow,
    NodeColumnBatch,
    decode_measurements,
)


def through_columns(rank: int, marks: list[Mark], measurements: list[Measurement]
                    ) -> tuple[list[MarkRow], list[MeasurementRow]]:
    """The items as a coordinator gets them from a columnar batch on the wire."""
    rows = NodeMeasurementBatch(node="n", job_id="j", gpus=[
        GpuMeasurements(gpu=rank, rank=rank, marks=marks, measurements=measurements)])
    batch = decode_measurements(codec.encode(NodeColumnBatch.from_rows(rows)))
    assert isinstance(batch, NodeColumnBatch)
    (part,) = batch.parts()
    return part.marks, part.measurements


MARKS = st.builds(
    lambda kind, epoch, step, t, e, limit: Mark(kind=kind, epoch=epoch, step=step, t_ns=t,
                                                energy_j=e, power_limit_w=limit),
    st.sampled_from(["step_begin", "step_begin", "step_begin", "step_end", "epoch_begin",
                     "epoch_end"]),
    st.integers(0, 1), st.integers(0, 12), st.integers(0, 10**12),
    st.floats(0, 1e6, allow_nan=False), st.one_of(st.none(), st.sampled_from([275, 300])),
)  # fmt: skip
PL_INPUTS = st.lists(st.one_of(
    st.tuples(st.just("event"), st.just(0), st.integers(0, 12)),
    st.tuples(st.just("marks"), st.integers(0, 2), st.lists(MARKS, max_size=5)),
), max_size=30)  # fmt: skip


def power_limit_job() -> PowerLimitJob:
    options = PowerLimitOptions(selector="Energy", wait_steps=0, warmup_steps=0,
                                profile_steps=2, pl_step_w=25)
    job = PowerLimitJob("j", options, ranks=[0, 1, 2], min_power_limit_w=250,
                        max_power_limit_w=300)
    job.start()
    return job


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=PL_INPUTS)
def test_the_power_limit_core_takes_mark_rows_as_marks(inputs: list[tuple[Any, ...]]) -> None:
    models, rows = power_limit_job(), power_limit_job()
    for what, rank, item in inputs:
        if what == "event":
            event = TrainerEvent(kind="step_begin", t_ns=item * 10**9, step=item)
            assert models.on_event(rank, event, 1.0) == rows.on_event(rank, event, 1.0)
            continue
        as_rows, _ = through_columns(rank, item, [])
        assert [models.on_mark(rank, m) for m in item] == [rows.on_mark(rank, r)
                                                            for r in as_rows]
    assert models.progress() == rows.progress()
    assert models.persisted() == rows.persisted()


ORDERS = {0: ["forward", "forward", "backward"], 1: ["forward", "backward", "backward"]}
CLOCKS = [1410, 1200]


class TwoRounds(FrequencyScheduler):
    """Runs every instruction at each of CLOCKS in turn."""

    def _run(self) -> Any:
        for clock in CLOCKS:
            yield [FrequencySchedule(rank=i.rank, frequencies=[
                (name, clock) for name in i.instructions or []]) for i in self.rank_infos]


def pipeline_job() -> PipelineJob:
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
             for r in range(2)]
    return PipelineJob("job", info, ranks, lambda ji, ri: TwoRounds(ji, ri, None),
                       scheduler_name="TwoRounds", profiling_iterations=1)


def iteration(rank: int, step: int, version: int | None, scale: float,
              names: list[str]) -> list[Measurement]:
    """One step of `rank`: its instructions (`names`), then the step's measurement."""
    out = [Measurement(kind="instruction", name=name, epoch=0, step=step, index=step * 10 + i,
                       t0_ns=i, t1_ns=i + 1, time_s=0.1 * scale * (i + 1), energy_j=10.0 * scale,
                       schedule=version) for i, name in enumerate(names)]
    return out + [Measurement(kind="step", name="", epoch=0, step=step, index=0, t0_ns=0,
                              t1_ns=9, time_s=scale, energy_j=100.0 * scale, schedule=version)]


PIPELINE_INPUTS = st.lists(st.tuples(
    st.integers(0, 1), st.integers(0, 8), st.one_of(st.none(), st.integers(0, 2)),
    st.floats(0.5, 2.0), st.booleans()), max_size=16)  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=PIPELINE_INPUTS)
def test_the_pipeline_core_takes_measurement_rows_as_measurements(
        inputs: list[tuple[int, int, int | None, float, bool]]) -> None:
    models, rows = pipeline_job(), pipeline_job()
    models.start()
    rows.start()
    for rank, step, version, scale, alike in inputs:
        names = ORDERS[rank] if alike else ORDERS[rank][::-1]
        measured = iteration(rank, step, version, scale, names)
        _, as_rows = through_columns(rank, [], measured)
        assert [models.plans_on(m) for m in measured] == [rows.plans_on(r) for r in as_rows]
        assert [models.on_measurement(rank, m, 1.0) for m in measured] == [
            rows.on_measurement(rank, r, 1.0) for r in as_rows]
    assert models.progress() == rows.progress()
    assert models.persisted() == rows.persisted()
