"""The grid event's judge on measured draws: each job's ratio from its GPUs' energy counters."""

from __future__ import annotations

from zeus_demo.budget import analysis as an
from zeus_demo.budget.event import RATIO_WINDOW_S, Watcher, measured_ratios
from zeus_demo.budget.jobs import JobSpec

WORKLOAD = "A40+resnet50+gpu0"
SIGNAL_S = 100.0


def counters(watch: Watcher, key: an.GpuKey, watts: float, limit: int) -> None:
    """A GPU drawing `watts` steadily from 80 s to the signal (samples every 0.2 s)."""
    for i in range(101):
        t = 80.0 + 0.2 * i
        watch.series.add(key, t, watts * (t - 80.0), limit)


def test_each_jobs_draw_before_the_signal_over_its_curve_and_the_idle_gpus_draw() -> None:
    job = JobSpec("bj00", WORKLOAD, "A40", (("n0", 0), ("n0", 1)))
    watch = Watcher([job])
    optimum = 250
    sim = an.SimJob(job.tag, WORKLOAD, "A40", job.gpus, optimum)
    group = an.true_group([sim], cap_w=1000.0, idle_w=60.0)
    curve_w = an.curve_draw(group.jobs[0]) / 2  # per GPU, at the optimum
    for key in job.gpus:
        counters(watch, key, 0.9 * curve_w, optimum)
    counters(watch, ("n0", 2), 25.0, 100)  # an idle GPU
    keys = sorted(watch.series.samples)
    ratios, idle_w = measured_ratios(watch, group, keys, set(job.gpus), SIGNAL_S)
    assert abs(ratios["bj00"] - 0.9) < 1e-9
    assert idle_w is not None and abs(idle_w - 25.0) < 1e-9
    assert RATIO_WINDOW_S <= 20.0  # (inside the samples above)
    # A job whose GPUs are not sampled over the window is judged on its curve.
    late = Watcher([job])
    ratios, idle_w = measured_ratios(late, group, [], set(job.gpus), SIGNAL_S)
    assert ratios == {"bj00": 1.0} and idle_w is None
