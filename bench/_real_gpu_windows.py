"""The measuring phases of `bench/real_gpu.py` once its observe-only agent runs.

The warm-up, the loop's step time, the windows (each measured at once by emit, Zeus and the
counter's edges; emit's exact figure asked from other threads so the loop never waits), emit's
overhead on a real step, and the windows' summary. Apart from the setting up (the agent, the
model, Zeus: `_real_gpu_train`) so each phase reads as one step.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from _real_gpu_nvml import Nvml, quantile, spread
from _real_gpu_report import progress

OVERHEAD_BLOCK = 10
"""Steps per block of the emit-overhead phase."""
EXACT_WORKERS = 4
"""Threads asking for exact windows (each ~60-200 ms): the loop never waits for them."""


@dataclass(frozen=True)
class Loop:
    """The training loop under measurement: one step, the device's sync, and the CUDA index
    Zeus reports the GPU's energy under (None on the CPU)."""

    step: Callable[[], None]
    sync: Callable[[], None]
    cuda_index: int | None


def warm_up(pub: Any, loop: Loop, seconds: float, check: Callable[[], None]) -> None:
    """Train with step events for `seconds`, while the agent learns the counter's phase."""
    progress(f"warming up for {seconds:g} s (the agent learns the counter's phase)")
    step, sync = loop.step, loop.sync
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        check()
        pub.step_begin()
        step()
        pub.step_end()
        sync()


def step_ms_p50(loop: Loop) -> float:
    """The median time of 10 steps without step events (ms)."""
    step, sync = loop.step, loop.sync
    timed = []
    for _ in range(10):
        t = time.perf_counter_ns()
        step()
        sync()
        timed.append((time.perf_counter_ns() - t) / 1e6)
    return quantile(timed, 0.5)


def measure_window(gpu: Nvml, pub: Any, loop: Loop, zeus_monitor: Any, key: str,
                   steps: int) -> tuple[dict[str, Any], int, int]:
    """One window of `steps` steps, measured at once by emit, Zeus and the counter's edges.

    Returns its row (the exact figure comes later, from `ExactAsker`) and its edges (ns)."""
    mono = time.monotonic_ns
    step, sync = loop.step, loop.sync
    sync()
    t0 = mono()
    r0 = mono()
    e0 = gpu.energy_j()
    r0 = (r0 + mono()) // 2
    if zeus_monitor is not None:
        zeus_monitor.begin_window(key, sync_execution=False)
    for _ in range(steps):
        pub.step_begin()
        step()
        pub.step_end()
    sync()
    t1 = mono()
    r1 = mono()
    e1 = gpu.energy_j()
    r1 = (r1 + mono()) // 2
    ours = pub.measure(t0, t1)[0]
    row: dict[str, Any] = {
        "steps": steps, "t": (t1 - t0) / 1e9, "ours": ours,
        "ours_exact": math.nan, "raw": e1 - e0, "raw_t": (r1 - r0) / 1e9,
        "zeus": None, "zeus_t": None,
    }
    if zeus_monitor is not None:
        m = zeus_monitor.end_window(key, sync_execution=False)
        row.update(zeus=float(m.gpu_energy[loop.cuda_index]), zeus_t=float(m.time))
    return row, t0, t1


def run_windows(gpu: Nvml, pub: Any, loop: Loop, zeus_monitor: Any, asker: ExactAsker,
                sizes: Sequence[int], counts: dict[int, int], rows: list[dict[str, Any]],
                check: Callable[[], None]) -> None:
    """Windows of each length in `sizes`, round robin, until each has its count.

    Each row goes to `rows` and its edges to `asker` for the exact figure; `check` raises if
    the agent has exited."""
    done = dict.fromkeys(sizes, 0)
    next_report = time.monotonic() + 10
    while any(done[s] < counts[s] for s in sizes):
        check()
        for steps in sizes:
            if done[steps] >= counts[steps]:
                continue
            row, t0, t1 = measure_window(gpu, pub, loop, zeus_monitor, f"w{len(rows)}", steps)
            rows.append(row)
            asker.ask(len(rows) - 1, t0, t1)
            done[steps] += 1
        if time.monotonic() >= next_report:
            progress(f"windows done: {done}")
            next_report = time.monotonic() + 10


