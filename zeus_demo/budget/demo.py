"""`zeus-demo --budget`: a grid event on a small simulated cluster, drawn.

Six jobs (one GPU each, A40 and V100 workloads fitted on the reference profiles) on 3 nodes
profile and pin their optima; then a 25% cut of the group's measured draw is set as a budget,
held, and lifted (`zeus_demo.budget.event`). The table gives the figures `bench/power_budget.py`
reports; REPORT_DIR/budget_event.png draws the group's measured power against the cap and each
job's throughput (relative to its optimum's) over time; REPORT_DIR/budget.json holds both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from zeus_demo.budget.event import EventConfig, run_event
from zeus_demo.config import DemoError
from zeus_demo.plots import pyplot

__all__ = ["SMALL_COUNTS", "plot_timeline", "render_budget_table", "run_budget_demo"]

SMALL_COUNTS = {w: 1 for w in ("A40+bert-base-uncased+gpu0", "A40+resnet18+gpu0",
                               "A40+resnet50+gpu0", "A40+shufflenetv2+gpu0",
                               "V100+bert-base-uncased+gpu0", "V100+resnet50+gpu0")}
"""Six jobs on one GPU each: 3 nodes x 2 GPUs."""


def run_budget_demo(report_dir: Path, *, cut_pct: float = 25.0, hold_s: float = 15.0,
                    step_s: float = 0.5) -> dict[str, Any]:
    """Play the event; write budget.json and budget_event.png; return the figures."""
    config = EventConfig(gpus_per_node=2, counts=dict(SMALL_COUNTS), step_s=step_s,
                         cut_pct=cut_pct, hold_s=hold_s, takeover=False, timeline=True)
    out = asyncio.run(run_event(config))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "budget.json").write_text(json.dumps(out, indent=2) + "\n")
    plot_timeline(out["timeline"], report_dir / "budget_event.png")
    return out


def render_budget_table(out: Mapping[str, Any]) -> Table:
    """The event's figures for people."""
    ev = out["event"]
    table = Table(title=f"grid event: {out['jobs']} jobs on {out['gpus']} GPUs, "
                        f"cap {ev['cap_w']:.0f} W (drawing {ev['draw_before_w']:.0f} W before)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")

    def fmt(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.3g}{unit}"

    for name, key, unit, goal in (
        ("seconds from the signal to under the cap, held over 5 s",
         "seconds_to_cap_sustained", " s", "<= 5 s"),
        ("... strict: every half-second under from then on", "seconds_to_cap", " s", ""),
        ("... to its first bin under the cap", "seconds_to_first_under", " s", ""),
        ("energy above the cap during the event", "over_cap_joules", " J", ""),
        ("group draw while capped", "draw_capped_w", " W", ""),
        ("throughput loss / a uniform cut's", "loss_vs_uniform", "", "<= 0.7"),
        ("... the offline optimum's / a uniform cut's", "optimal_vs_uniform", "", ""),
        ("gap to the offline optimum", "gap_to_optimal_pct", " %", "<= 2 %"),
        ("seconds from the lift to every optimum", "seconds_to_restore", " s", ""),
    ):
        table.add_row(name, fmt(ev.get(key), unit), goal)
    return table


def plot_timeline(timeline: Mapping[str, Any], path: Path) -> None:
    """The group's power against the cap, and each job's relative throughput, over time.

    Raises:
        DemoError: matplotlib is not installed.
    """
    plt = pyplot(DemoError)
    fig, (ax_p, ax_t) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    power = timeline["power"]
    ax_p.plot([t for t, _ in power], [w for _, w in power], color="tab:blue",
              label="group draw (agents' energy counters)")
    ax_p.axhline(timeline["cap_w"], color="tab:red", linestyle="--",
                 label=f"cap {timeline['cap_w']:.0f} W")
    for ax in (ax_p, ax_t):
        ax.axvspan(0, timeline["lift_s"], color="tab:red", alpha=0.07)
        ax.grid(alpha=0.3)
    ax_p.set_ylabel("power (W)")
    ax_p.legend(fontsize=8, loc="lower left")
    for tag, series in sorted(timeline["throughput"].items()):
        ax_t.plot([t for t, _ in series], [v for _, v in series], label=tag)
    ax_t.set_ylabel("throughput / at its optimum")
    ax_t.set_xlabel("seconds from the grid's signal (shaded: the budget holds)")
    ax_t.legend(fontsize=7, ncol=2, loc="lower left")
    fig.suptitle("A grid event: the budget shared by what each job loses at each limit")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
