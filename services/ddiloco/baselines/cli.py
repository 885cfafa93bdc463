"""``ddiloco dp``: the synchronous data-parallel baseline.

With ``--rank`` it runs that one rank (one process per rank, as a multi-host or
network-namespace run needs); without it, it starts all ``--world-size`` ranks on this
machine and prints the result. ``--world-size 1`` is the single-learner baseline.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import time

from ddiloco.common.cliargs import apply_env_defaults, limit_threads, setup_logging
from ddiloco.common.runflags import DP_FLAGS, add_run_flags, forward_run_flags, run_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=None, help="run only this rank (default: start all ranks here)")
    parser.add_argument("--world-size", type=int, default=4, help="W: number of ranks (data shards); 1 = single learner")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address where rank 0 serves the rendezvous")
    parser.add_argument("--master-port", type=int, default=0, help="its port (0: pick a free one; needs --rank unset)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="run folder (default: runs/dp-<time>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="training device (auto: cuda if present)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    parser.add_argument("--collective-timeout", type=float, default=600.0, help="seconds before a missing peer fails an all-reduce")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, metavar="T",
        help="emulate dedicated hardware: each step's compute takes at least T seconds (default 0: off), as a "
        "ddiloco run's learners with the same flag",
    )
    add_run_flags(parser, only=DP_FLAGS)
    parser.epilog = (
        "--max-tokens is the total across ranks; the per-rank batch is --batch-size, so the global batch is "
        "W x --batch-size. --learners is ignored: the number of shards is --world-size. --inner-steps only "
        "sets how often the mean training loss is logged."
    )
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    out = args.out or pathlib.Path("runs") / time.strftime("dp-%Y%m%d-%H%M%S")
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {args.world_size}")
    if args.rank is None:
        return _launch_all(args, out)
    if args.master_port <= 0:
        raise SystemExit("--master-port is required with --rank (every rank must use the same one)")
    setup_logging(f"dp-rank-{args.rank}")
    limit_threads(args.threads)
    from ddiloco.baselines.dp import DPOptions, run_rank

    config = run_config_from_args(args)
    run_rank(
        config,
        DPOptions(
            rank=args.rank,
            world_size=args.world_size,
            out=out,
            master_addr=args.master_addr,
            master_port=args.master_port,
            device=args.device,
            collective_timeout_s=args.collective_timeout,
            step_seconds=args.step_seconds,
        ),
    )
    if args.world_size > 1:
        # Everything this rank produces is written (raw file descriptors, atomic JSON) and
        # its process group destroyed. Gloo's worker threads can still be alive at this
        # point, and interpreter teardown with them alive aborts the process ("terminate
        # called without an active exception", SIGABRT) now and then, turning a finished
        # rank into a failed one. Leave without running finalizers.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _launch_all(args: argparse.Namespace, out: pathlib.Path) -> int:
    from ddiloco.baselines.launch import DPFailed, launch_dp

    run_config_from_args(args)  # bad flags fail here, once, not in W children
    from ddiloco.common import pacing

    try:
        pacing.check(step_seconds=args.step_seconds)
    except ValueError as exc:
        print(f"ddiloco dp: error: --step-seconds: {exc}", file=sys.stderr)
        return 2
    extra = ["--device", args.device, "--threads", str(args.threads), "--collective-timeout", str(args.collective_timeout),
             "--step-seconds", str(args.step_seconds)]
    try:
        report = launch_dp(out, args.world_size, forward_run_flags(args), master_addr=args.master_addr,
                           master_port=args.master_port, extra_flags=extra)
    except DPFailed as exc:
        print(f"ddiloco dp: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP: the ranks were stopped
        print(f"\nddiloco dp: interrupted ({exc or 'Ctrl-C'}): ranks stopped", file=sys.stderr)
        return 130
    print_summary(report, sys.stdout)
    print(f"\nrun folder: {out}  (report.json, metrics.jsonl, config.json, ranks/, logs/)")
    return 0


def print_summary(report: dict, stream) -> None:
    rows = [
        ("method", f"{report['method']} (world size {report['world_size']})"),
        ("eval loss", f"{report['initial_eval_loss']:.4f} -> {report['final_eval_loss']:.4f}"),
        ("eval metric (accuracy)", "none" if report.get("final_eval_accuracy") is None else f"{report['final_eval_accuracy']:.2%}"),
        ("tokens trained", f"{report['tokens_trained']:,}"),
        ("optimizer steps", str(report["optimizer_steps"])),
        ("bytes per rank (sent+received)", f"{report['bytes_exchanged'] / 1e6:.2f} MB ({report['bytes_exchanged_source']})"),
        ("wall seconds", f"{report['wall_seconds']:.1f}"),
        ("ranks in sync", str(report["ranks_in_sync"])),
        ("model parameters", f"{report['model_parameters']:,}"),
    ]
    print("\n| metric | value |\n|---|---|", file=stream)
    for k, v in rows:
        print(f"| {k} | {v} |", file=stream)
