"""The pipeline part's report: summary.json's `pipeline` section, the table and the plots.

* `pipeline_summary(run)`: the section (measured all-max versus Perseus, the planner's
  prediction, the frontier).
* `render_pipeline_table(summary)`: the table.
* `plot_frontier`, `plot_timeline` (`timeline_of`): pipeline_frontier.png and
  pipeline_timeline.png.
* `write_pipeline_report(run, report_dir)`: the images; returns the section.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from zeus_demo.pipeline.cluster import JobRun
from zeus_demo.pipeline.config import PipelineDemoError
from zeus_demo.pipeline.measure import Side, finite, pct_less, pct_more
from zeus_demo.pipeline.run import PipelineDemoRun
from zeus_demo.plots import pyplot

PIPELINE_SUMMARY_VERSION = 1

def timeline_of(run: JobRun, step: int, pipeline: int = 0) -> list[list[tuple[str, float, float,
                                                                             int]]]:
    """Per stage of `pipeline`: (instruction, start s, end s, SM clock MHz) of one step.

    Times are the agents' instruction stamps relative to the step's earliest start; clocks are
    what the simulated GPU ran (the trainer's record: the lock, or lower under the power cap).
    """
    ranks = sorted((r for r in run.result.ranks if r.dp_rank == pipeline),
                   key=lambda r: r.pp_rank)
    starts = [run.observer.steps[(r.rank, step)].t0_ns for r in ranks
              if (r.rank, step) in run.observer.steps]
    if not starts:
        return []
    origin = min(starts)
    out = []
    for r in ranks:
        recs = sorted(run.observer.instructions.get((r.rank, step), []), key=lambda i: i.index)
        clocks = r.clocks_mhz[step] if step < len(r.clocks_mhz) else []
        out.append([(i.name, (i.t0_ns - origin) / 1e9, (i.t1_ns - origin) / 1e9,
                     int(clocks[k]) if k < len(clocks) else 0) for k, i in enumerate(recs)])
    return out


def _middle(side: Side, run: JobRun) -> int | None:
    if side.first_step is None or side.last_step is None:
        return None
    mid = (side.first_step + side.last_step) // 2
    for step in range(mid, side.last_step + 1):
        ranks = [r.rank for r in run.result.ranks]
        if all(len(run.observer.instructions.get((r, step), [])) == 2 * run_micro(run)
               for r in ranks):
            return step
    return mid


def run_micro(run: JobRun) -> int:
    """Microbatches of the job's iterations (from rank 0's first recorded clocks)."""
    first = run.result.ranks[0]
    return len(first.clocks_mhz[0]) // 2 if first.clocks_mhz else 0


def pipeline_summary(run: PipelineDemoRun) -> dict[str, Any]:
    """The `pipeline` section of summary.json."""
    cfg = run.config
    snap = run.perseus.snapshot
    planner_part: dict[str, Any] | None = None
    if snap is not None and snap.chosen is not None:
        planner_part = {
            "frontier_points": len(snap.frontier),
            "frontier": [{"time_s": t, "energy_j": e} for t, e in snap.frontier],
            "chosen": {"time_s": snap.chosen[0], "energy_j": snap.chosen[1]},
            "all_max": (None if snap.all_max is None
                        else {"time_s": snap.all_max[0], "energy_j": snap.all_max[1]}),
            "predicted_energy_saving_pct": finite(snap.predicted_saving_pct),
            "predicted_time_change_pct": finite(snap.predicted_slowdown_pct),
            "p_block_w": snap.p_block_w,
            "chosen_plan": snap.chosen_plan,
            "note": "per iteration, whole job (energies of a stage summed over its replicas); "
                    "instruction time and energy plus P_block while a GPU waits, as Perseus "
                    "plans; the all-reduce and optimizer step are not in it",
        }
    b, o = run.baseline, run.optimised
    steps = {"all_max": _middle(b, run.all_max), "perseus": _middle(o, run.perseus)}
    return {
        "version": PIPELINE_SUMMARY_VERSION,
        "config": {
            "profile": cfg.profile, "preset": cfg.preset, "stages": cfg.stages, "dp": cfg.dp,
            "microbatches": cfg.microbatches, "time_scale": cfg.time_scale,
            "energy_update_ms": cfg.energy_update_ms, "nodes": cfg.nodes,
            "baseline_iterations": cfg.baseline_iterations,
            "serve_iterations": cfg.serve_iterations,
            "warmup_iterations": cfg.warmup_iterations,
            "profiler_args": cfg.profiler_args(),
            "profiling_iterations": cfg.profiling_iterations,
        },
        "scheduler": run.scheduler,
        "scheduler_note": run.note,
        "jobs": {"all_max": run.all_max.job_id, "perseus": run.perseus.job_id},
        "world_size": cfg.world_size,
        "all_max": b.to_json(),
        "perseus": o.to_json(),
        "served_schedule": run.served_version,
        "savings": {
            "energy_pct": finite(pct_less(b.energy_j, o.energy_j)),
            "time_change_pct": finite(pct_more(b.time_s, o.time_s)),
        },
        "planner": planner_part,
        "measured_by": "agents: GPU energy counters per step summed over the steps and the "
                       "job's GPUs; time per iteration the slowest rank's step",
        "late_clocks": sum(r.late_clocks for r in run.perseus.result.ranks),
        "timeline_steps": steps,
        "elapsed_s": run.elapsed_s,
    }


def render_pipeline_table(summary: Mapping[str, Any]) -> Table:
    """All-max versus Perseus per iteration, savings, and the planner's prediction."""
    cfg = summary["config"]
    table = Table(
        title=(f"Pipeline frequency optimisation: {cfg['stages']} stages x {cfg['dp']} "
               f"pipeline(s) on simulated {cfg['preset']}s, {cfg['profile']}, "
               f"{cfg['microbatches']} microbatches, {summary['scheduler']}"),
        caption=("per iteration: energy summed over the job's GPUs from the agents' energy "
                 "counters, time the slowest rank's step; predicted: the planner's frontier"),
    )
    table.add_column("")
    table.add_column("iteration time", justify="right")
    table.add_column("energy / iteration", justify="right")
    table.add_column("iterations", justify="right")

    def fmt(v: float | None, unit: str, digits: int) -> str:
        return "n/a" if v is None else f"{v:.{digits}f} {unit}"

    for name, key in (("all-max clocks", "all_max"), (summary["scheduler"], "perseus")):
        s = summary[key]
        table.add_row(name, fmt(s["time_per_iteration_s"], "s", 4),
                      fmt(s["energy_per_iteration_j"], "J", 1), str(s["iterations"]))
    e_pct = summary["savings"]["energy_pct"]
    t_pct = summary["savings"]["time_change_pct"]
    table.add_section()
    table.add_row(
        "[bold]measured[/]",
        "n/a" if t_pct is None else f"[bold]{t_pct:+.1f} % (slowdown)[/]",
        "n/a" if e_pct is None else f"[bold green]{e_pct:.1f} % less[/]", "")
    plan = summary.get("planner")
    if plan and plan.get("predicted_energy_saving_pct") is not None:
        table.add_row(
            "predicted (planner)",
            f"{plan['predicted_time_change_pct']:+.1f} %",
            f"{plan['predicted_energy_saving_pct']:.1f} % less",
            f"{plan['frontier_points']} frontier points")
    elif summary.get("scheduler_note"):
        table.add_row("predicted (planner)", "n/a", "n/a", "no planner")
    return table


