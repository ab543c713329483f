"""A read-only check of the whole measuring path on a real NVIDIA GPU.

Never changes the GPU: this script calls no NVML setter, and the agent it starts runs with
`--observe-only` (it refuses every setter itself; `--observe-only` is accepted here too, and
changes nothing). The GPU's settings (power limit, enforced limit, application clocks,
persistence and compute mode) are read at the start and its current SM and memory clocks at
idle before the agent starts (with the training loop: once the model is on the GPU, since this
process's CUDA context, alive to the end, can hold an idle GPU's clocks up; `clocks_at_start`
gives the first read too); all are read again at the end, and if any differs the run FAILS
(exit 1, `changed` in the JSON names them; the current clocks are given 10 s to settle back
first, since they follow the load). On a GPU that is lent or shared, put a read-only `pynvml`
guard first on `PYTHONPATH` (a module that loads the real `pynvml` and makes every NVML
setter, reset and clear call raise `NO_PERMISSION`, keeping the refused calls in a `BLOCKED`
list and writing them to `$NVML_GUARD_LOG`): the JSON says whether it was in force
(`read_only.guard`), and any call it refused, here or in the agent, fails the run too. The
agent's guard writes to the same `$NVML_GUARD_LOG` when one is set (the lines it added during
the run are read back), else to a file of the script's own.

What it measures, in this order:

1. NVML facts: name, UUID, driver, NVML and CUDA driver versions, power limit, default and
   enforced limits and range, current, maximum and application clocks, persistence mode.
2. The cost of each NVML getter the agent uses, alone (no other reader), `--calls` calls each:
   energy counter, power usage, the `POWER_INSTANT` field, power-limit read, SM and memory
   clocks, temperature, utilisation (p50/p90/max, us).
3. The energy counter's update period, from back-to-back reads for `--seconds` (median and
   5-95% of the time between updates, each update placed in the middle of the two reads that
   bracket it; the reads' own cost).
4. Unless `--no-train`: an observe-only agent (`zeus-agent run --observe-only --backend nvml`,
   its own process, with a private nats-server) on that GPU, and a bf16 transformer training
   loop with torch (8 layers, d=2048, batch 8 x 1,024 tokens; its step time is measured and
   reported: the recorded H200 loop, also 8 layers at d=2048, ran 51 ms steps). After a
   warm-up (`--warmup-s`, while the agent learns the counter's phase), windows of 1, 5, 25 and
   100 steps, round robin, each measured at once by

   * the agent through `zeus_agent.emit` (`Publisher.measure`) in the default mode (at once)
     and in the exact mode (`exact=True`, asked from other threads so the loop does not wait),
   * Zeus's `ZeusMonitor` (`begin_window`/`end_window` around the same steps) when `zeus` is
     importable (Zeus 0.16),
   * the counter read at the window's edges here (`raw`);

   and, per window length, the median relative difference ours vs Zeus, vs raw, exact vs raw,
   and each one's error against the run's steady power (sum of the raw energies over the sum of
   their durations) times the window's length. Then emit's overhead on a real step: blocks of
   10 steps with and without `step_begin`/`step_end`, alternating in one run (median step time
   difference of the pairs, us and %). And the agent process's CPU time over the windows and
   overhead phases, per wall second and per GPU it watches (1).

Without a GPU (`pynvml` not importable, `nvmlInit` failing, 0 GPUs) it prints one JSON line
saying so (`"gpu": null`, `"reason"`) and exits 0. A GPU NVML lists but cannot open: the same
line, exit 1.

    python bench/real_gpu.py [--gpu N] [--steps 300] [--seconds 5] [--calls 200]
                             [--warmup-s 5] [--window-steps 1,5,25,100] [--no-train]
                             [--no-zeus] [--observe-only] [--json-only] [--rows rows.json]

The GPU: `--gpu N` (NVML index), else the first `CUDA_VISIBLE_DEVICES` names (an index, a
GPU UUID or its prefix, or a MIG instance's UUID, which means its whole GPU: NVML's counter is
the GPU's; `gpu.mig_mode` says whether MIG is on), else 0.

(`--device cpu` and the model's sizes, `--layers --width --batch --seq`, are for tests without
a GPU: the loop on the CPU, the agent on a fake NVML.) A GPU without an energy counter (before
Volta) gets the facts and getter costs only.

Progress goes to stderr, and so do Zeus's logs (Zeus logs to stdout); stdout gets a short
summary (not with `--json-only`) and, as its last line, one JSON object. SIGTERM or Ctrl-C
stops the agent and its nats-server, checks the GPU (without waiting for the clocks) and
prints the JSON line (`error`, exit 1); a second signal ends the script at once. Exit status:
0 passed (or no GPU), 1 a setting changed, a setter was attempted or the run failed (or was
stopped), 2 bad arguments (a GPU index NVML does not have, or a `CUDA_VISIBLE_DEVICES` UUID it
does not know).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended: a pynvml guard first on PYTHONPATH stays first

from _common import cpu_seconds, machine, now  # noqa: E402

from zeus_demo.cluster import wait_for  # noqa: E402

WINDOW_STEPS = (1, 5, 25, 100)
OVERHEAD_BLOCK = 10
"""Steps per block of the emit-overhead phase."""
EXACT_WORKERS = 4
"""Threads asking for exact windows (each ~60-200 ms): the loop never waits for them."""
SETTLE_S = 10.0
"""How long the current clocks get to come back to their values before the run."""
JOB_ID = "real-gpu-check"

# NVML constants (nvml.h), used when a pynvml lacks the name.
_CLOCK_SM, _CLOCK_MEM, _TEMPERATURE_GPU, _FI_POWER_INSTANT = 1, 2, 0, 186

_quiet = False


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


def finish(result: dict[str, Any], code: int) -> None:
    """Print the JSON line (last line of stdout) and exit with `code`."""
    result.setdefault("machine", machine())
    result.setdefault("date", now())
    print(json.dumps(clean(result), allow_nan=False), flush=True)
    sys.exit(code)


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p90 and max."""
    return {"n": len(values), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9),
            "max": max(values) if values else None}


