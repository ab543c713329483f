"""What `bench/real_gpu.py` prints: progress on stderr, a summary and the JSON line on stdout.

Kept apart from the measuring so that every step reports the same way; `set_quiet` is the only
state (`--json-only`: stdout gets the JSON line alone).
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, NoReturn

from _common import machine, now

_quiet = False


def set_quiet(quiet: bool) -> None:
    """`--json-only`: no summary lines on stdout, only the JSON line."""
    global _quiet
    _quiet = quiet


def progress(message: str) -> None:
    """One progress line on stderr."""
    print(f"[real_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def say(message: str) -> None:
    """A summary line on stdout (not with --json-only)."""
    if not _quiet:
        print(message, flush=True)


def clean(value: Any) -> Any:
    """`value` with NaN and infinities as None (strict JSON), floats rounded to 6 digits."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def finish(result: dict[str, Any], code: int) -> NoReturn:
    """Print the JSON line (last line of stdout) and exit with `code`."""
    result.setdefault("machine", machine())
    result.setdefault("date", now())
    print(json.dumps(clean(result), allow_nan=False), flush=True)
    sys.exit(code)


def fmt(value: Any, digits: int = 1) -> str:
    """A number for the summary ('-' when unknown)."""
    if isinstance(value, int | float) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return "-"


def summary(result: dict[str, Any]) -> None:
    """A few human lines on stdout."""
    facts = result["gpu"]
    say(f"GPU {facts['index']}: {facts['name']} (driver {facts['driver']}, NVML "
        f"{facts['nvml_version']}), power limit {facts['power_limit_w']} W "
        f"{facts['power_limit_range_w']}, SM {facts['sm_clock_mhz']} MHz, "
        f"memory {facts['mem_clock_mhz']} MHz")
    for name, c in result.get("getter_cost_us", {}).items():
        if "error" in c:
            say(f"  {name:<20} {c['error']}")
        else:
            say(f"  {name:<20} p50 {fmt(c['p50']):>9} us  p90 {fmt(c['p90']):>9} us  "
                f"max {fmt(c['max']):>9} us")
    counter = result.get("counter")
    if counter and "skipped" in counter:
        say(f"energy counter: {counter['skipped']}")
    elif counter:
        p = counter["period_ms"]
        say(f"energy counter: {counter['updates']} updates in {counter['reads']} reads, period "
            f"p50 {fmt(p['p50'], 2)} ms (5-95%: {fmt(p['p5'])}-{fmt(p['p95'])} ms)")
    train = result.get("train", {})
    if "skipped" in train:
        say(f"training: skipped ({train['skipped']})")
    windows = train.get("windows", {})
    for key, w in windows.items():
        if not isinstance(w, dict):
            continue
        e = w["error_vs_steady_pct"]
        say(f"  {key:>3} steps ({fmt(w['t_ms_p50'], 0)} ms, {w['windows']} windows): median "
            f"error vs steady power ours {fmt(e['ours']['p50'], 2)}%, exact "
            f"{fmt(e['ours_exact']['p50'], 2)}%, zeus {fmt(e['zeus']['p50'], 2)}%, raw "
            f"{fmt(e['raw']['p50'], 2)}%; ours vs zeus {fmt(w['ours_vs_zeus_pct']['p50'], 2)}%")
    over = train.get("emit_overhead")
    if over:
        say(f"emit on a real step: {fmt(over['diff_us_p50'])} us ({fmt(over['diff_pct'], 3)}%), "
            f"the calls {fmt(over['emit_calls_us_per_step']['p50'])} us per step")
    cpu = train.get("agent_cpu")
    if cpu:
        say(f"agent CPU: {fmt(cpu['pct_of_one_core_per_gpu'], 2)}% of one core per GPU")
    ro = result["read_only"]
    say(f"read-only: guard {'in force' if ro['guard'] else 'absent'}; changed: "
        f"{ro['changed'] or 'nothing'}; setter calls blocked: {ro['setter_calls_blocked'] or 0}")
    if not result["ok"]:
        why = result.get("error") or "a setting changed or a setter was attempted (above)"
        say(f"FAILED: {why}")

