"""``ddiloco run``: the main job. Coordinator, outer optimizer and N learners as local
processes on 127.0.0.1, a live progress line, and a summary table at the end."""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
import time

from ddiloco.common import pacing
from ddiloco.common.cliargs import apply_env_defaults, run_folder
from ddiloco.common.runflags import add_run_flags, forward_run_flags, run_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=run_folder, default=None, help="run folder (default: runs/<time>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="learners' device")
    parser.add_argument(
        "--slow", action="append", default=[], metavar="ID:FACTOR",
        help="make learner ID this many times slower (repeatable), e.g. --slow 3:3",
    )
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, metavar="T",
        help="emulate dedicated hardware: every learner's inner step takes at least T seconds "
        "(default 0: off; for many learners sharing this machine's cores)",
    )
    parser.add_argument("--quiet", action="store_true", help="no live progress line")
    parser.add_argument(
        "--resume", type=pathlib.Path, default=None, metavar="RUN",
        help="continue the stopped run in this folder from its last checkpoint, each learner at its data position; "
        "run flags may only extend the budget (--max-seconds, --max-tokens are totals)",
    )
    parser.add_argument(
        "--no-monitoring", action="store_true",
        help="no Prometheus /metrics endpoints and no status page (default: both on free ports, listed in RUN/endpoints.json)",
    )
    parser.add_argument(
        "--insecure", action="store_true",
        help="no TLS between the services (default: a fresh CA and mutual TLS, certificates in RUN/tls)",
    )
    parser.add_argument(
        "--warm-start-steps", type=int, default=None, metavar="N",
        help="first train N inner steps (whole windows of H) with one learner alone, serially, and start the run "
        "from its model; its tokens and time count in the run's budget (default: off; docs/algorithm.md, Warm start)",
    )
    _topology_arguments(parser)
    add_run_flags(parser)
    apply_env_defaults(parser)


def _topology_arguments(parser: argparse.ArgumentParser) -> None:
    from ddiloco.launcher.topology import TOPOLOGIES
    from ddiloco.wan.profiles import profile_names

    group = parser.add_argument_group("topology")
    group.add_argument(
        "--topology", choices=TOPOLOGIES, default="local",
        help="local: every service on 127.0.0.1; netns (root): coordinator and outer optimizer in a hub "
        "namespace, each learner in its own datacenter namespace behind a tc-shaped link",
    )
    group.add_argument("--profile", dest="wan_profile", default="lan",
                       help=f"WAN profile of the datacenter links (netns only): {', '.join(profile_names())}")
    group.add_argument("--wan-qdisc", choices=["tbf", "htb"], default="tbf", help="tc qdisc that shapes the links")