def text(value: Any) -> str | None:
    """NVML strings (older pynvml versions return bytes); None stays None."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------- NVML
class Nvml:
    """The GPU under test through pynvml getters only (this class has no setter)."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.clock_sm = getattr(nvml, "NVML_CLOCK_SM", _CLOCK_SM)
        self.clock_mem = getattr(nvml, "NVML_CLOCK_MEM", _CLOCK_MEM)

    def get(self, function: str, *args: Any, device: bool = True) -> Any:
        """`nvml.<function>([handle,] *args)`, or None when NVML lacks or refuses it."""
        fn = getattr(self.nvml, function, None)
        if fn is None:
            return None
        try:
            return fn(self.handle, *args) if device else fn(*args)
        except Exception:  # noqa: BLE001 - NOT_SUPPORTED and the like: the fact is unknown
            return None

    def energy_j(self) -> float:
        """The energy counter (J)."""
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / 1000.0

    def settings(self) -> dict[str, Any]:
        """What this run must leave as it found it (None: not readable on this GPU)."""
        return {
            "power_limit_mw": self.get("nvmlDeviceGetPowerManagementLimit"),
            "enforced_power_limit_mw": self.get("nvmlDeviceGetEnforcedPowerLimit"),
            "app_sm_clock_mhz": self.get("nvmlDeviceGetApplicationsClock", self.clock_sm),
            "app_mem_clock_mhz": self.get("nvmlDeviceGetApplicationsClock", self.clock_mem),
            "persistence_mode": self.get("nvmlDeviceGetPersistenceMode"),
            "compute_mode": self.get("nvmlDeviceGetComputeMode"),
        }

    def clocks(self) -> dict[str, Any]:
        """The current SM and memory clocks (MHz): they follow the load."""
        return {"sm_clock_mhz": self.get("nvmlDeviceGetClockInfo", self.clock_sm),
                "mem_clock_mhz": self.get("nvmlDeviceGetClockInfo", self.clock_mem)}

    def facts(self, count: int) -> dict[str, Any]:
        """Name, versions, power limits and clocks."""
        g = self.get
        rng = g("nvmlDeviceGetPowerManagementLimitConstraints")

        def watts(mw: Any) -> float | None:
            return None if mw is None else int(mw) / 1000

        facts: dict[str, Any] = {
            "index": self.index,
            "gpus_seen": count,
            "name": text(g("nvmlDeviceGetName")),
            "uuid": text(g("nvmlDeviceGetUUID")),
            "driver": text(g("nvmlSystemGetDriverVersion", device=False)),
            "nvml_version": text(g("nvmlSystemGetNVMLVersion", device=False)),
            "cuda_driver_version": g("nvmlSystemGetCudaDriverVersion", device=False),
            "power_limit_w": watts(g("nvmlDeviceGetPowerManagementLimit")),
            "default_power_limit_w": watts(g("nvmlDeviceGetPowerManagementDefaultLimit")),
            "enforced_power_limit_w": watts(g("nvmlDeviceGetEnforcedPowerLimit")),
            "power_limit_range_w": None if rng is None else [watts(rng[0]), watts(rng[1])],
            **self.clocks(),
            "max_sm_clock_mhz": g("nvmlDeviceGetMaxClockInfo", self.clock_sm),
            "max_mem_clock_mhz": g("nvmlDeviceGetMaxClockInfo", self.clock_mem),
            "app_sm_clock_mhz": g("nvmlDeviceGetApplicationsClock", self.clock_sm),
            "app_mem_clock_mhz": g("nvmlDeviceGetApplicationsClock", self.clock_mem),
            "persistence_mode": g("nvmlDeviceGetPersistenceMode"),
            # [current, pending]; None: no MIG on this GPU. With MIG on, the counter is the
            # whole GPU's while a training loop runs on one instance.
            "mig_mode": g("nvmlDeviceGetMigMode"),
        }
        try:
            self.energy_j()
            facts["energy_counter"] = True
        except Exception:  # noqa: BLE001 - pre-Volta: no counter
            facts["energy_counter"] = False
        return facts

    def getters(self) -> dict[str, Callable[[], Any]]:
        """The getters the agent calls, by the names of data/real-gpu/h200/nvml_calls.json."""
        n, h = self.nvml, self.handle
        instant = getattr(n, "NVML_FI_DEV_POWER_INSTANT", _FI_POWER_INSTANT)
        temperature = getattr(n, "NVML_TEMPERATURE_GPU", _TEMPERATURE_GPU)
        return {
            "total_energy": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
            "power_usage": lambda: n.nvmlDeviceGetPowerUsage(h),
            "power_instant_field": lambda: n.nvmlDeviceGetFieldValues(h, [instant]),
            "power_limit": lambda: n.nvmlDeviceGetPowerManagementLimit(h),
            "sm_clock": lambda: n.nvmlDeviceGetClockInfo(h, self.clock_sm),
            "mem_clock": lambda: n.nvmlDeviceGetClockInfo(h, self.clock_mem),
            "temperature": lambda: n.nvmlDeviceGetTemperature(h, temperature),
            "utilization": lambda: n.nvmlDeviceGetUtilizationRates(h),
        }


