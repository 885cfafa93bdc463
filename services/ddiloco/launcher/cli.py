"""``ddiloco run``: the main job. Coordinator, outer optimizer and N learners as local
processes on 127.0.0.1, a live progress line, and a summary table at the end."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.common.runflags import add_run_flags, forward_run_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=pathlib.Path, default=None, help="run folder (default: runs/<time>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="learners' device")
    parser.add_argument(
        "--slow", action="append", default=[], metavar="ID:FACTOR",
        help="make learner ID this many times slower (repeatable), e.g. --slow 3:3",
    )
    parser.add_argument("--quiet", action="store_true", help="no live progress line")
    add_run_flags(parser)
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    from ddiloco.launcher.run import LaunchOptions, launch

    out = args.out or pathlib.Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    learners = args.cfg_learners if args.cfg_learners is not None else 4
    if args.cfg_max_seconds is None and args.config is None:
        args.cfg_max_seconds = 150.0  # default main job: about 3 minutes end to end on 2 cores
    slow = {}
    for item in args.slow:
        try:
            lid, factor = item.split(":")
            slow[int(lid)] = float(factor)
        except ValueError:
            raise SystemExit(f"--slow expects ID:FACTOR, got {item!r}")
    options = LaunchOptions(
        out=out,
        run_flags=forward_run_flags(args),
        learners=learners,
        device=args.device,
        slowdown=slow,
        progress=not args.quiet,
    )
    result = launch(options)
    if result.report is not None:
        print_summary(result.report, sys.stdout)
        print(f"\nrun folder: {out}  (report.json, metrics.jsonl, config.json, logs/)")
    for name, code in result.failures.items():
        print(f"service {name} failed with exit code {code}; see {out}/logs/{name}.log", file=sys.stderr)
    return 0 if result.ok else 1


def print_summary(report: dict, stream) -> None:
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    rows = [
        ("eval loss", f"{report['initial_eval_loss']:.4f} -> {report['final_eval_loss']:.4f}"),
        ("next-byte accuracy", f"{report['final_eval_accuracy']:.2%}"),
        ("tokens trained", f"{report['tokens_trained']:,}"),
        ("outer steps", str(report["outer_steps"])),
        ("uploaded / downloaded", f"{mb(report['bytes_uploaded'])} / {mb(report['bytes_downloaded'])}"),
        ("wall seconds", f"{report['wall_seconds']:.1f}"),
        ("model parameters", f"{report['model_parameters']:,}"),
    ]
    print("\n| metric | value |\n|---|---|", file=stream)
    for k, v in rows:
        print(f"| {k} | {v} |", file=stream)
    print("\n| learner | tokens | inner steps | deltas sent | deltas merged | incarnations |\n|---|---|---|---|---|---|", file=stream)
    for lr in report["learners"]:
        print(
            f"| {lr['learner_id']} | {lr['tokens']:,} | {lr['inner_steps']} | {lr['deltas_sent']} | "
            f"{lr['deltas_merged']} | {lr['incarnations']} |",
            file=stream,
        )


def load_report(out: pathlib.Path) -> dict | None:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.exists() else None
