"""A `PipelineEvents` receiver that records what the pipeline adapters report (shared kit)."""

from __future__ import annotations


class Recorder:
    """Records `on_*` calls as tuples: `("step_begin",)`, `("begin", name)`, ..."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def on_step_begin(self) -> None:
        self.events.append(("step_begin",))

    def on_step_end(self) -> None:
        self.events.append(("step_end",))

    def on_instruction_begin(self, name: str) -> None:
        self.events.append(("begin", name))

    def on_instruction_end(self, name: str) -> None:
        self.events.append(("end", name))

    def begins(self) -> list[str]:
        """The instruction names begun, in order."""
        return [e[1] for e in self.events if e[0] == "begin"]
