"""The device file's parsed state is reused until a write, in any process, changes it."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from zeus_agent.gpu.sim import WORKLOADS, SimGPU
from zeus_agent.gpu.sim.store import StateFile


def _set_limit_elsewhere(state_dir: str, watts: int) -> None:
    SimGPU.open(state_dir, 0).set_power_limit_w(watts)


def test_a_write_in_another_process_is_seen_at_once(tmp_path: Path) -> None:
    agent = SimGPU.create(tmp_path, 0, "A40")
    assert agent.get_power_limit_w() == 300  # parsed and kept
    ctx = mp.get_context("spawn")
    for watts in (250, 251, 250):  # same length each time: an mtime/size check could miss it
        proc = ctx.Process(target=_set_limit_elsewhere, args=(str(tmp_path), watts))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert agent.get_power_limit_w() == watts


def test_reads_without_a_write_do_not_touch_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    trainer = SimGPU.open(tmp_path, 0)
    gpu.get_power_w()
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: str | os.PathLike[str], *args: int) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", counting_open)
    for _ in range(5):
        gpu.get_power_w()
        gpu.get_total_energy_j()
        gpu.read_status()
    assert opened == []
    trainer.run_work(WORKLOADS["A40+resnet50+gpu0"])  # a write: the next read goes to the file
    assert gpu.is_busy()
    assert any(p.endswith("gpu0.json") for p in opened)


def test_a_changed_copy_never_leaks_into_the_kept_state(tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, "A40")
    store = StateFile(tmp_path, 0)
    kept = store.read(None)
    with pytest.raises(RuntimeError), store.update(None) as state:
        state.power_limit_w = 123
        raise RuntimeError("the body failed: nothing is written")
    assert kept.power_limit_w == 300
    assert store.read(None).power_limit_w == 300
    assert gpu.get_power_limit_w() == 300


def test_an_empty_lock_file_from_before_grows_to_hold_the_generation(tmp_path: Path) -> None:
    SimGPU.create(tmp_path, 0, "A40")
    lock = tmp_path / "gpu0.lock"
    lock.unlink()  # (not truncated: the first handle maps it)
    lock.touch()  # empty, as an older simulator left it
    gpu = SimGPU.open(tmp_path, 0)
    gpu.set_power_limit_w(200)
    assert lock.stat().st_size == 8
    assert SimGPU.open(tmp_path, 0).get_power_limit_w() == 200


def test_files_created_again_are_seen_by_a_handle_opened_before(tmp_path: Path) -> None:
    """An agent restarted on a wiped state directory: a trainer's older handle follows it."""
    SimGPU.create(tmp_path, 0, "A40")
    trainer = SimGPU.open(tmp_path, 0)
    assert trainer.get_power_limit_w() == 300  # parsed and kept
    for name in ("gpu0.json", "gpu0.lock"):
        (tmp_path / name).unlink()
    agent = SimGPU.create(tmp_path, 0, "A40")
    agent.set_power_limit_w(250)
    assert trainer.get_power_limit_w() == 250
    trainer.set_power_limit_w(260)  # and the agent sees the trainer's writes
    assert agent.get_power_limit_w() == 260