def open_nvml(requested: int | None) -> tuple[Any, int | None, int] | str:
    """(pynvml, the GPU's NVML index, GPUs seen), or why there is no GPU to check.

    The index is None when `CUDA_VISIBLE_DEVICES` names a GPU NVML does not know."""
    try:
        import pynvml
    except ImportError as e:
        return f"pynvml is not importable ({e}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded...
        return f"nvmlInit failed: {e}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as e:  # noqa: BLE001
        return f"nvmlDeviceGetCount failed: {e}"
    if count == 0:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return "NVML sees 0 GPUs"
    index = requested if requested is not None else default_index(pynvml, count)
    return pynvml, index, count


def default_index(nvml: Any, count: int) -> int | None:
    """The NVML index of the first GPU `CUDA_VISIBLE_DEVICES` names, else 0.

    It may name an index, a GPU UUID (or its prefix, as CUDA accepts) or a MIG instance's UUID
    (then its parent GPU: NVML's energy counter and settings are the whole GPU's). None: it
    names a UUID NVML does not know."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        return int(first)
    if not first.startswith(("GPU-", "MIG-")):
        return 0
    with contextlib.suppress(Exception):  # the full UUID; a MIG instance's is a MIG handle
        handle = nvml.nvmlDeviceGetHandleByUUID(first)
        if first.startswith("MIG-"):
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return int(nvml.nvmlDeviceGetIndex(handle))
    for i in range(count):  # a prefix
        with contextlib.suppress(Exception):
            uuid = text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
            if uuid is not None and uuid.startswith(first):
                return i
    return None


# ------------------------------------------------------------------ costs and the counter
def getter_costs(gpu: Nvml, calls: int) -> dict[str, Any]:
    """p50/p90/max (us) of each getter: `calls` calls after 5 warm-up calls, one getter at a
    time."""
    costs: dict[str, Any] = {}
    pc = time.perf_counter_ns
    for name, call in gpu.getters().items():
        try:
            for _ in range(5):
                call()
            samples = []
            for _ in range(calls):
                t0 = pc()
                call()
                samples.append((pc() - t0) / 1000)
        except Exception as e:  # noqa: BLE001 - not supported on this GPU
            costs[name] = {"error": text(e)}
            continue
        costs[name] = spread(samples)
    return costs


def counter_period(gpu: Nvml, seconds: float) -> dict[str, Any]:
    """Read the counter back to back for `seconds`: its update period and the reads' cost."""
    mono = time.monotonic_ns
    end = mono() + int(seconds * 1e9)
    costs: list[float] = []
    instants: list[float] = []
    widths: list[float] = []
    increments: list[float] = []
    reads = changed = 0
    prev_t0 = prev_value = None
    while True:
        t0 = mono()
        value = gpu.energy_j()
        t1 = mono()
        reads += 1
        if len(costs) < 50_000:
            costs.append((t1 - t0) / 1e6)
        if prev_value is not None and value != prev_value:
            changed += 1
            assert prev_t0 is not None
            # The update came after the last read that saw the old value began and before
            # this one ended.
            instants.append((prev_t0 + t1) / 2e6)
            widths.append((t1 - prev_t0) / 1e6)
            increments.append(value - prev_value)
        prev_t0, prev_value = t0, value
        if t1 >= end:
            break
    periods = [b - a for a, b in zip(instants, instants[1:], strict=False)]
    return {
        "seconds": seconds,
        "reads": reads,
        "updates": changed,
        "continuous": reads > 10 and changed >= 0.9 * (reads - 1),
        "period_ms": {"p50": quantile(periods, 0.5), "p5": quantile(periods, 0.05),
                      "p95": quantile(periods, 0.95), "n": len(periods)},
        "bracket_ms_p50": quantile(widths, 0.5),
        "increment_j_p50": quantile(increments, 0.5),
        "read_cost_ms": {"p50": quantile(costs, 0.5), "p90": quantile(costs, 0.9),
                         "p99": quantile(costs, 0.99), "max": max(costs) if costs else None},
    }


