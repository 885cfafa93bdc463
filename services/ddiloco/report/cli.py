"""``ddiloco report RUN_DIR``: PNGs (eval loss against tokens and wall-clock, bytes per
datacenter, merges and staleness, goodput and waste; faults marked on the time axis) and a
markdown summary, from the run folder's ``metrics.jsonl`` (and ``report.json``, ``config.json``
when there). Reads nothing else: a folder copied from another machine, or the Compose
``run`` volume, is enough."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from ddiloco.common.cliargs import apply_env_defaults, run_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=pathlib.Path, metavar="RUN_DIR", help="a run folder (it holds metrics.jsonl)")
    parser.add_argument("--out", type=run_folder, default=None, help="write the PNGs and summary.md here (default: RUN_DIR/plots)")
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    from ddiloco.common.metrics import read_events
    from ddiloco.report import series as series_mod
    from ddiloco.report.overlap import describe, overlap_steps
    from ddiloco.report.summary import markdown

    events_path = args.run_dir / "metrics.jsonl"
    if not events_path.is_file():
        print(f"ddiloco report: {events_path} does not exist: not a run folder", file=sys.stderr)
        return 2
    try:
        from ddiloco.report.plots import render
    except ImportError:  # matplotlib is the optional 'plot' extra
        print("ddiloco report: needs matplotlib: pip install 'ddiloco[plot]'", file=sys.stderr)
        return 2
    events = read_events(events_path)
    report = _json(args.run_dir / "report.json")
    config = _json(args.run_dir / "config.json") or {}
    goodput = None
    if events:
        from ddiloco.chaos.goodput import account

        goodput = account(events, int(config.get("learners", 0)))
    series = series_mod.build(events)
    overlap = describe(overlap_steps(events), sync=bool((config.get("learner") or {}).get("sync")))
    out = args.out or args.run_dir / "plots"
    pngs = render(series, goodput, out)
    (out / "summary.md").write_text(markdown(args.run_dir.resolve().name, report, series, goodput, pngs, overlap))
    print(f"wrote {', '.join(p.name for p in pngs)} and summary.md to {out}")
    return 0


def _json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