def main(args: argparse.Namespace) -> int:
    from ddiloco.launcher.run import LaunchOptions, RunFolderInUse, check_fresh_folder, launch
    from ddiloco.launcher.topology import TopologyOptions

    if args.resume is not None:
        refused = [flag for flag, given in (("--out", args.out), ("--config", args.config), ("--init-from", args.init_from),
                                            ("--warm-start-steps", args.warm_start_steps))
                   if given is not None]
        if refused:
            print(f"ddiloco run: error: --resume continues the run in its own folder with its own configuration; "
                  f"{refused[0]} cannot be combined with it", file=sys.stderr)
            return 2
        # the run's saved configuration is the base; the flags given may extend its budget
        args.config, args.out = args.resume / "config.json", args.resume
    try:
        # the coordinator builds the run configuration from the same flags: bad values fail
        # here, once, before a run folder or a process exists
        config = run_config_from_args(args) if args.resume is None or (args.resume / "config.json").exists() else None
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"ddiloco run: error: {exc.code}", file=sys.stderr)
            return 2
        raise
    if args.resume is not None:
        from ddiloco.launcher import resume

        try:
            point = resume.find(args.resume)
            assert config is not None  # find() refused a folder without config.json
            resume.check(point, config)
        except resume.ResumeError as exc:
            print(f"ddiloco run: error: --resume {exc}", file=sys.stderr)
            return 2
        print(f"resuming {args.resume} at version {point.version} ({point.state}, {point.elapsed:.1f} s and "
              f"{point.tokens:,} tokens trained)", file=sys.stderr)
    assert config is not None
    out = args.out or pathlib.Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if args.resume is None:
        try:
            check_fresh_folder(out)  # here too: before the workload's preflight, in one line
        except RunFolderInUse as exc:
            print(f"ddiloco run: error: {exc}", file=sys.stderr)
            return 2
    from ddiloco.workloads import WorkloadError
    from ddiloco.workloads.preflight import preflight

    from ddiloco.launcher import warm_start

    try:
        workload = preflight(config)  # the workload tried once, before a run folder or a process exists
        warm = None if args.warm_start_steps is None else warm_start.plan(config, args.warm_start_steps, workload.step_weight())
    except (WorkloadError, warm_start.WarmStartError) as exc:
        print(f"ddiloco run: error: {exc}", file=sys.stderr)
        return 2
    learners = config.learners
    slow = {}
    for item in args.slow:
        try:
            lid, factor = item.split(":")
            lid_n, factor_f = int(lid), float(factor)
        except ValueError:
            print(f"ddiloco run: error: --slow expects ID:FACTOR, got {item!r}", file=sys.stderr)
            return 2
        if lid_n in slow:
            print(f"ddiloco run: error: --slow names learner {lid_n} twice ({slow[lid_n]:g} and {factor_f:g})",
                  file=sys.stderr)
            return 2
        slow[lid_n] = factor_f
    unknown = sorted(i for i in slow if not 0 <= i < learners)
    if unknown:
        print(f"ddiloco run: error: --slow names learner {unknown[0]}, but the run's learners are 0 to {learners - 1}",
              file=sys.stderr)
        return 2
    try:
        for factor in [*slow.values(), 1.0]:
            pacing.check(factor, args.step_seconds, config.lease_timeout_s)
    except ValueError as exc:
        print(f"ddiloco run: error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        # the learners run on this host: without a GPU each would fail after the services
        # started, and the run after a drain of a minute
        from ddiloco.common.device import pick_device

        try:
            pick_device("cuda")
        except SystemExit as exc:
            print(f"ddiloco run: error: {exc.code}", file=sys.stderr)
            return 2
    options = LaunchOptions(
        out=out,
        run_flags=forward_run_flags(args),
        learners=learners,
        outer_shards=config.outer_shards,
        device=args.device,
        slowdown=slow,
        step_seconds=args.step_seconds,
        progress=not args.quiet,
        resume=args.resume is not None,
        monitoring=not args.no_monitoring,
        insecure=args.insecure,
        topology=TopologyOptions(args.topology, args.wan_profile, args.wan_qdisc),
        drain_timeout_s=config.drain_timeout_s,
    )
    try:
        options.topology.validate()  # bad names fail here, before anything starts
    except ValueError as exc:
        print(f"ddiloco run: {exc}", file=sys.stderr)
        return 2
    errors: tuple[type[Exception], ...] = (RunFolderInUse,)
    if args.topology == "netns":
        from ddiloco.netns.topology import NetnsError
        from ddiloco.wan.tc import TcError

        errors += (NetnsError, TcError)
    try:
        if warm is not None:
            code = _warm_start(options, config, warm)
            if code:
                return code
        result = launch(options)
    except errors as exc:
        print(f"ddiloco run: {exc}", file=sys.stderr)
        return 2
    if result.report is not None:
        from ddiloco.report import overlap

        print_summary(result.report, sys.stdout, overlap.of_run(out, config.learner.sync))
        if "links" in result.report:
            print_links(result.report["links"], sys.stdout)
        print(f"\nrun folder: {out}  (report.json, metrics.jsonl, config.json, logs/)")
    for name, code in result.failures.items():
        print(f"service {name} failed with exit code {code}; see {out}/logs/{name}.log", file=sys.stderr)
    if result.report is None and (out / "config.json").exists():
        print(f"the run stopped before its budget; continue it with: ddiloco run --resume {out}", file=sys.stderr)
    if result.interrupted:
        return signal_exit_code(result.signal_name)
    return 0 if result.ok else 1


def signal_exit_code(signal_name: str | None) -> int:
    """The shell's code for a command ended by that signal: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + int(getattr(signal, signal_name or "SIGINT", signal.SIGINT))


def _warm_start(options, config, warm) -> int:
    """Train the warm start into RUN/warm-start and point ``options`` at it: 0, or the exit
    code of a phase that did not finish (the run does not start)."""
    import dataclasses

    from ddiloco.launcher import warm_start
    from ddiloco.launcher.run import check_fresh_folder, launch

    check_fresh_folder(options.out)  # before the warm start trains into it
    folder = options.out / warm_start.FOLDER
    print(f"warm start: one learner trains {warm.steps} inner steps ({warm.tokens:,} tokens) alone in {folder}",
          file=sys.stderr, flush=True)
    phase = dataclasses.replace(
        options, out=folder, run_flags=warm_start.phase_flags(options.run_flags, config, warm), learners=1,
        outer_shards=1, slowdown={0: options.slowdown[0]} if 0 in options.slowdown else {})
    result = launch(phase)
    if result.interrupted:
        return signal_exit_code(result.signal_name)
    if not result.ok:
        for name, code in result.failures.items():
            print(f"warm start: service {name} failed with exit code {code}; see {folder}/logs/{name}.log", file=sys.stderr)
        print("warm start: it did not finish; the run was not started", file=sys.stderr)
        return 1
    done = warm_start.read_result(folder)
    try:
        options.run_flags = warm_start.run_flags_after(options.run_flags, config, done)
        options.warm_started = True
    except warm_start.WarmStartError as exc:
        print(f"ddiloco run: error: {exc}", file=sys.stderr)
        return 2
    print(f"warm start: eval loss {_loss(done.initial_eval_loss)} -> {_loss(done.final_eval_loss)}, {done.tokens:,} tokens "
          f"in {done.seconds:.1f} s; the run starts from it", file=sys.stderr, flush=True)
    return 0


def _loss(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.4f}"


def print_summary(report: dict, stream, overlap: str | None = None) -> None:
    """The run's figures as a table; ``overlap``: the run's overlap in words
    (ddiloco.report.overlap), a row when given."""
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    rows = [
        ("eval loss", f"{_loss(report['initial_eval_loss'])} -> {_loss(report['final_eval_loss'])}"),
        ("eval metric (accuracy)", "none" if report.get("final_eval_accuracy") is None else f"{report['final_eval_accuracy']:.2%}"),
        ("tokens trained", f"{report['tokens_trained']:,}"),
        ("outer steps", "unknown" if report["outer_steps"] is None else str(report["outer_steps"])),
        ("uploaded / downloaded", f"{mb(report['bytes_uploaded'])} / {mb(report['bytes_downloaded'])}"),
        ("wall seconds", f"{report['wall_seconds']:.1f}"),
        # None: a report the coordinator wrote after a restart that had lost the outer
        # optimizer's final answers (coordinator/service.py: build_report)
        ("model parameters", "unknown" if report["model_parameters"] is None else f"{report['model_parameters']:,}"),
    ]
    if overlap is not None:
        rows.append(("overlap", overlap))
    print("\n| metric | value |\n|---|---|", file=stream)
    for k, v in rows:
        print(f"| {k} | {v} |", file=stream)
    # deltas accepted and merged are the outer optimizer's counts: the learner's own count of
    # deltas sent loses what a killed incarnation did since its last heartbeat, so after kills
    # it read below the merged count, as if deltas had been merged that nobody sent
    print("\n| learner | tokens | inner steps | deltas accepted | deltas merged | incarnations |\n|---|---|---|---|---|---|", file=stream)
    for lr in report["learners"]:
        print(
            f"| {lr['learner_id']} | {lr['tokens']:,} | {lr['inner_steps']} | {lr['deltas_accepted']} | "
            f"{lr['deltas_merged']} | {lr['incarnations']} |",
            file=stream,
        )


def print_links(links: dict, stream) -> None:
    print(
        f"\nlinks ({links['profile']}, kernel counters at the hub, {links['window_s']:g} s windows):\n"
        "| datacenter | rate Mbit/s | up MB | down MB | app up/down MB | avg Mbit/s | peak Mbit/s |\n"
        "|---|---|---|---|---|---|---|",
        file=stream,
    )
    for d in links["datacenters"]:
        rate = "-" if d["rate_mbit"] is None else f"{d['rate_mbit']:g}"
        app = f"{d.get('app_bytes_uploaded', 0) / 1e6:.2f} / {d.get('app_bytes_downloaded', 0) / 1e6:.2f}"
        print(
            f"| dc{d['datacenter']} | {rate} | {d['bytes_up'] / 1e6:.2f} | {d['bytes_down'] / 1e6:.2f} | {app} | "
            f"{d['avg_mbps']:.2f} | {d['peak_mbps']:.2f} |",
            file=stream,
        )


def load_report(out: pathlib.Path) -> dict | None:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.exists() else None
