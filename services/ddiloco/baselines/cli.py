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

from ddiloco.common.cliargs import apply_env_defaults, limit_threads, port, seconds, setup_logging, threads
from ddiloco.common.config_rules import MAX_INTERVAL_S, MAX_LEARNERS
from ddiloco.common.runflags import DP_FLAGS, add_run_flags, config_or_error, forward_run_flags

# Ranks started on this machine (no --rank) are processes of their own, each holding torch,
# the model and its batches: importing torch alone takes about 220 MiB. A world size this
# machine's memory cannot hold would only have it swap and the kernel kill ranks (100,000
# ranks started 176 processes in 20 s before anything failed); larger worlds run a rank per
# host with --rank.
RANK_MIB = 256
# torch.distributed counts the collective timeout in milliseconds: below 1 ms it is 0 and
# the rendezvous fails at once (0 was a DistNetworkError traceback). At most MAX_INTERVAL_S
# (30 days), the bound of every interval of a run: 1e18 s overflowed (OverflowError), inf
# and nan were ValueErrors.
MIN_COLLECTIVE_TIMEOUT_S = 0.001


# Seconds a rank waits for its peers in a collective: positive, finite, at most 30 days
collective_timeout = seconds(MIN_COLLECTIVE_TIMEOUT_S, MAX_INTERVAL_S)


def local_rank_limit() -> int:
    """The most ranks this machine's memory holds, RANK_MIB each (at least 1)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not reported: no bound from memory, the hard one stays
        return MAX_LEARNERS
    return max(1, min(MAX_LEARNERS, memory // (RANK_MIB << 20)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=None, help="run only this rank (default: start all ranks here)")
    parser.add_argument("--world-size", type=int, default=4, help="W: number of ranks (data shards); 1 = single learner")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address where rank 0 serves the rendezvous")
    parser.add_argument("--master-port", type=port, default=0, help="its port (0: pick a free one; needs --rank unset)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="run folder (default: runs/dp-<time>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="training device (auto: cuda if present)")
    parser.add_argument("--threads", type=threads, default=1, help="torch CPU threads per rank")
    parser.add_argument("--collective-timeout", type=collective_timeout, default=600.0,
                        help="seconds before a missing peer fails an all-reduce (0.001 to 2592000 = 30 days)")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, metavar="T",
        help="emulate dedicated hardware: each step's compute takes at least T seconds (default 0: off), as a "
        "ddiloco run's learners with the same flag; below --collective-timeout",
    )
    add_run_flags(parser, only=DP_FLAGS)
    parser.epilog = (
        "--max-tokens is the total across ranks; the per-rank batch is --batch-size, so the global batch is "
        "W x --batch-size. --learners is ignored: the number of shards is --world-size. --inner-steps only "
        "sets how often the mean training loss is logged."
    )
    apply_env_defaults(parser)


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with these flags, as ``<flag>: <what is allowed>``, before any rank
    starts; None when nothing is."""
    from ddiloco.common import pacing

    if args.rank is None:
        limit = local_rank_limit()
        if not 1 <= args.world_size <= limit:
            return (f"--world-size: 1 to {limit:,} ranks started here (each a process of at least {RANK_MIB} MiB, "
                    f"in this machine's memory; more: one rank per host with --rank), got {args.world_size}")
    else:
        if not 1 <= args.world_size <= MAX_LEARNERS:
            # one data shard per rank, as one per learner of a run (config_rules.MAX_LEARNERS)
            return f"--world-size: an integer from 1 to {MAX_LEARNERS:,}, got {args.world_size}"
        if not 0 <= args.rank < args.world_size:
            return f"--rank: 0 to {args.world_size - 1} (--world-size {args.world_size}), got {args.rank}"
        if args.master_port == 0:
            # 0 picks a free port, which only a launcher starting every rank can tell them
            return "--master-port: required with --rank, 1 to 65535, the same on every rank"
    try:
        pacing.check(step_seconds=args.step_seconds)
    except ValueError as exc:
        return f"--step-seconds: {exc}"
    if args.step_seconds >= args.collective_timeout:
        # the collective timeout is how long a rank may go unheard before its peers count it
        # dead; a step of that long is that silence on the hardware it stands for (and 1e18 s
        # started the run, to end in an OverflowError at its first step)
        return (f"--step-seconds: below --collective-timeout ({args.collective_timeout:g} s): "
                f"a step cannot outlast the wait for its peers, got {args.step_seconds:g}")
    return None


def main(args: argparse.Namespace) -> int:
    out = args.out or pathlib.Path("runs") / time.strftime("dp-%Y%m%d-%H%M%S")
    found = problem(args)
    if found:
        print(f"ddiloco dp: error: {found}", file=sys.stderr)
        return 2
    if args.rank is None:
        return _launch_all(args, out)
    config = config_or_error(args, "dp")
    if config is None:
        return 2
    setup_logging(f"dp-rank-{args.rank}")
    limit_threads(args.threads)
    from ddiloco.baselines.dp import DPOptions, run_rank

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

    if config_or_error(args, "dp") is None:  # bad flags fail here, once, not in W children
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
