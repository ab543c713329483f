"""The power-limit part's report: summary.json, power_limits.png, profile.json and the table.

* `build_summary(run, comparison)`: the JSON summary (config, job, chosen limit,
  baseline/optimised, savings, profile).
* `plot_power_limits(summary, path)`: time and energy per step versus power limit.
* `write_report(run, comparison, report_dir)`: the files; returns the summary.
* `render_table(summary)`: baseline versus optimised, as a rich table.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from zeus_demo.compare import Comparison, StepStats
from zeus_demo.config import DemoError
from zeus_demo.pipeline.measure import finite
from zeus_demo.plots import pyplot
from zeus_demo.power_limit import DemoRun

SUMMARY_VERSION = 2
"""2: summary.json has a `pipeline` section (None when skipped)."""

def build_summary(run: DemoRun, comparison: Comparison) -> dict[str, Any]:
    """The JSON summary: config, job, chosen limit, baseline/optimised, savings, profile."""
    cfg = dataclasses.asdict(run.config)
    cfg["workload"] = run.config.workload_name

    def side(s: StepStats) -> dict[str, Any]:
        return {
            "power_limit_w": s.power_limit_w,
            "energy_per_step_j": finite(s.energy_per_step_j),
            "time_per_step_s": finite(s.time_per_step_s),
            "steps": s.steps,
            "first_step": s.first_step,
            "last_step": s.last_step,
        }

    return {
        "version": SUMMARY_VERSION,
        "config": cfg,
        "job_id": run.job_id,
        "nats": "embedded" if run.embedded_nats else run.nats_url,
        "world_size": run.config.job_gpus,
        "placements": [{"rank": r, "node": n, "gpu": g}
                       for r, (n, g) in enumerate(run.config.placements())],
        "chosen_power_limit_w": run.chosen_power_limit_w,
        "max_power_limit_w": run.max_power_limit_w,
        "baseline": side(comparison.baseline),
        "optimised": side(comparison.optimised),
        "savings": {
            "energy_pct": finite(comparison.energy_saving_pct),
            "time_change_pct": finite(comparison.time_change_pct),
        },
        "measured_by": "agents: energy summed over the job's GPUs, time the maximum over ranks",
        "per_power_limit": [side(s) for s in comparison.per_limit],
        "unmatched_steps": comparison.unmatched_steps,
        "profile": {
            "profile_steps": run.config.profile_steps,
            "note": "energy (J, summed over GPUs) and time (s) of one profile_steps-step window",
            "measurements": sorted(run.profile, key=lambda m: -m["power_limit"]),
        },
        "status_events": len(run.statuses),
        "elapsed_s": run.elapsed_s,
    }


def plot_power_limits(summary: Mapping[str, Any], path: Path) -> None:
    """Time and energy per step versus power limit (profile and agents), the chosen point marked.

    Raises:
        DemoError: matplotlib is not installed.
    """
    plt = pyplot(DemoError)
    n = summary["profile"]["profile_steps"]
    prof = sorted(summary["profile"]["measurements"], key=lambda m: m["power_limit"])
    agents = sorted(summary["per_power_limit"], key=lambda s: s["power_limit_w"])
    chosen = summary["chosen_power_limit_w"]
    fig, (ax_t, ax_e) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    for ax, key_prof, key_agent, label in (
        (ax_t, "time", "time_per_step_s", "time per step (s)"),
        (ax_e, "energy", "energy_per_step_j", "energy per step (J, all GPUs)"),
    ):
        if prof:
            ax.plot([m["power_limit"] for m in prof], [m[key_prof] / n for m in prof],
                    "o-", color="tab:blue", label="profile window / profile steps")
        pts = [(s["power_limit_w"], s[key_agent]) for s in agents if s[key_agent] is not None]
        if pts:
            ax.plot([w for w, _ in pts], [v for _, v in pts], "s", mfc="none",
                    color="tab:gray", label="agents, mean over steps")
        opt = summary["optimised"][key_agent]
        base = summary["baseline"][key_agent]
        if base is not None:
            ax.plot([summary["max_power_limit_w"]], [base], "D", color="tab:orange",
                    markersize=9, label="baseline (max limit)")
        if opt is not None:
            ax.plot([chosen], [opt], "*", color="tab:red", markersize=16,
                    label=f"chosen {chosen} W")
        ax.axvline(chosen, color="tab:red", alpha=0.25)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    ax_e.set_xlabel("power limit (W)")
    cfg = summary["config"]
    savings = summary["savings"]
    e_pct = savings["energy_pct"]
    t_pct = savings["time_change_pct"]
    fig.suptitle(
        f"{cfg['job_gpus']} x {cfg['preset']} ({cfg['workload']}), {cfg['selector']}: "
        + (f"energy -{e_pct:.1f} %, time {t_pct:+.1f} %" if e_pct is not None
           and t_pct is not None else "no comparison"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run: DemoRun, comparison: Comparison, report_dir: Path) -> dict[str, Any]:
    """Write summary.json, power_limits.png and profile.json; return the summary."""
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(run, comparison)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if run.profile_json is not None:
        (report_dir / "profile.json").write_text(run.profile_json)
    plot_power_limits(summary, report_dir / "power_limits.png")
    return summary


def render_table(summary: Mapping[str, Any]) -> Table:
    """Baseline versus optimised energy and time per step, the chosen limit and the savings."""
    cfg = summary["config"]
    sel = cfg["selector"]
    if sel == "ZeusCost":
        sel += f"(eta={cfg['eta_knob']})"
    elif sel == "MaxSlowdownConstraint":
        sel += f"({cfg['max_slowdown']})"
    table = Table(
        title=(f"Power-limit optimisation: {cfg['job_gpus']} x {cfg['preset']} over "
               f"{cfg['nodes']} nodes, {cfg['workload']}, {sel}"),
        caption=("per step: energy summed over the job's GPUs, time the maximum over ranks; "
                 "measured by the agents"),
    )
    table.add_column("")
    table.add_column("power limit", justify="right")
    table.add_column("energy / step", justify="right")
    table.add_column("time / step", justify="right")
    table.add_column("steps", justify="right")

    def fmt(v: float | None, unit: str, digits: int) -> str:
        return "n/a" if v is None else f"{v:.{digits}f} {unit}"

    for name, key in (("baseline (max limit)", "baseline"), ("optimised", "optimised")):
        s = summary[key]
        table.add_row(name, f"{s['power_limit_w']} W", fmt(s["energy_per_step_j"], "J", 2),
                      fmt(s["time_per_step_s"], "s", 4), str(s["steps"]))
    e_pct = summary["savings"]["energy_pct"]
    t_pct = summary["savings"]["time_change_pct"]
    table.add_section()
    table.add_row(
        "[bold]saving[/]",
        f"[bold]{summary['chosen_power_limit_w']} W chosen[/]",
        "n/a" if e_pct is None else f"[bold green]{e_pct:.1f} % less[/]",
        "n/a" if t_pct is None else f"[bold]{t_pct:+.1f} %[/]",
        "",
    )
    return table