def unchanged(gpu: Nvml, before: dict[str, Any], clocks_before: dict[str, Any],
              settle_s: float = SETTLE_S) -> tuple[list[str], dict[str, Any]]:
    """What differs from before the run (the settings at once, the current clocks after up to
    `settle_s` to settle), and the current clocks read last."""
    after = gpu.settings()
    changed = [f"{k}: {before[k]} -> {after[k]}" for k in before if before[k] != after[k]]
    reads: list[dict[str, Any]] = []

    def back() -> bool:
        reads[:] = [gpu.clocks()]
        return reads[0] == clocks_before

    wait_for(back, settle_s, interval_s=0.25, fail=False)  # `changed` names what is not back
    clocks = reads[0]
    changed += [f"{k} (current): {clocks_before[k]} -> {clocks[k]}"
                for k in clocks_before if clocks_before[k] != clocks[k]]
    return changed, clocks


def settled_clocks(gpu: Nvml, limit_s: float = 5.0) -> dict[str, Any]:
    """The current clocks once two reads 0.5 s apart agree (at most `limit_s`)."""
    reads: list[dict[str, Any]] = []

    def two_agree() -> bool:
        reads.append(gpu.clocks())
        return len(reads) > 1 and reads[-1] == reads[-2]

    wait_for(two_agree, limit_s, interval_s=0.5, fail=False)  # else the last read
    return reads[-1]


