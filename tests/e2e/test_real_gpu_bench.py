"""`bench/real_gpu.py` without a GPU: the paths CI and a GPU-less machine can run.

The script runs as a subprocess, as users run it. Without a GPU (no `pynvml`, `nvmlInit`
failing, 0 GPUs) it must print one JSON line saying so and exit 0. Its measuring path runs here
against `tests/fakes/pynvml_shim` (a fake NVML as the `pynvml` module, for the script and the
observe-only agent it starts) with the training loop on the CPU: that checks the plumbing (the
agent, emit's windows in both modes, the overhead blocks, the read-only check and the JSON),
not what a real GPU measures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zeus_demo.cluster import wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "real_gpu.py"
FAKES = ROOT / "tests" / "fakes"
SHIM = FAKES / "pynvml_shim"
GUARD = FAKES / "pynvml_guard"
CPU_LOOP = ("--device", "cpu", "--layers", "1", "--width", "32", "--batch", "2", "--seq", "8",
            "--seconds", "0.3", "--calls", "5")
"""A short run of the whole path: the training loop on the CPU, a tiny model."""


def environment(fake: str | None, guard: bool = False, **env: str) -> dict[str, str]:
    """The script's environment: the fake NVML (behind the read-only guard) when asked."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "NVML_GUARD_LOG") and not k.startswith("FAKE_PYNVML")}
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    if fake is not None:
        path = [str(GUARD)] if guard else []
        environ["PYTHONPATH"] = os.pathsep.join([*path, str(SHIM), str(ROOT)])
        environ["FAKE_PYNVML"] = fake
    environ.update(env)
    return environ


