"""The cores take a columnar batch's rows (`MarkRow`, `MeasurementRow`) as they take the models.

A node's `NodeColumnBatch` reaches the cores as tuples with the rows' field names, never a
pydantic model per item: fed the same items, as models or as the rows a columnar batch of them
gives (encoded, decoded), the power-limit and the pipeline cores produce the same actions and
end in the same state. Whole node batches too (every rank's part per step, fed as the
service feeds them): power-limit windows measured to the end with marks lost, counts restarted
and None limits; pipeline rounds profiled to serving with stale, ahead or missing schedule
versions, epochs and changed orders.
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


# ------------------------------------------------------------------ whole node batches
# The tests above feed random items that seldom complete a power-limit window (no window is
# measured in most examples) or reach a schedule past the first: these feed a node's batch of
# every rank per step, as the service does (each part's marks, then its measurements), so the
# windows are measured and the pipeline profiles and serves, with losses, stale or missing
# schedule versions, epochs and None power limits mixed in.


def node_parts(parts: list[GpuMeasurements]) -> tuple[list[Any], list[Any]]:
    """The same node's batch as the service feeds it: rows' parts, and its columns' parts."""
    rows = NodeMeasurementBatch(node="n", job_id="j", gpus=parts)
    batch = decode_measurements(codec.encode(NodeColumnBatch.from_rows(rows)))
    assert isinstance(batch, NodeColumnBatch)
    return rows.gpus, batch.parts()


def feed(job: Any, parts: list[Any], now_s: float) -> list[Any]:
    """Each part's marks, then its measurements, as `Streams` feeds them; every action."""
    out: list[Any] = []
    for part in parts:
        out += [a for m in part.marks for a in job.on_mark(part.rank, m)]
        out += [job.plans_on(m) for m in part.measurements]
        out += [a for m in part.measurements for a in job.on_measurement(part.rank, m, now_s)]
    return out


PL_STEP = st.tuples(
    st.lists(st.floats(0, 1e4, allow_nan=False), min_size=3, max_size=3),  # energy per rank
    st.lists(st.integers(0, 39).map(lambda n: n > 0), min_size=3, max_size=3),  # mark kept
    st.sampled_from([None, 300, 275, 250]),  # the limit the marks report
    st.integers(0, 29).map(lambda n: n == 0),  # the count restarts in a new epoch
    st.booleans(),  # step_end and epoch marks too
)  # fmt: skip


def pl_step_parts(step: int, epoch: int, energy: list[float], kept: list[bool],
                  limit: int | None, extra: bool) -> list[GpuMeasurements]:
    """One step's marks of ranks 0-2 (rank r on GPU r), a part per rank."""
    parts = []
    for rank in range(3):
        if not kept[rank]:
            continue
        marks = [Mark(kind="step_begin", epoch=epoch, step=step, t_ns=step * 10**9,
                      energy_j=energy[rank], power_limit_w=limit)]
        if extra:
            marks += [Mark(kind="step_end", epoch=epoch, step=step, t_ns=step * 10**9 + 5,
                           energy_j=energy[rank], power_limit_w=None),
                      Mark(kind="epoch_end", epoch=epoch, step=step, t_ns=step * 10**9 + 6,
                           energy_j=energy[rank], power_limit_w=limit)]
        parts.append(GpuMeasurements(gpu=rank, rank=rank, marks=marks, join_digest=None))
    return parts


def run_power_limit(steps: list[tuple[Any, ...]]) -> tuple[PowerLimitJob, PowerLimitJob]:
    """Both cores fed the same steps, one from rows, one from columns (actions compared)."""
    models, rows = power_limit_job(), power_limit_job()
    energy, epoch, step = [0.0, 0.0, 0.0], 0, 0
    for n, (added, kept, limit, restart, extra) in enumerate(steps):
        epoch, step = (epoch + 1, 0) if restart else (epoch, step + 1)
        energy = [e + a for e, a in zip(energy, added, strict=True)]
        event = TrainerEvent(kind="step_begin", t_ns=step * 10**9, step=step)
        assert models.on_event(0, event, float(n)) == rows.on_event(0, event, float(n))
        as_models, as_rows = node_parts(pl_step_parts(step, epoch, energy, kept, limit, extra))
        assert feed(models, as_models, float(n)) == feed(rows, as_rows, float(n))
        assert models.tick(float(n)) == rows.tick(float(n))
    assert models.progress() == rows.progress()
    assert models.persisted() == rows.persisted()
    return models, rows


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(PL_STEP, min_size=8, max_size=40))
def test_the_power_limit_core_measures_node_batches_alike_in_either_layout(
        steps: list[tuple[Any, ...]]) -> None:
    run_power_limit(steps)


def test_node_batches_in_columns_measure_every_window_of_a_power_limit_job() -> None:
    """Nothing lost: the job measures its 3 limits from the columns' marks, as from rows."""
    steps = [([100.0 + n, 101.0, 102.5], [True] * 3, None if n % 3 else 300, False, n % 2 == 0)
             for n in range(40)]
    models, rows = run_power_limit(steps)
    assert rows.progress()["phase"] == "Done" and rows.progress()["measured"] == 3
    assert rows.progress()["measurements"] == models.progress()["measurements"]


PIPELINE_STEP = st.tuples(
    st.lists(st.sampled_from([0, 0, 0, 0, 0, -1, 1, None]), min_size=2, max_size=2),  # version
    st.floats(0.5, 2.0),  # time scale
    st.lists(st.integers(0, 9).map(lambda n: n > 0), min_size=2, max_size=2),  # same order
    st.integers(0, 3),  # epoch
    st.booleans(),  # rank 1's part first
)  # fmt: skip


def pipeline_step_parts(job: PipelineJob, step: int, shifts: list[int | None], scale: float,
                        alike: list[bool], epoch: int, swap: bool) -> list[GpuMeasurements]:
    """One step of ranks 0 and 1 (rank r on GPU r): versions relative to the job's."""
    parts = []
    for rank in (1, 0) if swap else (0, 1):
        shift = shifts[rank]
        version = (None if shift is None or job.version is None
                   else max(0, job.version + shift))
        names = ORDERS[rank] if alike[rank] else ORDERS[rank][::-1]
        measured = [m.model_copy(update={"epoch": epoch})
                    for m in iteration(rank, step, version, scale, names)]
        parts.append(GpuMeasurements(gpu=rank, rank=rank, measurements=measured))
    return parts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(PIPELINE_STEP, min_size=1, max_size=14))
def test_the_pipeline_core_profiles_node_batches_alike_in_either_layout(
        steps: list[tuple[Any, ...]]) -> None:
    models, rows = pipeline_job(), pipeline_job()
    assert models.start() == rows.start()
    for n, (shifts, scale, alike, epoch, swap) in enumerate(steps):
        as_models, as_rows = node_parts(pipeline_step_parts(models, n, shifts, scale, alike,
                                                            epoch, swap))
        assert feed(models, as_models, float(n)) == feed(rows, as_rows, float(n))
        assert models.version == rows.version
    assert models.progress() == rows.progress()
    assert models.persisted() == rows.persisted()


def test_node_batches_in_columns_take_a_pipeline_job_through_profiling_to_serving() -> None:
    """Nothing stale: both rounds profiled (schedule versions 0 and 1) from columns' rows."""
    job = pipeline_job()
    job.start()
    for n in range(6):
        _, as_rows = node_parts(pipeline_step_parts(job, n, [0, 0], 1.0 + n / 10,
                                                    [True, True], 0, False))
        feed(job, as_rows, float(n))
    assert (job.phase.value, job.version, job.progress()["observed"]) == ("serving", 1, 2)
