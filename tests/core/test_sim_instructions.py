"""Simulated pipeline instructions against the real Perseus stage profiles (data/perseus/)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tools.fit_sim import fit_instructions
from zeus_agent.gpu.sim import PRESETS
from zeus_agent.gpu.sim.device import SimGPU
from zeus_agent.gpu.sim.instructions import (
    FITTED_INSTRUCTIONS,
    STAGE_PROFILES,
    instruction_cost,
    instruction_error_report,
    load_stage_profile,
    preset_for,
    stage_workloads,
)
from zeus_agent.gpu.sim.physics import WorkloadParams

MEDIAN_TARGET = 0.03
P90_TARGET = 0.08


def _same(a: dict[str, WorkloadParams], b: dict[str, WorkloadParams]) -> bool:
    """Whether two stages hold the same instructions (descriptions aside)."""
    return {k: replace(v, description="") for k, v in a.items()} == {
        k: replace(v, description="") for k, v in b.items()
    }


def _check_targets(summary: dict[str, float]) -> None:
    assert summary["time_median"] <= MEDIAN_TARGET
    assert summary["time_p90"] <= P90_TARGET
    assert summary["energy_median"] <= MEDIAN_TARGET
    assert summary["energy_p90"] <= P90_TARGET


def test_profiles_and_presets() -> None:
    assert STAGE_PROFILES == (
        "gpt3-175b+a40",
        "gpt3-175b+a100_sxm",
        "bloom+a40",
        "bloom+a100_sxm",
    )
    assert [preset_for(p) for p in STAGE_PROFILES] == ["A40", "A100-SXM", "A40", "A100-SXM"]
    with pytest.raises(ValueError, match="unknown stage profile"):
        preset_for("gpt3-175b+h100")


@pytest.mark.parametrize("profile", STAGE_PROFILES)
def test_profile_rows_and_clock_tables(profile: str) -> None:
    rows = load_stage_profile(profile)
    clocks = sorted({r[2] for r in rows})
    expected = list(range(855, 1741, 15)) if "a40" in profile else list(range(855, 1411, 15))
    assert clocks == expected
    assert len(rows) == 8 * 2 * len(clocks)
    assert {r[0] for r in rows} == set(range(8))
    table = PRESETS[preset_for(profile)].supported_sm_clocks_mhz
    assert set(clocks) <= set(table)
    for stage, ins, _clock, time_s, energy_j in rows:
        assert ins in ("forward", "backward") and 0 <= stage < 8
        assert time_s > 0 and energy_j > 0


def test_a100_sxm_preset() -> None:
    hw = PRESETS["A100-SXM"]
    assert hw.supported_sm_clocks_mhz == tuple(range(1410, 854, -15))
    assert hw.architecture == "ampere"
    assert hw.min_power_limit_w < hw.max_power_limit_w == hw.default_power_limit_w
    assert hw.idle_power_w < hw.static_power_w < hw.min_power_limit_w
    assert hw.static_power_w + hw.dynamic_power_w == pytest.approx(hw.max_power_limit_w)


def test_error_targets_on_all_rows() -> None:
    report = instruction_error_report()
    assert report["overall"]["rows"] == 2 * 960 + 2 * 608
    _check_targets(report["overall"])
    for profile in STAGE_PROFILES:
        _check_targets(report["profiles"][profile])


def test_refit_reaches_targets_and_matches_shipped() -> None:
    hardware, fitted = fit_instructions()
    assert set(fitted) == set(FITTED_INSTRUCTIONS)
    report = instruction_error_report(hardware, fitted)
    _check_targets(report["overall"])
    shipped = instruction_error_report()["overall"]
    assert report["overall"]["time_median"] == pytest.approx(shipped["time_median"], abs=0.005)
    assert report["overall"]["energy_median"] == pytest.approx(shipped["energy_median"], abs=0.005)


def test_stage_workloads_layout() -> None:
    eight = stage_workloads("gpt3-175b+a100_sxm")
    assert len(eight) == 8
    for stage in eight:
        assert set(stage) == {"forward", "backward"}
        for wl in stage.values():
            assert isinstance(wl, WorkloadParams)
            assert wl.floor_s == 0
    assert all(_same(eight[0], eight[i]) for i in range(7))
    assert not _same(eight[7], eight[0])
    assert "stage 7" in eight[7]["forward"].description
    four = stage_workloads("gpt3-175b+a100_sxm", 4)
    assert len(four) == 4
    assert all(_same(four[i], eight[0]) for i in range(3))
    assert four[3] == eight[7]
    assert stage_workloads("bloom+a40", 1) == [stage_workloads("bloom+a40")[7]]
    for bad in (0, 9):
        with pytest.raises(ValueError, match="num_stages"):
            stage_workloads("bloom+a40", bad)


def test_last_stage_imbalance_follows_the_model() -> None:
    hw = PRESETS["A100-SXM"]
    gpt = stage_workloads("gpt3-175b+a100_sxm")
    bloom = stage_workloads("bloom+a100_sxm")
    for ins in ("forward", "backward"):
        assert (
            instruction_cost(hw, gpt[7][ins], 1410)[0] > instruction_cost(hw, gpt[0][ins], 1410)[0]
        )
        assert (
            instruction_cost(hw, bloom[7][ins], 1410)[0]
            < instruction_cost(hw, bloom[0][ins], 1410)[0]
        )


@pytest.mark.parametrize("profile", STAGE_PROFILES)
def test_run_work_at_locked_clock_reproduces_profile(profile: str, tmp_path: Path) -> None:
    gpu = SimGPU.create(tmp_path, 0, preset_for(profile))
    workloads = stage_workloads(profile)
    rows = load_stage_profile(profile)
    clocks = sorted({r[2] for r in rows})
    picked = {clocks[0], clocks[len(clocks) // 2], clocks[-1]}
    for stage, ins, clock, time_s, energy_j in rows:
        if clock not in picked or stage not in (0, 7):
            continue
        gpu.lock_sm_clocks_mhz(clock, clock)
        wl = workloads[stage][ins]
        result = gpu.run_work(wl)
        t, e = instruction_cost(gpu.hardware, wl, clock)
        assert result.duration_s == pytest.approx(t, rel=1e-9)
        assert result.energy_j == pytest.approx(e, rel=1e-9)
        assert result.duration_s == pytest.approx(time_s, rel=0.08)
        assert result.energy_j == pytest.approx(energy_j, rel=0.08)


def test_a40_power_cap_flattens_high_clocks() -> None:
    hw = PRESETS["A40"]
    wl = stage_workloads("gpt3-175b+a40")[0]["forward"]
    top_t, top_e = instruction_cost(hw, wl, 1740)
    mid_t, _ = instruction_cost(hw, wl, 1500)
    low_t, _ = instruction_cost(hw, wl, 1200)
    assert top_t == pytest.approx(mid_t, rel=0.03)  # throttled by the 300 W limit
    assert low_t > 1.05 * top_t
    assert top_e / top_t <= hw.default_power_limit_w
    # Raising nothing: at a higher (hypothetical) limit the top clock runs faster.
    assert instruction_cost(hw, wl, 1740, power_limit_w=400)[0] < 0.97 * top_t


@pytest.mark.parametrize("profile", STAGE_PROFILES)
def test_energy_optimal_clock_has_little_regret(profile: str) -> None:
    """The model's energy-optimal clock costs at most 5% above the measured minimum.

    The curves are flat near their minimum (measured 945-1140 MHz); the model's A40 curves
    are flatter still at low clocks and put 4 of 8 minima at 855 MHz (regret up to 4.7%).
    """
    hw = PRESETS[preset_for(profile)]
    workloads = stage_workloads(profile)
    rows = load_stage_profile(profile)
    for stage in (0, 7):
        for ins in ("forward", "backward"):
            measured = {r[2]: r[4] for r in rows if r[0] == stage and r[1] == ins}
            model = {c: instruction_cost(hw, workloads[stage][ins], c)[1] for c in measured}
            best = min(model, key=model.__getitem__)
            assert measured[best] <= 1.05 * min(measured.values()), (stage, ins, best)
            assert 855 <= best <= 1200