def run(*args: str, fake: str | None = None, timeout: float = 60, guard: bool = False,
        **env: str) -> tuple[int, dict[str, Any], str]:
    """Run the script; (exit status, its last stdout line as JSON, stderr)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT,
                          env=environment(fake, guard, **env),
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def test_this_machine() -> None:
    """Whatever this machine has: no GPU -> the JSON says why; a GPU -> a short read-only run."""
    code, result, err = run("--no-train", "--seconds", "0.3", "--calls", "5", "--json-only")
    assert result["bench"] == "real_gpu"
    if result["gpu"] is None:
        assert code == 0 and result["reason"], result
    else:  # a GPU here: the quick path must pass and change nothing
        assert code == 0 and result["ok"] and result["read_only"]["changed"] == [], err


@pytest.mark.parametrize(("fake", "reason"), [
    ("missing", "pynvml is not importable"),
    ("init_fails", "nvmlInit failed"),
    ("no_gpu", "NVML sees 0 GPUs"),
])
def test_no_gpu_prints_one_json_line_and_exits_0(fake: str, reason: str) -> None:
    code, result, _ = run("--json-only", fake=fake)
    assert code == 0
    assert result["gpu"] is None and reason in result["reason"]
    assert {"bench", "machine", "date"} <= set(result)


def test_a_gpu_index_nvml_lacks_is_refused() -> None:
    code, result, _ = run("--gpu", "3", "--json-only", fake="a40")
    assert code == 2 and result["gpu"] is None and "index 3" in result["reason"]


def test_facts_costs_and_period_on_the_fake_gpu() -> None:
    code, result, _ = run("--no-train", "--seconds", "1", "--calls", "20", fake="a40")
    assert code == 0 and result["ok"] is True
    gpu = result["gpu"]
    assert gpu["name"] == "NVIDIA A40" and gpu["power_limit_range_w"] == [100.0, 300.0]
    assert gpu["app_sm_clock_mhz"] is None  # not supported: reported as unknown
    costs = result["getter_cost_us"]
    assert set(costs) == {"total_energy", "power_usage", "power_instant_field", "power_limit",
                          "sm_clock", "mem_clock", "temperature", "utilization"}
    assert all(c["n"] == 20 and c["p50"] > 0 for c in costs.values())
    counter = result["counter"]
    assert not counter["continuous"] and counter["updates"] >= 5
    assert 90 < counter["period_ms"]["p50"] < 110  # the fake's counter: 100 ms updates
    assert counter["increment_j_p50"] == pytest.approx(25.0)  # 250 W x 100 ms
    assert result["train"] == {"skipped": "--no-train"}
    assert result["read_only"]["changed"] == [] and result["read_only"]["guard"] is False


def test_a_gpu_without_an_energy_counter() -> None:
    code, result, _ = run("--seconds", "0.3", "--calls", "5", "--json-only", fake="p100")
    assert code == 0 and result["ok"] is True and result["gpu"]["energy_counter"] is False
    assert "no energy counter" in result["counter"]["skipped"]
    assert "no energy counter" in result["train"]["skipped"]
    assert "error" in result["getter_cost_us"]["total_energy"]


def test_a_changed_setting_fails_the_run() -> None:
    # The fake's limit reads 50 W lower from its 100th read on: after the getters were timed.
    code, result, _ = run("--no-train", "--seconds", "0.3", "--json-only", fake="a40",
                          FAKE_PYNVML_LIMIT_DRIFT="100")
    assert code == 1 and result["ok"] is False
    assert result["read_only"]["changed"] == ["power_limit_mw: 300000 -> 250000"]


def test_the_whole_path_on_the_fake_gpu_with_a_cpu_loop(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    rows = tmp_path / "rows.json"
    # As the issue runs it (`--observe-only`); the fake's SM clock reads 210 MHz for the first
    # two reads (the start's), 1,740 MHz after, as when this process's CUDA context holds an idle
    # GPU's clocks up: the end's check compares with the clocks read once the model is built.
    code, result, err = run(
        "--observe-only",
        "--device", "cpu", "--layers", "1", "--width", "32", "--batch", "2", "--seq", "8",
        "--steps", "10", "--window-steps", "1,5", "--seconds", "0.5", "--calls", "10",
        "--warmup-s", "2", "--rows", str(rows), fake="a40", timeout=110,
        FAKE_PYNVML_CONTEXT_CLOCKS_AT="3")
    assert code == 0 and result["ok"] is True, err[-3000:]
    train = result["train"]
    assert train["zeus"] == {"skipped": "not on a CUDA device"}
    windows = train["windows"]
    assert set(windows) == {"steady_power_w", "1", "5"}
    for steps, count in (("1", 10), ("5", 5)):
        w = windows[steps]
        assert w["windows"] == count
        # The agent answered every window, at once and exactly.
        assert w["unanswered"] == {"ours": 0, "ours_exact": 0}
        assert w["exact_reply_after_end_ms"]["n"] == count
    saved = json.loads(rows.read_text())
    assert len(saved) == 15 and all(r["ours"] is not None and r["ours_exact"] is not None
                                    for r in saved)
    over = train["emit_overhead"]
    assert over["pairs"] == 4 and over["emit_calls_us_per_step"]["n"] == 40
    assert train["agent_cpu"]["gpus"] == 1 and train["agent_cpu"]["cpu_s"] >= 0
    # The trainer said hello before its events, and no exact asker's goodbye unbound it.
    assert not [w for w in train["agent_log_warnings"] if "has not said hello" in w]
    read_only = result["read_only"]
    assert read_only["observe_only_agent"] is True
    assert read_only["changed"] == [] and read_only["setter_calls_blocked"] == []
    assert read_only["clocks_at_start"]["sm_clock_mhz"] == 210
    assert read_only["clocks_before"]["sm_clock_mhz"] == 1740
    assert read_only["clocks_after"] == read_only["clocks_before"]
    assert "CUDA context" in read_only["clocks_before_when"]


def test_current_clocks_that_moved_fail_a_run_without_training() -> None:
    # Without a training loop the start's clocks are the baseline: 210 -> 1,740 MHz fails.
    code, result, _ = run("--no-train", "--seconds", "0.3", "--calls", "5", "--json-only",
                          fake="a40", FAKE_PYNVML_CONTEXT_CLOCKS_AT="3")
    assert code == 1 and result["ok"] is False
    assert result["read_only"]["changed"] == ["sm_clock_mhz (current): 210 -> 1740"]


@pytest.mark.parametrize(("visible", "index"), [
    ("0", 0),
    ("GPU-a40a40a4-0000-0000-0000-000000000000", 0),  # a full UUID: nvmlDeviceGetHandleByUUID
    ("GPU-a40a40a4", 0),  # a prefix, as CUDA accepts
])
def test_the_gpu_cuda_visible_devices_names(visible: str, index: int) -> None:
    code, result, _ = run("--no-train", "--seconds", "0.3", "--calls", "5", "--json-only",
                          fake="a40", CUDA_VISIBLE_DEVICES=visible)
    assert code == 0 and result["gpu"]["index"] == index
    assert result["gpu"]["mig_mode"] is None  # NOT_SUPPORTED on a GPU without MIG


def test_cuda_visible_devices_naming_no_gpu_nvml_sees() -> None:
    code, result, _ = run("--json-only", fake="a40", CUDA_VISIBLE_DEVICES="GPU-ffffffff")
    assert code == 2 and result["gpu"] is None
    assert "GPU-ffffffff" in result["reason"] and "--gpu" in result["reason"]


def test_a_setter_in_the_agent_under_a_guard_fails_the_run(tmp_path: Path) -> None:
    """The agent's refused call fails the run and stays in the caller's `NVML_GUARD_LOG`."""
    pytest.importorskip("torch")
    log = tmp_path / "guard.log"
    log.write_text("123 blocked nvmlDeviceSetPowerManagementLimit\n")  # an earlier run's line
    code, result, err = run(*CPU_LOOP, "--steps", "5", "--window-steps", "5", "--warmup-s",
                            "0.5", "--json-only", fake="a40", guard=True, timeout=110,
                            NVML_GUARD_LOG=str(log), FAKE_PYNVML_SETTER_IN_AGENT="1")
    read_only = result["read_only"]
    assert read_only["guard"] is True, err[-3000:]
    assert code == 1 and result["ok"] is False and "error" not in result, err[-3000:]
    assert len(read_only["setter_calls_blocked"]) == 1
    assert re.fullmatch(r"agent: \d+ blocked nvmlDeviceSetPersistenceMode",
                        read_only["setter_calls_blocked"][0])
    lines = log.read_text().splitlines()  # the caller's log is kept, with the agent's line
    assert len(lines) == 2 and lines[1].endswith("blocked nvmlDeviceSetPersistenceMode")


def test_a_clean_run_under_the_guard_passes() -> None:
    code, result, err = run("--no-train", "--seconds", "0.3", "--calls", "5", "--json-only",
                            fake="a40", guard=True)
    assert code == 0 and result["ok"] is True, err[-3000:]
    assert result["read_only"]["guard"] is True
    assert result["read_only"]["setter_calls_blocked"] == []


def _agent_started(proc: subprocess.Popen[str]) -> int:
    """Read the script's progress until it warms up; the observe-only agent's pid."""
    agent_pid = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"observe-only agent started \(pid (\d+)\)", line):
            agent_pid = int(m.group(1))
        if "warming up" in line:
            break
    assert agent_pid is not None, "the agent did not start"
    return agent_pid


def test_sigterm_stops_the_agent_and_still_prints_the_json_line() -> None:
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *CPU_LOOP, "--warmup-s", "60", "--json-only"],
        cwd=ROOT, env=environment("a40"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        agent_pid = _agent_started(proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] is False and "SIGTERM" in result["error"]
    with pytest.raises(ProcessLookupError):  # the agent was stopped (and reaped) first
        os.kill(agent_pid, 0)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_sigkill_of_the_script_stops_its_agent() -> None:
    """A checker's hard timeout (SIGKILL: no handler runs) leaves no agent reading the GPU,
    and no nats-server behind."""
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *CPU_LOOP, "--warmup-s", "60", "--json-only"],
        cwd=ROOT, env=environment("a40"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    agent_pid: int | None = None
    children: list[int] = []
    try:
        agent_pid = _agent_started(proc)
        children = _children(proc.pid)
        assert agent_pid in children and len(children) == 2, children  # agent, nats-server
        proc.kill()
        proc.communicate(timeout=30)
        wait_for(lambda: not any(map(_alive, children)), 20, interval_s=0.1, fail=False)
        assert not _alive(agent_pid), "the agent outlived the script's SIGKILL"
        assert not any(map(_alive, children)), "the nats-server outlived the script's SIGKILL"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [agent_pid, *children]:
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_zeus_logs_go_to_stderr(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Zeus logs at INFO to stdout; with `--json-only` stdout must hold only the JSON line."""
    monkeypatch.syspath_prepend(str(FAKES / "zeus_shim"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("real_gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        monitor, info = bench.open_zeus(0)
        assert info == {"version": "0.16.0+fake"}
        monitor.begin_window("w", sync_execution=False)
        assert monitor.end_window("w", sync_execution=False).gpu_energy == {0: 0.0}
    finally:
        for name in [n for n in sys.modules if n == "zeus" or n.startswith("zeus.")]:
            del sys.modules[name]
    out, err = capsys.readouterr()
    assert out == ""
    assert "Monitoring GPU indices [0]" in err and "'w' ended" in err
