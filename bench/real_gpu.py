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

The code: this script (arguments, the order of the check, the read-only verdict) and its
helpers next to it, `_real_gpu_nvml.py` (NVML getters: facts, costs, the counter, the end's
check), `_real_gpu_train.py` (the agent, the model, Zeus), `_real_gpu_windows.py` (the measuring
phases) and `_real_gpu_report.py` (progress, summary, the JSON line).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended: a pynvml guard first on PYTHONPATH stays first

from _real_gpu_nvml import (  # noqa: E402
    SETTLE_S,
    Nvml,
    counter_period,
    getter_costs,
    open_nvml,
    text,
    unchanged,
)
from _real_gpu_report import finish, progress, say, set_quiet, summary  # noqa: E402
from _real_gpu_train import open_zeus as open_zeus  # noqa: E402 - tests call it here
from _real_gpu_train import train_and_measure  # noqa: E402

WINDOW_STEPS = (1, 5, 25, 100)


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


class GuardLog:
    """Where the agent's pynvml guard writes the calls it refused (None: no guard, or no agent),
    whether the file is this script's own, and its size before the agent started.

    A plain class, not a dataclass: a test loads this script without registering it as a
    module, and dataclasses look their module up."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.own = False
        self.start = 0

    def open(self) -> None:
        """Choose the file (`guard_log_path`) and note how much an earlier run left in it."""
        self.path, self.own = guard_log_path()
        self.start = self.path.stat().st_size if self.path.exists() else 0

    def agent_refusals(self) -> list[str]:
        """The lines the agent's guard added during the run (this process's are in `BLOCKED`)."""
        if self.path is None or not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.start)
            lines = fh.read().decode(errors="replace").splitlines()
        mine = f"{os.getpid()} "  # this process's refusals: already in BLOCKED
        return [f"agent: {line}" for line in lines
                if line.strip() and not line.startswith(mine)]

    def remove_own(self) -> None:
        """Remove the file if it is the script's own (the caller's `NVML_GUARD_LOG` is kept)."""
        if self.path is not None and self.path.exists() and self.own:
            self.path.unlink()


def parse_args() -> argparse.Namespace:
    """The command line, checked (exit 2 on bad values)."""
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
    return args


def open_gpu(args: argparse.Namespace, result: dict[str, Any]) -> tuple[Any, Nvml, int]:
    """pynvml, the GPU under test and the GPUs NVML sees; else the JSON line and the exit (0: no
    GPU, 2: a GPU it does not have, 1: one it cannot open)."""
    opened = open_nvml(args.gpu)
    if isinstance(opened, str):
        say(f"no GPU to check: {opened}")
        finish(result | {"gpu": None, "reason": opened}, 0)
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
    try:
        gpu = Nvml(nvml, index)
    except Exception as e:  # noqa: BLE001 - NO_PERMISSION in a container, GPU_IS_LOST...
        reason = f"NVML GPU {index} could not be opened: {type(e).__name__}: {text(e)}"
        finish(result | {"gpu": None, "reason": reason, "ok": False}, 1)
    return nvml, gpu, count


def measure(args: argparse.Namespace, gpu: Nvml, facts: dict[str, Any], guard: bool,
            guard_log: GuardLog, baseline: dict[str, Any], result: dict[str, Any]) -> None:
    """Getter costs, the counter's period and (unless `--no-train`) the training's figures,
    into `result`."""
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
            guard_log.open()
        result["train"] = train_and_measure(args, gpu, facts, guard_log.path, baseline)


def check_afterwards(gpu: Nvml, settings_before: dict[str, Any], clocks_before: dict[str, Any],
                     error: str | None, guard_log: GuardLog
                     ) -> tuple[list[str], dict[str, Any], list[str], str | None]:
    """What changed, the clocks read last, the setter calls the guards refused, and the error
    (an interruption of this check itself is one). After an interruption the clocks get no time
    to settle."""
    changed: list[str] = []
    clocks_after: dict[str, Any] = {}
    blocked: list[str] = []
    try:
        progress("checking that nothing changed")
        settle_s = 0.0 if error is not None and error.startswith("Interrupted") else SETTLE_S
        changed, clocks_after = unchanged(gpu, settings_before, clocks_before, settle_s)
        blocked = [f"bench: {name}" for name in getattr(gpu.nvml, "BLOCKED", [])]
        blocked += guard_log.agent_refusals()
        guard_log.remove_own()
    except Interrupted as e:  # the check itself was interrupted: say so
        error = error or f"Interrupted: {e}"
        changed.append("not checked: interrupted")
    return changed, clocks_after, blocked, error


def main() -> None:
    """The check: open the GPU, measure, then check that nothing changed and print the JSON."""
    args = parse_args()
    set_quiet(args.json_only)
    result: dict[str, Any] = {"bench": "real_gpu"}
    nvml, gpu, count = open_gpu(args, result)
    guard = hasattr(nvml, "BLOCKED")
    settings_before = gpu.settings()
    clocks_at_start = gpu.clocks()
    baseline: dict[str, Any] = {"clocks": clocks_at_start,
                                "when": "at the start, before this process used CUDA"}
    facts = gpu.facts(count)
    progress(f"GPU {gpu.index}: {facts['name']}, driver {facts['driver']}, limit "
             f"{facts['power_limit_w']} W; pynvml guard {'in force' if guard else 'absent'}")
    result["gpu"] = facts
    error: str | None = None
    guard_log = GuardLog()
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        measure(args, gpu, facts, guard, guard_log, baseline, result)
    except (Exception, Interrupted) as e:  # noqa: BLE001 - report it; the GPU is still checked
        error = f"{type(e).__name__}: {e}"
        progress(f"failed: {error}")
    finally:
        changed, clocks_after, blocked, error = check_afterwards(
            gpu, settings_before, baseline["clocks"], error, guard_log)
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


if __name__ == "__main__":
    main()