# --------------------------------------------------------------------------- the agent
@contextlib.contextmanager
def observe_only_agent(index: int, tmp: Path, guard_log: Path | None) -> Iterator[Any]:
    """A `zeus-agent run --observe-only --backend nvml` process watching GPU `index` only.

    `guard_log`: where a pynvml guard in the agent writes the calls it refused (the
    `NVML_GUARD_LOG` the script was given, else a file of its own). The process and its
    nats-server are stopped on the way out, whatever ends the block (an error, SIGTERM)."""
    from zeus_agent import children
    from zeus_agent.broker import EmbeddedNats

    sock = tmp / "agent.sock"
    log = tmp / "agent.log"
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*parts, str(REPO_ROOT)])  # a guard stays first
    if guard_log is not None:
        env["NVML_GUARD_LOG"] = str(guard_log)
    # Both children die with this script, SIGKILL included (a checker's hard timeout): nothing
    # is left reading the GPU's counter or holding a port.
    with EmbeddedNats(die_with_parent=True) as nats, log.open("ab") as out:
        argv = [sys.executable, "-m", "zeus_agent.cli", "run", "--observe-only",
                "--backend", "nvml", "--gpus", str(index), "--nats-url", nats.url,
                "--socket-path", str(sock), "--node", "real-gpu-check",
                "--log-level", "WARNING"]
        proc = children.popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                              stdout=out, stderr=subprocess.STDOUT)
        def failed() -> str:
            return "the observe-only agent did not start:\n" + log.read_text(
                errors="replace")[-2000:]

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(failed())
            return sock.exists()

        try:
            wait_for(started, 60, failed)
            yield proc, sock, log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# ------------------------------------------------------------------------ the training
def build_training(torch: Any, device: Any, args: argparse.Namespace) -> Callable[[], None]:
    """A bf16 transformer's training step (forward, backward, SGD) on `device`."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    heads = max(1, args.width // 128)
    model = torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(
            d_model=args.width, nhead=heads, dim_feedforward=4 * args.width, dropout=0.0,
            batch_first=True, device=device, dtype=dtype)
        for _ in range(args.layers)
    ])
    x = torch.randn(args.batch, args.seq, args.width, device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    return step


def cuda_device_for(torch: Any, uuid: str, fallback: int) -> tuple[int, str]:
    """The torch CUDA index of the GPU with NVML UUID `uuid` ("uuid"), else `fallback` ("index")."""
    for i in range(torch.cuda.device_count()):
        u = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        if u is not None and str(u) and str(u).lower() in uuid.lower():
            return i, "uuid"
    return fallback, "index"


def emit_index_for(nvml_index: int) -> int | None:
    """The CUDA index emit maps to NVML index `nvml_index` (via CUDA_VISIBLE_DEVICES), if any."""
    from zeus_agent.emit import physical_gpu_index

    for i in range(1024):
        try:
            if physical_gpu_index(i) == nvml_index:
                return i
        except ValueError:
            return None
    return None


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


def zeus_logs_to_stderr() -> None:
    """Zeus's loggers write to stdout (`zeus.utils.logging.get_logger`): move them to stderr,
    where the progress goes (stdout: the summary and, last, the JSON line)."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "zeus" or name.startswith("zeus.")) and isinstance(logger, logging.Logger):
            for handler in logger.handlers:
                if (isinstance(handler, logging.StreamHandler)
                        and handler.stream in (sys.stdout, sys.__stdout__)):
                    handler.setStream(sys.stderr)


