"""The training side of `bench/real_gpu.py`: its observe-only agent, the model, Zeus, and the
order of the measuring phases (`_real_gpu_windows`).

Only this module imports torch, Zeus and the agent's client, lazily: `--no-train` and a machine
without a GPU never pay for them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import cpu_seconds
from _real_gpu_nvml import Nvml, settled_clocks
from _real_gpu_report import clean, progress
from _real_gpu_windows import (
    OVERHEAD_BLOCK,
    ExactAsker,
    Loop,
    emit_overhead,
    run_windows,
    step_ms_p50,
    summarize_windows,
    warm_up,
)

from zeus_demo.cluster import wait_for

REPO_ROOT = Path(__file__).resolve().parent.parent
JOB_ID = "real-gpu-check"


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

    if args.device == "cuda" and not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    emit_index = emit_index_for(gpu.index)
    if emit_index is None:
        return {"skipped": f"NVML GPU {gpu.index} is not in CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}"}
    out: dict[str, Any] = {"device": args.device}
    device, sync, cuda_index = place_loop(torch, args, facts, emit_index, out)
    zeus_monitor = zeus_for(args, gpu, cuda_index, out)

    progress(f"building the model (bf16, {args.layers} layers, d={args.width}, "
             f"batch {args.batch} x {args.seq}) on {device}")
    step = build_training(torch, device, args)
    out["model"] = {"layers": args.layers, "width": args.width, "batch": args.batch,
                    "seq": args.seq, "dtype": "bfloat16"}
    sync()
    baseline["clocks"] = settled_clocks(gpu)
    baseline["when"] = "idle, after this process made its CUDA context, before the agent"
    loop = Loop(step, sync, cuda_index)
    with tempfile.TemporaryDirectory(prefix="real-gpu-") as tmp_name, \
            observe_only_agent(gpu.index, Path(tmp_name), guard_log) as agent:
        progress(f"observe-only agent started (pid {agent[0].pid})")
        measure_with_agent(args, gpu, loop, zeus_monitor, emit_index, agent, out)
    return out


def place_loop(torch: Any, args: argparse.Namespace, facts: dict[str, Any], emit_index: int,
               out: dict[str, Any]) -> tuple[Any, Callable[[], None], int | None]:
    """The loop's device, its sync and its CUDA index (None on the CPU).

    On CUDA: the device whose UUID is the GPU under test's (else emit's index), noted in
    `out`."""
    if args.device != "cuda":  # tests: the loop on the CPU, the agent on a fake NVML
        device = torch.device("cpu")
        torch.set_num_threads(1)
        return device, lambda: None, None
    cuda_index, matched = cuda_device_for(torch, str(facts.get("uuid")), emit_index)
    torch.cuda.set_device(cuda_index)
    device = torch.device("cuda", cuda_index)
    out.update(cuda_index=cuda_index, cuda_matched_by=matched)
    return device, torch.cuda.synchronize, cuda_index


def zeus_for(args: argparse.Namespace, gpu: Nvml, cuda_index: int | None,
             out: dict[str, Any]) -> Any:
    """Zeus's `ZeusMonitor` when it would read the GPU under test, else None; `out["zeus"]`
    says which (its version, or why it was skipped)."""
    from zeus_agent.emit import physical_gpu_index

    on_cuda = args.device == "cuda"
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
    return zeus_monitor


def measure_with_agent(args: argparse.Namespace, gpu: Nvml, loop: Loop, zeus_monitor: Any,
                       emit_index: int, agent: tuple[Any, Path, Path],
                       out: dict[str, Any]) -> None:
    """With the agent running: warm-up, step time, the windows and emit's overhead; then the
    windows' summary, the agent's CPU time over those phases and its log's warnings."""
    from zeus_agent.emit import Publisher
    from zeus_agent.wire.trainer import TrainerHello

    proc, sock, log = agent

    def check() -> None:
        check_agent(proc, log)

    pub = Publisher(socket_path=str(sock), gpu_index=emit_index, timeout_s=3.0)
    rows: list[dict[str, Any]] = []
    asker: ExactAsker | None = None
    try:
        hello = pub.hello(TrainerHello(job_id=JOB_ID, rank=0, gpu_index=gpu.index))
        if hello is None:
            raise RuntimeError("the agent did not answer the trainer's HELLO")
        warm_up(pub, loop, args.warmup_s, check)
        out["step_ms_p50"] = step_ms_p50(loop)
        cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()

        sizes = args.window_steps
        counts = {s: max(5, args.steps // s) for s in sizes}
        progress(f"windows: {counts} (steps: windows), step {out['step_ms_p50']:.1f} ms")
        asker = ExactAsker(str(sock), emit_index, rows)
        run_windows(gpu, pub, loop, zeus_monitor, asker, sizes, counts, rows, check)
        asker.stop()
        check()

        pairs = max(4, args.steps // (2 * OVERHEAD_BLOCK))
        progress(f"emit overhead: {pairs} pairs of {OVERHEAD_BLOCK}-step blocks")
        out["emit_overhead"] = emit_overhead(pub, loop.step, loop.sync, pairs)
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
