"""`bench/real_gpu.py` without a GPU: the paths CI and a GPU-less machine can run.

The script runs as a subprocess, as users run it. Without a GPU (no `pynvml`, `nvmlInit`
failing, 0 GPUs) it must print one JSON line saying so and exit 0. Its measuring path runs here
against `tests/fakes/pynvml_shim` (a fake NVML as the `pynvml` module, for the script and the
observe-only agent it starts) with the training loop on the CPU: that checks the plumbing (the
agent, emit's windows in both modes, the overhead blocks, the read-only check and the JSON),
not what a real GPU measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "real_gpu.py"
SHIM = ROOT / "tests" / "fakes" / "pynvml_shim"


def run(*args: str, fake: str | None = None, timeout: float = 60,
        **env: str) -> tuple[int, dict[str, Any], str]:
    """Run the script; (exit status, its last stdout line as JSON, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FAKE_PYNVML")}
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    if fake is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(ROOT)])
        environ["FAKE_PYNVML"] = fake
    environ.update(env)
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=environ,
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
    code, result, err = run(
        "--device", "cpu", "--layers", "1", "--width", "32", "--batch", "2", "--seq", "8",
        "--steps", "10", "--window-steps", "1,5", "--seconds", "0.5", "--calls", "10",
        "--warmup-s", "2", "--rows", str(rows), fake="a40", timeout=110)
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
