"""`--measurement-columns` as it was before it took a value still starts the agent.

Until 2026-12-07 it was a yes/no flag (`--measurement-columns`, `--no-measurement-columns`,
pydantic-settings' implicit flags) and the deploy guide told operators to pass it bare. It now
takes `auto`, `on` or `off`; an agent's unit file that still says it the old way must start as
before (on, off) after the upgrade, not stop on a usage error. Parsed as `zeus-agent run`
parses its flags (no I/O).
"""

from __future__ import annotations

import pytest
from pydantic_settings import CliApp, CliSettingsSource

from zeus_agent.config import AgentSettings, old_flags


def parse(argv: list[str]) -> AgentSettings:
    source: CliSettingsSource[AgentSettings] = CliSettingsSource(AgentSettings,
                                                                 cli_prog_name="zeus-agent run")
    return CliApp.run(AgentSettings, cli_args=old_flags(argv), cli_settings_source=source)


@pytest.mark.parametrize(("argv", "mode"), [
    (["--measurement-columns"], "on"),
    (["--measurement-columns", "--gpus", "0"], "on"),
    (["--no-measurement-columns"], "off"),
    (["--measurement-columns", "auto"], "auto"),
    (["--measurement-columns", "off"], "off"),
    (["--measurement-columns=on"], "on"),
    (["--measurement-columns", "true"], "on"),
    ([], "auto"),
])  # fmt: skip
def test_the_old_yes_no_flag_still_parses(argv: list[str], mode: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZEUS_AGENT_MEASUREMENT_COLUMNS", raising=False)
    assert parse(argv).measurement_columns == mode


def test_other_arguments_are_left_as_they_are() -> None:
    argv = ["--node", "n1", "--measurement-columns", "--gpus", "0,1"]
    assert old_flags(argv) == ["--node", "n1", "--measurement-columns=on", "--gpus", "0,1"]
    assert old_flags(["--node", "n1"]) == ["--node", "n1"]
