"""What a training script imports comes from one public place: `zeus_agent` (or `emit`).

`JobInfo`, `PowerLimitOptions` and `PowerLimitMeasurement` (what `emit.init` takes) import from
`zeus_agent` and `zeus_agent.emit`; their homes (`zeus_agent.models`,
`zeus_agent.wire.messages`) keep working; `import zeus_agent` alone imports none of them.
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import zeus_agent
import zeus_agent.models
import zeus_agent.wire.messages
from zeus_agent import emit

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "JobInfo": zeus_agent.models.JobInfo,
    "PowerLimitMeasurement": zeus_agent.models.PowerLimitMeasurement,
    "PowerLimitOptions": zeus_agent.wire.messages.PowerLimitOptions,
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_what_init_takes_imports_from_the_package_and_from_emit(name: str) -> None:
    assert getattr(zeus_agent, name) is PUBLIC[name]
    assert getattr(emit, name) is PUBLIC[name]
    assert name in zeus_agent.__all__ and name in emit.__all__
    assert name in dir(zeus_agent)


def test_the_public_names_are_the_types_init_takes() -> None:
    from zeus_agent import JobInfo, PowerLimitMeasurement, PowerLimitOptions

    hints = typing.get_type_hints(emit.init)
    assert hints["job_info"] == JobInfo | None
    assert hints["power_limit"] == PowerLimitOptions | None
    options = PowerLimitOptions(profile=[PowerLimitMeasurement(power_limit=300, energy=1.0,
                                                               time=1.0)])
    assert options.profile is not None and options.profile[0].power_limit == 300


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        zeus_agent.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError):
        from zeus_agent import NoSuchThing  # type: ignore[attr-defined]  # noqa: F401


def test_importing_the_package_alone_imports_no_model() -> None:
    code = ("import sys, zeus_agent; "
            "print(sorted(m for m in ('pydantic', 'zeus_agent.models', 'zeus_agent.wire.messages',"
            " 'zeus_agent.emit') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md",
                                  "docs/guides/instrument.md", "examples/pytorch_training.py"])
def test_the_docs_import_them_from_the_public_place(page: str) -> None:
    text = (ROOT / page).read_text()
    assert "from zeus_agent import JobInfo, PowerLimitOptions, emit" in text
    assert not re.search(r"from zeus_agent\.(models|wire\.messages) import .*"
                         r"(JobInfo|PowerLimitOptions)", text)
