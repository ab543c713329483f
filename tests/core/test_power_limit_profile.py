"""Power-limit profile files (`zeus_agent.models`): save/load round trip, Zeus's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from coordinator.power_limit import Done, PowerLimitMeasurement, PowerLimitStateMachine
from zeus_agent.models import load_power_limit_profile, save_power_limit_profile

ZEUS_FILE = """{
    "measurements": [
        {
            "power_limit": 300,
            "energy": 6224.9,
            "time": 24.01
        },
        {
            "power_limit": 275,
            "energy": 6122.3,
            "time": 24.06
        },
        {
            "power_limit": 250,
            "energy": 5915.6,
            "time": 24.16
        }
    ]
}"""


class ZeusPowerLimitMeasurement(BaseModel):  # Zeus 0.16's models.
    power_limit: int
    energy: float
    time: float


class ZeusPowerLimitMeasurementList(BaseModel):
    measurements: list[ZeusPowerLimitMeasurement]


def test_round_trip(tmp_path: Path) -> None:
    ms = [
        PowerLimitMeasurement(power_limit=pl, energy=e, time=t)
        for pl, e, t in [(300, 1000.5, 10.25), (275, 950.0, 10.5), (250, 0.1 + 0.2, 1e-3)]
    ]
    path = tmp_path / "profile.json"
    save_power_limit_profile(path, ms)
    assert load_power_limit_profile(path) == ms
    assert load_power_limit_profile(str(path)) == ms


def test_saved_highest_first_in_zeus_layout(tmp_path: Path) -> None:
    ms = [
        PowerLimitMeasurement(power_limit=pl, energy=float(pl), time=1.0) for pl in (100, 300, 200)
    ]
    path = tmp_path / "p.json"
    save_power_limit_profile(path, ms)
    data = json.loads(path.read_text())
    assert list(data) == ["measurements"]
    assert [m["power_limit"] for m in data["measurements"]] == [300, 200, 100]
    assert all(list(m) == ["power_limit", "energy", "time"] for m in data["measurements"])
    # Zeus parses our file.
    parsed = ZeusPowerLimitMeasurementList.model_validate_json(path.read_text())
    assert [m.power_limit for m in parsed.measurements] == [300, 200, 100]


def test_loads_zeus_file(tmp_path: Path) -> None:
    path = tmp_path / "zeus.json"
    path.write_text(ZEUS_FILE)
    ms = load_power_limit_profile(path)
    assert [(m.power_limit, m.energy, m.time) for m in ms] == [
        (300, 6224.9, 24.01),
        (275, 6122.3, 24.06),
        (250, 5915.6, 24.16),
    ]
    # And it re-saves to the same JSON Zeus writes (indent 4, same keys, same order).
    again = tmp_path / "again.json"
    save_power_limit_profile(again, ms)
    assert json.loads(again.read_text()) == json.loads(ZEUS_FILE)
    assert again.read_text() == ZEUS_FILE


def test_loaded_profile_drives_machine(tmp_path: Path) -> None:
    path = tmp_path / "zeus.json"
    path.write_text(ZEUS_FILE)
    machine = PowerLimitStateMachine(100, 300, measurements=load_power_limit_profile(path))
    assert isinstance(machine.state, Done)


def test_invalid_files(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"measurements": [{"power_limit": -5, "energy": 1, "time": 1}]}')
    with pytest.raises(ValidationError):
        load_power_limit_profile(path)
    path.write_text('{"other": []}')
    with pytest.raises(ValidationError):
        load_power_limit_profile(path)
    with pytest.raises(ValueError, match="empty"):
        save_power_limit_profile(tmp_path / "x.json", [])
