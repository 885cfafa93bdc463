"""The markdown summary of ``ddiloco report``: what the run did, in a page."""

from __future__ import annotations

import pathlib

from ddiloco.report.series import RunSeries


def markdown(name: str, report: dict | None, series: RunSeries, goodput: dict | None, pngs: list[pathlib.Path],
             overlap: str | None = None) -> str:
    """``overlap``: the run's overlap in words (ddiloco.report.overlap.describe), if it had one."""
    lines = [f"# Run {name}", ""]
    if report is None:
        lines += ["No `report.json`: the run did not finish (or is still going); numbers are from `metrics.jsonl`.", ""]
    lines += ["| | |", "|---|---|"]
    if series.evals:
        first, last = series.evals[0], series.evals[-1]
        lines.append(f"| eval loss | {first[3]:.4f} -> {last[3]:.4f} (version {last[1]}, {last[0]:.0f} s) |")
    if report is not None:
        acc = report.get("final_eval_accuracy")
        shown = "none (the workload has no metric)" if acc is None else f"{acc:.2%}"
        lines.append(f"| final eval loss, accuracy | {report['final_eval_loss']:.4f}, {shown} |")
        lines.append(f"| tokens trained / merged | {report['tokens_trained']:,} / {report.get('tokens_merged', 0):,} |")
        lines.append(f"| wall seconds | {report['wall_seconds']:.1f} |")
    # the report's count also covers merges replayed after an outer-optimizer restart
    lines.append(f"| outer steps | {report['outer_steps'] if report else len(series.merges)} |")
    stale = [x for m in series.merges for x in m[2]]
    if stale:
        lines.append(f"| deltas merged, mean staleness | {len(stale)}, {sum(stale) / len(stale):.2f} rounds |")
    if overlap is not None:
        lines.append(f"| overlap | {overlap} |")
    lines.append(f"| refusals | {series.refused} |")
    for lid, points in sorted(series.bytes.items()):
        lines.append(f"| learner {lid}: up / down | {points[-1][1] / 1e6:.2f} MB / {points[-1][2] / 1e6:.2f} MB |")
    if goodput is not None and "waste" in goodput:
        waste = ", ".join(f"{k.replace('_', ' ')} {v:.1%}" for k, v in goodput["waste"].items())
        lines.append(f"| goodput | {goodput['goodput']:.1%} (waste: {waste}) |")
    lines.append("")
    if series.faults:
        lines += ["## Faults", ""] + [f"- {s:.1f} s: {label}" for s, label in series.faults] + [""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(lines) + "\n"
