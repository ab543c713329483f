"""tools/fit_sim.py, the simulator's offline fitter: it writes the blocks the simulator reads.

The refit itself is held by `test_sim_instructions.py` (the instructions, ~2 s); the power-limit
fit (~10 s) is run by hand (`python tools/fit_sim.py power-limit`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import fit_sim
from zeus_agent.gpu.sim import instructions, presets


def _between(path: Path, begin: str, end: str, *, markers: bool) -> str:
    """The text of `path` from the line starting with `begin` to the one with `end`."""
    text = path.read_text()
    start, stop = text.index(begin), text.index(end)
    if markers:
        return text[start : text.index("\n", stop) + 1]
    return text[text.index("\n", start) + 1 : stop]


def test_the_shipped_presets_block_is_what_the_tool_writes_for_the_shipped_numbers() -> None:
    hardware = {gpu: presets.PRESETS[gpu] for gpu in presets.FITTED_HARDWARE}
    workloads = {name: presets.WORKLOADS[name] for name in presets.FITTED_WORKLOADS}
    block = fit_sim.render_presets_block(hardware, workloads)
    shipped = _between(Path(presets.__file__), "# BEGIN GENERATED", "# END GENERATED",
                       markers=False)
    assert block + "\n" == shipped


def test_the_shipped_instruction_blocks_are_what_the_tool_writes_for_the_shipped_numbers() -> None:
    block, hw_block = fit_sim.render_blocks(presets.PRESETS, instructions.FITTED_INSTRUCTIONS)
    assert block == _between(Path(instructions.__file__), "# BEGIN GENERATED", "# END GENERATED",
                             markers=True)
    assert hw_block == _between(Path(presets.__file__), "# BEGIN PIPELINE FIT",
                                "# END PIPELINE FIT", markers=True)


@pytest.mark.parametrize(("what", "says"), [
    ("power-limit", "Overall over 96 points"),
    ("instructions", "Overall over 3136 rows"),
])
def test_shipped_reports(what: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_sim.main([what, "--shipped"]) == 0
    assert says in capsys.readouterr().out


def test_write_needs_a_fit() -> None:
    with pytest.raises(SystemExit):
        fit_sim.main(["instructions", "--write", "--shipped"])