def _pyplot() -> Any:
    return pyplot(PipelineDemoError)


def plot_frontier(summary: Mapping[str, Any], path: Path) -> bool:
    """The planner's frontier, the chosen point and all-max marked, the measured points too.

    Returns False (no file) when there is no frontier (no Perseus).
    """
    plan = summary.get("planner")
    if not plan or not plan.get("frontier"):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts = plan["frontier"]
    ax.plot([p["time_s"] for p in pts], [p["energy_j"] for p in pts], "-", color="tab:blue",
            lw=1.5, label=f"planned frontier ({len(pts)} points)")
    ax.plot([p["time_s"] for p in pts], [p["energy_j"] for p in pts], ".", color="tab:blue",
            ms=3)
    if plan.get("all_max"):
        am = plan["all_max"]
        ax.plot([am["time_s"]], [am["energy_j"]], "D", color="tab:orange", ms=10,
                label="all-max clocks (planned)")
        ax.axvline(am["time_s"], color="tab:orange", alpha=0.25, ls="--")
    ch = plan["chosen"]
    saving = plan.get("predicted_energy_saving_pct")
    ax.plot([ch["time_s"]], [ch["energy_j"]], "*", color="tab:red", ms=18,
            label="chosen (planned" + (f": -{saving:.1f} % energy)" if saving is not None
                                       else ")"))
    b, o = summary["all_max"], summary["perseus"]
    if b["energy_per_iteration_j"] is not None:
        ax.plot([b["time_per_iteration_s"]], [b["energy_per_iteration_j"]], "D", mfc="none",
                color="tab:orange", ms=10, mew=2, label="all-max, measured by the agents")
    if o["energy_per_iteration_j"] is not None:
        e_pct = summary["savings"]["energy_pct"]
        ax.plot([o["time_per_iteration_s"]], [o["energy_per_iteration_j"]], "*", mfc="none",
                color="tab:red", ms=18, mew=1.5,
                label="Perseus, measured" + (f" (-{e_pct:.1f} % energy)" if e_pct is not None
                                             else ""))
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration (J, all GPUs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cfg = summary["config"]
    ax.set_title(f"Perseus time-energy frontier: {cfg['stages']} stages x {cfg['dp']}, "
                 f"{cfg['profile']}, {cfg['microbatches']} microbatches", fontsize=10)
    fig.text(0.01, 0.01, "measured points include the all-reduce/optimizer step the plan does "
             "not model", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(
    timelines: Mapping[str, Sequence[Sequence[tuple[str, float, float, int]]]],
    path: Path,
    title: str,
) -> None:
    """One iteration per stage, before and after: instructions as bars coloured by SM clock."""
    plt = _pyplot()
    from matplotlib import colors as mcolors

    rows = [(name, tl) for name, tl in timelines.items() if tl]
    if not rows:
        raise PipelineDemoError("no instruction measurements to draw a timeline from")
    clocks = [c for _, tl in rows for stage in tl for *_, c in stage if c > 0]
    norm = mcolors.Normalize(vmin=min(clocks, default=0), vmax=max(clocks, default=1))
    cmap = plt.get_cmap("viridis")
    end = max((e for _, tl in rows for stage in tl for _, _, e, _ in stage), default=1.0)
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.2 + 1.1 * sum(len(t) for _, t in rows)
                                                     / max(len(rows), 1) * len(rows) / 2 + 1),
                             sharex=True, squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], rows, strict=True):
        for stage, instr in enumerate(tl):
            for kind, start, stop, clock in instr:
                ax.barh(stage, stop - start, left=start, height=0.8,
                        color=cmap(norm(clock)) if clock > 0 else "lightgray",
                        edgecolor="black", linewidth=0.5)
                if stop - start > end / 60:
                    ax.text((start + stop) / 2, stage, "F" if kind == "forward" else "B",
                            ha="center", va="center", fontsize=7,
                            color="white" if norm(clock) < 0.6 else "black")
        iteration = max((e for stage in tl for _, _, e, _ in stage), default=0.0)
        ax.set_yticks(range(len(tl)), [f"stage {s}" for s in range(len(tl))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: {iteration:.3f} s", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the iteration's start (s)")
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=axes[:, 0].tolist(), label="SM clock the GPU ran (MHz)", pad=0.01)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_pipeline_report(run: PipelineDemoRun, report_dir: Path) -> dict[str, Any]:
    """pipeline_frontier.png and pipeline_timeline.png; return the `pipeline` summary section."""
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = pipeline_summary(run)
    images = []
    if plot_frontier(summary, report_dir / "pipeline_frontier.png"):
        images.append("pipeline_frontier.png")
    steps = summary["timeline_steps"]
    timelines = {}
    if steps["all_max"] is not None:
        timelines["all-max clocks"] = timeline_of(run.all_max, steps["all_max"])
    if steps["perseus"] is not None:
        timelines[f"{run.scheduler} (served plan)"] = timeline_of(run.perseus, steps["perseus"])
    cfg = run.config
    plot_timeline(timelines, report_dir / "pipeline_timeline.png",
                  f"one iteration of pipeline 0 ({cfg.stages} stages, {cfg.microbatches} "
                  f"microbatches, {cfg.profile}, time scale {cfg.time_scale:g}), measured")
    images.append("pipeline_timeline.png")
    summary["images"] = images
    return summary