def relative(a: float, b: float) -> float:
    """|a - b| / b (NaN when b is not positive or either is NaN)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return math.nan
    return abs(a - b) / b


def pct_stats(values: Sequence[float]) -> dict[str, Any]:
    finite = [100 * v for v in values if math.isfinite(v)]
    return {"p50": quantile(finite, 0.5), "p90": quantile(finite, 0.9), "n": len(finite)}


def summarize_windows(rows: list[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    """Per window length: how the ways of measuring agree, and each one's error vs steady power."""
    raw_e = sum(r["raw"] for r in rows)
    raw_t = sum(r["raw_t"] for r in rows)
    steady_w = raw_e / raw_t if raw_t > 0 else math.nan
    out: dict[str, Any] = {"steady_power_w": steady_w}
    for steps in sizes:
        rs = [r for r in rows if r["steps"] == steps]
        if not rs:
            continue

        def per_s(r: dict[str, Any], key: str, t: str = "t") -> float:
            return float(r[key]) / r[t] if r.get(key) is not None and r[t] > 0 else math.nan

        zeus = [r for r in rs if r.get("zeus") is not None]
        entry: dict[str, Any] = {
            "windows": len(rs),
            "t_ms_p50": quantile([1000 * r["t"] for r in rs], 0.5),
            "unanswered": {"ours": sum(not math.isfinite(r["ours"]) for r in rs),
                           "ours_exact": sum(not math.isfinite(r["ours_exact"]) for r in rs)},
            "zero_energy": {"raw": sum(r["raw"] <= 0 for r in rs),
                            "zeus": sum(r["zeus"] <= 0 for r in zeus)},
            # Each way stamps its own edges (a few ms apart): compared per second of its window.
            "ours_vs_zeus_pct": pct_stats([relative(per_s(r, "ours"), per_s(r, "zeus", "zeus_t"))
                                           for r in zeus]),
            "exact_vs_zeus_pct": pct_stats([relative(per_s(r, "ours_exact"),
                                                     per_s(r, "zeus", "zeus_t")) for r in zeus]),
            "ours_vs_raw_pct": pct_stats([relative(per_s(r, "ours"), per_s(r, "raw", "raw_t"))
                                          for r in rs]),
            "exact_vs_raw_pct": pct_stats([relative(per_s(r, "ours_exact"),
                                                    per_s(r, "raw", "raw_t")) for r in rs]),
            "exact_vs_default_pct": pct_stats([relative(r["ours_exact"], r["ours"]) for r in rs]),
            "error_vs_steady_pct": {
                "ours": pct_stats([relative(r["ours"], steady_w * r["t"]) for r in rs]),
                "ours_exact": pct_stats([relative(r["ours_exact"], steady_w * r["t"])
                                         for r in rs]),
                "zeus": pct_stats([relative(r["zeus"], steady_w * r["zeus_t"]) for r in zeus]),
                "raw": pct_stats([relative(r["raw"], steady_w * r["raw_t"]) for r in rs]),
            },
            "exact_reply_after_end_ms": spread([r["exact_after_ms"] for r in rs
                                                if r.get("exact_after_ms") is not None]),
        }
        out[str(steps)] = entry
    return out


class ExactAsker:
    """Threads with their own publishers asking for exact windows as the loop hands them over."""

    def __init__(self, socket_path: str, emit_index: int, rows: list[dict[str, Any]]) -> None:
        from zeus_agent.emit import Publisher

        self._rows = rows
        self._stopped = False
        self._queue: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self._publishers = [Publisher(socket_path=socket_path, gpu_index=emit_index,
                                      timeout_s=3.0) for _ in range(EXACT_WORKERS)]
        self._threads = [threading.Thread(target=self._work, args=(p,), daemon=True)
                         for p in self._publishers]
        for t in self._threads:
            t.start()

    def ask(self, row: int, t0: int, t1: int) -> None:
        self._queue.put((row, t0, t1))

    def _work(self, publisher: Any) -> None:
        while (item := self._queue.get()) is not None:
            row, t0, t1 = item
            asked = time.monotonic_ns()
            energy = publisher.measure(t0, t1, exact=True)[0]
            done = time.monotonic_ns()
            self._rows[row].update(ours_exact=energy, exact_after_ms=(done - t1) / 1e6,
                                   exact_asked_after_ms=(asked - t1) / 1e6)

    def stop(self) -> None:
        """Wait for the answers still due (the publishers stay open). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(10)

    def close(self) -> None:
        """Close the publishers: after the trainer's, since a goodbye from any socket of this
        process unbinds the process's GPU on the agent."""
        for p in self._publishers:
            p.close()



def emit_overhead(pub: Any, step: Callable[[], None], sync: Callable[[], None],
                  pairs: int) -> dict[str, Any]:
    """Blocks of steps with and without step events, alternating (ABBA), in one run."""
    pc = time.perf_counter_ns
    with_emit: list[float] = []
    without: list[float] = []
    calls: list[float] = []

    def block(use_emit: bool) -> float:
        sync()
        start = pc()
        for _ in range(OVERHEAD_BLOCK):
            if use_emit:
                a = pc()
                pub.step_begin()
                b = pc()
                step()
                c = pc()
                pub.step_end()
                calls.append((b - a + pc() - c) / 1000)
            else:
                step()
        sync()
        return (pc() - start) / OVERHEAD_BLOCK / 1000

    for i in range(pairs):
        for use_emit in ((True, False) if i % 2 == 0 else (False, True)):
            (with_emit if use_emit else without).append(block(use_emit))
    diffs = [a - b for a, b in zip(with_emit, without, strict=True)]
    base = quantile(without, 0.5)
    diff = quantile(diffs, 0.5)
    return {
        "pairs": pairs, "block_steps": OVERHEAD_BLOCK,
        "step_us_with_emit_p50": quantile(with_emit, 0.5),
        "step_us_without_p50": base,
        "diff_us_p50": diff,
        "diff_pct": 100 * diff / base if base > 0 else None,
        "emit_calls_us_per_step": spread(calls),
    }

