"""Regenerate `zeus_agent/gpu/sim/timing_h200.py` from the H200 recordings in `h200/` (see `h200/README.md`).

    python data/real-gpu/make_timing_table.py          # rewrite the module
    python data/real-gpu/make_timing_table.py --check  # exit 1 when it is out of date

The simulator needs these figures installed with the package (it never reads `data/`), so they
become a small generated module of 101-quantile tables:

* the energy counter's read cost: the quantiles of ``t1_ns - t0_ns`` over the ~10k back-to-back
  reads of `trace_counter.csv.gz` (idle and loaded phases alike, as an agent reads it);
* the other getters: `nvml_calls.json` has only p50, p90 and max (GPU alone): a log-normal
  through p50 and p90 for the 0-99% quantiles, the recorded maximum as the 100% one;
* the counter's update jitter: offsets of the update instants from a fitted 100 ms grid. An
  update is seen between two reads (the value changed), so its instant is known only to within
  those reads; slow reads (p95 16 ms) widen that to tens of ms and make the *observed* periods
  look far noisier (5-95%: 93.6-106.2 ms) than the counter is. The offsets come from the updates
  bracketed within 4 ms (70% of them): 5-95% about -1.2..+1.3 ms, an upper bound on the true
  jitter. Read back to back through the read-cost model, the simulated counter shows the
  recorded observed spread again (tests/core/test_sim_timing.py checks it).

Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "h200"
TARGET = HERE.parents[1] / "zeus_agent" / "gpu" / "sim" / "timing_h200.py"
GRID_NS = 100_000_000
NARROW_NS = 4_000_000
GETTERS = {
    "power": "power_usage",
    "power_instant": "power_instant_field",
    "power_limit": "power_limit",
    "sm_clock": "sm_clock",
    "mem_clock": "mem_clock",
    "temperature": "temperature",
    "utilization": "utilization",
}


def quantiles(values: list[float], count: int = 101) -> list[float]:
    """Linear-interpolated quantiles at 0, 1/(count-1), ..., 1 (numpy's default method)."""
    data = sorted(values)
    out = []
    for i in range(count):
        h = (len(data) - 1) * i / (count - 1)
        lo = math.floor(h)
        hi = min(lo + 1, len(data) - 1)
        out.append(data[lo] + (data[hi] - data[lo]) * (h - lo))
    return out


def lognormal_table(p50: float, p90: float, top: float) -> list[float]:
    """101 quantiles: a log-normal through p50 and p90 up to 99%, then the recorded maximum."""
    normal = statistics.NormalDist()
    sigma = math.log(p90 / p50) / normal.inv_cdf(0.9)
    out = []
    for i in range(100):
        z = normal.inv_cdf(max(i / 100, 0.001))
        out.append(p50 * math.exp(sigma * z))
    out.append(max(top, out[-1]))
    return out


def counter_trace() -> tuple[list[float], list[float]]:
    """Return (read costs in us, update-instant offsets from the 100 ms grid in us)."""
    with gzip.open(SOURCE / "trace_counter.csv.gz", "rt") as fh:
        rows = [(int(r["t0_ns"]), int(r["t1_ns"]), int(r["energy_mj"])) for r in csv.DictReader(fh)]
    costs = [(t1 - t0) / 1000 for t0, t1, _ in rows]
    mids = [(t0 + t1) / 2 for t0, t1, _ in rows]
    instants = []  # (estimated instant, bracket width) for each change of value
    for i in range(1, len(rows)):
        if rows[i][2] != rows[i - 1][2]:
            instants.append(((mids[i - 1] + mids[i]) / 2, mids[i] - mids[i - 1]))
    first = instants[0][0]
    narrow = [(round((t - first) / GRID_NS), t) for t, width in instants if width < NARROW_NS]
    # Least-squares grid t = a + k * period over the narrow brackets.
    n = len(narrow)
    mk = sum(k for k, _ in narrow) / n
    mt = sum(t for _, t in narrow) / n
    period = sum((k - mk) * (t - mt) for k, t in narrow) / sum((k - mk) ** 2 for k, _ in narrow)
    residuals = [(t - mt - (k - mk) * period) / 1000 for k, t in narrow]
    centre = statistics.median(residuals)
    return costs, [r - centre for r in residuals]


def render() -> str:
    """Return the module's text."""
    calls = json.loads((SOURCE / "nvml_calls.json").read_text())["alone"]
    costs, offsets = counter_trace()
    tables = {"energy": quantiles(costs)}
    for kind, key in GETTERS.items():
        rec = calls[key]
        tables[kind] = lognormal_table(rec["p50_us"], rec["p90_us"], rec["max_us"])
    lines = [
        '"""NVML call costs and energy-counter jitter of one NVIDIA H200 (generated; do not edit).',
        "",
        "Recorded on one NVIDIA H200, driver 580.159.04, 2026-11-26, read-only",
        "(`data/real-gpu/h200/`); regenerate with `python data/real-gpu/make_timing_table.py`.",
        "Each table holds 101 quantiles (0%, 1%, ..., 100%) in microseconds.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "# fmt: off",
        "LATENCY_US: dict[str, tuple[float, ...]] = {",
    ]
    for kind, table in tables.items():
        lines.append(f'    "{kind}": (')
        lines.extend(_rows(table, 2))
        lines.append("    ),")
    lines.append("}")
    lines.append('"""Cost of one call by kind (`zeus_agent.gpu.sim.timing.CallKind` values)."""')
    lines.append("")
    lines.append("COUNTER_OFFSET_US: tuple[float, ...] = (")
    lines.extend(_rows(quantiles(offsets), 1))
    lines.append(")")
    lines.append(
        '"""Offset of an energy-counter update from its 100 ms grid instant (median 0)."""'
    )
    lines.append("")
    lines.append(f"COUNTER_PERIOD_US = {GRID_NS / 1000:.1f}")
    lines.append('"""The counter\'s update period (fitted: 99.9996 ms)."""')
    lines.append("# fmt: on")
    return "\n".join(lines) + "\n"


def _rows(values: list[float], indent: int) -> list[str]:
    """Format numbers (0.1 us from 100 us up, else 0.001 us) ten per line."""
    pad = "    " * indent
    out = []
    for i in range(0, len(values), 10):
        chunk = ", ".join(_fmt(v) for v in values[i : i + 10])
        out.append(f"{pad}{chunk},")
    return out


def _fmt(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def main() -> int:
    """Write the module, or with --check compare it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the module is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        print(f"{TARGET} is up to date")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