def open_zeus(cuda_index: int) -> tuple[Any, dict[str, Any]]:
    """Zeus's `ZeusMonitor` on CUDA device `cuda_index` (None when Zeus is missing or fails to
    start) and what to report about it. Whatever Zeus prints goes to stderr."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import zeus
            from zeus.monitor import ZeusMonitor

            monitor = ZeusMonitor(gpu_indices=[cuda_index], cpu_indices=[])
    except Exception as e:  # noqa: BLE001 - not installed, or it could not start
        return None, {"skipped": f"{type(e).__name__}: {e}"}
    finally:
        zeus_logs_to_stderr()
    return monitor, {"version": getattr(zeus, "__version__", "unknown")}


def check_agent(proc: Any, log: Path) -> None:
    """Raise if the agent process has exited (its log's end in the message)."""
    if proc.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the observe-only agent exited (status {proc.returncode}):\n{tail}")


def train_and_measure(args: argparse.Namespace, gpu: Nvml, facts: dict[str, Any],
                      guard_log: Path | None, baseline: dict[str, Any]) -> dict[str, Any]:
    """The agent, the training loop, the windows, emit's overhead and the agent's CPU.

    Once the model is on the device (this process's CUDA context made) and before the agent
    starts, the GPU's idle clocks are read again into `baseline["clocks"]`: the end's check
    compares clocks read in the same state (idle, this context alive), since a context can hold
    a GPU's idle clocks where none held them."""
    try:
        import torch
    except ImportError as e:
        return {"skipped": f"torch is not importable ({e})"}
    from zeus_agent.emit import Publisher, physical_gpu_index
    from zeus_agent.wire.trainer import TrainerHello

    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    emit_index = emit_index_for(gpu.index)
    if emit_index is None:
        return {"skipped": f"NVML GPU {gpu.index} is not in CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}"}
    out: dict[str, Any] = {"device": args.device}
    cuda_index = None
    if on_cuda:
        cuda_index, matched = cuda_device_for(torch, str(facts.get("uuid")), emit_index)
        torch.cuda.set_device(cuda_index)
        device = torch.device("cuda", cuda_index)
        out.update(cuda_index=cuda_index, cuda_matched_by=matched)
        sync: Callable[[], None] = torch.cuda.synchronize
    else:  # tests: the loop on the CPU, the agent on a fake NVML
        device = torch.device("cpu")
        torch.set_num_threads(1)
        sync = lambda: None  # noqa: E731
    zeus_monitor = None
    zeus_reads = None if cuda_index is None else physical_gpu_index(cuda_index)
    if on_cuda and not args.no_zeus and zeus_reads != gpu.index:
        # Zeus maps CUDA indices to NVML's through CUDA_VISIBLE_DEVICES only.
        out["zeus"] = {"skipped": f"Zeus would read NVML GPU {zeus_reads}, not {gpu.index} "
                                  "(set CUDA_DEVICE_ORDER=PCI_BUS_ID)"}
    elif on_cuda and not args.no_zeus:
        assert cuda_index is not None
        zeus_monitor, out["zeus"] = open_zeus(cuda_index)
    else:
        out["zeus"] = {"skipped": "--no-zeus" if on_cuda else "not on a CUDA device"}

    progress(f"building the model (bf16, {args.layers} layers, d={args.width}, "
             f"batch {args.batch} x {args.seq}) on {device}")
    step = build_training(torch, device, args)
    out["model"] = {"layers": args.layers, "width": args.width, "batch": args.batch,
                    "seq": args.seq, "dtype": "bfloat16"}
    sync()
    baseline["clocks"] = settled_clocks(gpu)
    baseline["when"] = "idle, after this process made its CUDA context, before the agent"
    mono = time.monotonic_ns
    with tempfile.TemporaryDirectory(prefix="real-gpu-") as tmp_name, \
            observe_only_agent(gpu.index, Path(tmp_name), guard_log) as (proc, sock, log):
        progress(f"observe-only agent started (pid {proc.pid})")
        pub = Publisher(socket_path=str(sock), gpu_index=emit_index, timeout_s=3.0)
        rows: list[dict[str, Any]] = []
        asker: ExactAsker | None = None
        try:
            hello = pub.hello(TrainerHello(job_id=JOB_ID, rank=0, gpu_index=gpu.index))
            if hello is None:
                raise RuntimeError("the agent did not answer the trainer's HELLO")
            progress(f"warming up for {args.warmup_s:g} s (the agent learns the counter's phase)")
            until = time.monotonic() + args.warmup_s
            while time.monotonic() < until:
                check_agent(proc, log)
                pub.step_begin()
                step()
                pub.step_end()
                sync()
            timed = []
            for _ in range(10):
                t = time.perf_counter_ns()
                step()
                sync()
                timed.append((time.perf_counter_ns() - t) / 1e6)
            out["step_ms_p50"] = quantile(timed, 0.5)
            cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()

            sizes = args.window_steps
            counts = {s: max(5, args.steps // s) for s in sizes}
            progress(f"windows: {counts} (steps: windows), step {out['step_ms_p50']:.1f} ms")
            asker = ExactAsker(str(sock), emit_index, rows)
            done = dict.fromkeys(sizes, 0)
            next_report = time.monotonic() + 10
            while any(done[s] < counts[s] for s in sizes):
                check_agent(proc, log)
                for steps in sizes:
                    if done[steps] >= counts[steps]:
                        continue
                    key = f"w{len(rows)}"
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
                        row.update(zeus=float(m.gpu_energy[cuda_index]), zeus_t=float(m.time))
                    rows.append(row)
                    asker.ask(len(rows) - 1, t0, t1)
                    done[steps] += 1
                if time.monotonic() >= next_report:
                    progress(f"windows done: {done}")
                    next_report = time.monotonic() + 10
            asker.stop()
            check_agent(proc, log)

            pairs = max(4, args.steps // (2 * OVERHEAD_BLOCK))
            progress(f"emit overhead: {pairs} pairs of {OVERHEAD_BLOCK}-step blocks")
            out["emit_overhead"] = emit_overhead(pub, step, sync, pairs)
            cpu1, wall1 = cpu_seconds(proc.pid), time.monotonic()
        finally:
            if asker is not None:
                asker.stop()
            pub.close()
            if asker is not None:
                asker.close()
        out["windows"] = summarize_windows(rows, args.window_steps)
        if args.rows:
            Path(args.rows).write_text(json.dumps(clean(rows)))
        wall = wall1 - wall0
        out["agent_cpu"] = {
            "cpu_s": cpu1 - cpu0, "wall_s": wall, "gpus": 1,
            "pct_of_one_core_per_gpu": 100 * (cpu1 - cpu0) / wall if wall > 0 else None,
        }
        warnings = [line for line in log.read_text(errors="replace").splitlines()
                    if "WARNING" in line or "ERROR" in line]
        out["agent_log_warnings"] = warnings[-10:]
    return out


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


# --------------------------------------------------------------------------------- main
def steps_list(value: str) -> tuple[int, ...]:
    """'1,5,25' -> (1, 5, 25); each at least 1."""
    try:
        steps = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of step counts: {value!r}") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"step counts must be positive: {value!r}")
    return steps


class Interrupted(BaseException):
    """SIGTERM or SIGINT: stop the agent, check the GPU, print the JSON line (exit 1).

    A BaseException, so that no `except Exception` on the way swallows it."""


def on_signal(signum: int, _frame: Any) -> None:
    """The first SIGTERM/SIGINT ends the run cleanly; a second one ends the process at once."""
    signal.signal(signum, signal.SIG_DFL)
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def guard_log_path() -> tuple[Path, bool]:
    """Where a pynvml guard writes the calls it refuses: the `NVML_GUARD_LOG` the script was
    given (kept: whoever runs the check reads it), else a file of its own (True: remove it)."""
    given = os.environ.get("NVML_GUARD_LOG")
    if given:
        return Path(given), False
    fd, name = tempfile.mkstemp(prefix="real-gpu-guard-", suffix=".log")
    os.close(fd)
    return Path(name), True


def main() -> None:
    global _quiet
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=None,
                        help="NVML index of the GPU (default: the first CUDA_VISIBLE_DEVICES "
                             "names, else 0)")
    parser.add_argument("--steps", type=int, default=300,
                        help="steps per window length (at least 5 windows each); the emit "
                             "overhead phase runs as many")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="how long to read the counter back to back for its period")
    parser.add_argument("--calls", type=int, default=200, help="calls per getter timed")
    parser.add_argument("--warmup-s", type=float, default=5.0,
                        help="training before the windows (the agent learns the counter's phase)")
    parser.add_argument("--no-train", action="store_true",
                        help="facts, getter costs and the counter's period only (no agent)")
    parser.add_argument("--no-zeus", action="store_true", help="do not use Zeus's ZeusMonitor")
    parser.add_argument("--observe-only", action="store_true",
                        help="accepted for clarity: the check is always read-only and its agent "
                             "always runs with --observe-only")
    parser.add_argument("--json-only", action="store_true",
                        help="stdout gets only the JSON line (progress stays on stderr)")
    parser.add_argument("--rows", default=None, help="write every window's figures here (JSON)")
    parser.add_argument("--window-steps", type=steps_list, default=WINDOW_STEPS,
                        help="window lengths in steps, comma separated (default 1,5,25,100)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the training loop runs (cpu: for tests without a GPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    for name in ("steps", "calls", "layers", "width", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.seconds <= 0 or args.warmup_s < 0:
        parser.error("--seconds must be positive and --warmup-s not negative")
    _quiet = args.json_only
    result: dict[str, Any] = {"bench": "real_gpu"}

    opened = open_nvml(args.gpu)
    if isinstance(opened, str):
        say(f"no GPU to check: {opened}")
        finish(result | {"gpu": None, "reason": opened}, 0)
        return
    nvml, index, count = opened
    if index is None or not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if index is None:
            reason = (f"CUDA_VISIBLE_DEVICES={visible!r} names none of the {count} GPU(s) NVML "
                      "sees; pass --gpu N")
        else:
            reason = f"NVML sees {count} GPU(s): index {index} is not one of them"
            if args.gpu is None:
                reason += f" (from CUDA_VISIBLE_DEVICES={visible!r}; pass --gpu N)"
        finish(result | {"gpu": None, "reason": reason}, 2)
        return
    guard = hasattr(nvml, "BLOCKED")
    try:
        gpu = Nvml(nvml, index)
    except Exception as e:  # noqa: BLE001 - NO_PERMISSION in a container, GPU_IS_LOST...
        reason = f"NVML GPU {index} could not be opened: {type(e).__name__}: {text(e)}"
        finish(result | {"gpu": None, "reason": reason, "ok": False}, 1)
        return
    settings_before = gpu.settings()
    clocks_at_start = gpu.clocks()
    baseline: dict[str, Any] = {"clocks": clocks_at_start,
                                "when": "at the start, before this process used CUDA"}
    facts = gpu.facts(count)
    progress(f"GPU {index}: {facts['name']}, driver {facts['driver']}, limit "
             f"{facts['power_limit_w']} W; pynvml guard {'in force' if guard else 'absent'}")
    result["gpu"] = facts
    error: str | None = None
    guard_log: Path | None = None
    own_guard_log = False
    guard_log_start = 0
    changed: list[str] = []
    clocks_after: dict[str, Any] = {}
    blocked: list[str] = []
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        progress(f"timing the getters ({args.calls} calls each)")
        result["getter_cost_us"] = getter_costs(gpu, args.calls)
        if not facts["energy_counter"]:  # before Volta: the agent integrates power instead
            result["counter"] = {"skipped": "this GPU has no energy counter"}
            result["train"] = {"skipped": "this GPU has no energy counter to read at the edges"}
        else:
            progress(f"reading the energy counter back to back for {args.seconds:g} s")
            result["counter"] = counter_period(gpu, args.seconds)
        if args.no_train and "train" not in result:
            result["train"] = {"skipped": "--no-train"}
        elif "train" not in result:
            if guard:  # the agent's guard writes the calls it refused there
                guard_log, own_guard_log = guard_log_path()
                guard_log_start = guard_log.stat().st_size if guard_log.exists() else 0
            result["train"] = train_and_measure(args, gpu, facts, guard_log, baseline)
    except (Exception, Interrupted) as e:  # noqa: BLE001 - report it; the GPU is still checked
        error = f"{type(e).__name__}: {e}"
        progress(f"failed: {error}")
    finally:
        try:
            progress("checking that nothing changed")
            settle_s = 0.0 if error is not None and error.startswith("Interrupted") else SETTLE_S
            changed, clocks_after = unchanged(gpu, settings_before, baseline["clocks"], settle_s)
            blocked = [f"bench: {name}" for name in getattr(nvml, "BLOCKED", [])]
            if guard_log is not None and guard_log.exists():
                with guard_log.open("rb") as fh:
                    fh.seek(guard_log_start)
                    lines = fh.read().decode(errors="replace").splitlines()
                mine = f"{os.getpid()} "  # this process's refusals: already in BLOCKED
                blocked += [f"agent: {line}" for line in lines
                            if line.strip() and not line.startswith(mine)]
                if own_guard_log:
                    guard_log.unlink()
        except Interrupted as e:  # the check itself was interrupted: say so
            error = error or f"Interrupted: {e}"
            changed.append("not checked: interrupted")
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
        for sig, handler in handlers.items():  # from here on a signal ends the process
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    result["read_only"] = {
        "guard": guard, "observe_only_agent": not args.no_train,
        "settings_before": settings_before, "clocks_at_start": clocks_at_start,
        "clocks_before": baseline["clocks"], "clocks_before_when": baseline["when"],
        "clocks_after": clocks_after, "changed": changed, "setter_calls_blocked": blocked,
    }
    ok = not changed and not blocked and error is None
    result["ok"] = ok
    if error is not None:
        result["error"] = error
    try:
        summary(result)
    except Exception as e:  # noqa: BLE001 - the JSON line comes whatever the summary does
        progress(f"summary failed: {type(e).__name__}: {e}")
    finish(result, 0 if ok else 1)


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


if __name__ == "__main__":
    main()
