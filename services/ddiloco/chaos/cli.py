"""``ddiloco chaos``: train with faults injected on a schedule or at random.

Local processes (default): starts the whole job like ``ddiloco run`` (same run flags) and
plays the faults against it::

    ddiloco chaos --learners 4 --max-seconds 300 --kill-every 60s --target learner --restart-after 20s \\
        --fault kill:outer@90s+3s --out runs/chaos

Docker: attaches to a running Compose project's containers and plays the faults against
them until the coordinator's container exits::

    ddiloco chaos --backend docker --project ddiloco --kill-every 60s --target learner --restart-after 20s

Every fault is logged into the run's ``metrics.jsonl`` (event ``fault``); the report gains
``goodput`` and ``waste`` (see ``ddiloco.chaos.goodput``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

from ddiloco.chaos.faults import (
    Fault, Schedule, check_count, check_target, parse_duration, parse_fault, periodic, random_faults,
)
from ddiloco.common import pacing
from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.common.runflags import add_run_flags, forward_run_flags


def period(text: str) -> float:
    """A positive, finite duration: how often a periodic fault comes. Given, it must make
    faults (``--kill-every 0`` was dropped silently, the run starting with none); leave the
    flag out for none."""
    try:
        value = parse_duration(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a positive, finite duration (60s, 1.5m; leave the flag out for none), got {text!r}")
    return value


def rate(text: str) -> float:
    """Faults a minute: positive and finite. Given, it must make faults (0, -1 and nan were
    dropped silently); leave the flag out for none. How many it makes is bounded with the
    schedule (faults.MAX_FAULTS)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of faults a minute, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a positive, finite number of faults a minute (leave the flag out for none), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["local", "docker"], default="local")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="local: run folder (default: runs/chaos-<time>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="local: learners' device")
    parser.add_argument("--quiet", action="store_true", help="local: no progress lines")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, metavar="T",
        help="local: emulate dedicated hardware, every learner's inner step at least T seconds (default 0: off)",
    )
    from ddiloco.launcher.cli import _topology_arguments

    _topology_arguments(parser)  # --topology local|netns (partitions need netns), --profile, --wan-qdisc
    g = parser.add_argument_group("faults")
    g.add_argument("--kill-every", type=period, default=None, metavar="DUR", help="kill --target every DUR (e.g. 60s)")
    g.add_argument("--target", default="learner", help="target of --kill-every: learner, learner:ID, outer, outer:I (shard I; outer alone: shard 0), coordinator")
    g.add_argument("--restart-after", type=parse_duration, default=parse_duration("20s"), metavar="DUR",
                   help="restart a killed service after DUR (inf: never)")
    g.add_argument("--freeze-every", type=period, default=None, metavar="DUR", help="SIGSTOP --freeze-target every DUR")
    g.add_argument("--freeze-for", type=parse_duration, default=parse_duration("15s"), metavar="DUR", help="SIGCONT after DUR")
    g.add_argument("--freeze-target", default="learner")
    g.add_argument("--fault", action="append", default=[], metavar="KIND:TARGET@AT[+DUR]",
                   help="one fault, e.g. kill:outer@90s+3s, freeze:learner:1@30s+15s, partition:dc2@60s+20s (repeatable)")
    g.add_argument("--random-rate", type=rate, default=None, metavar="PER_MIN",
                   help="random faults per minute (Poisson; default: none)")
    g.add_argument("--random-kinds", default="kill", help="comma-separated kinds for random faults")
    g.add_argument("--random-targets", default="learner", help="comma-separated targets for random faults")
    g.add_argument("--random-duration", type=parse_duration, default=parse_duration("20s"), metavar="DUR")
    g.add_argument("--chaos-seed", dest="chaos_seed", type=int, default=0, help="seed of random faults and of learner choice")
    g.add_argument("--until", type=parse_duration, default=None, metavar="DUR",
                   help="schedule faults up to DUR into the run (default: the run's --max-seconds, or 1h)")
    d = parser.add_argument_group("docker backend")
    d.add_argument("--project", default="ddiloco", help="Compose project whose containers to target")
    d.add_argument("--run-dir", type=pathlib.Path, default=None,
                   help="host path of the run folder for fault events (default: the project's run volume)")
    add_run_flags(parser)
    apply_env_defaults(parser)


def build_schedule(args: argparse.Namespace, horizon_s: float) -> Schedule:
    """The schedule of these flags; a flag that cannot make one is an error line naming it
    (exit 2), before anything starts."""
    until = args.until if args.until is not None else horizon_s
    faults: list[Fault] = []
    flag = "--fault"
    try:
        if args.kill_every is not None:
            flag = "--target"
            check_target("kill", args.target)
            flag = "--kill-every"
            faults += periodic("kill", args.target, args.kill_every, args.restart_after, until)
        if args.freeze_every is not None:
            flag = "--freeze-target"
            check_target("freeze", args.freeze_target)
            flag = "--freeze-every"
            faults += periodic("freeze", args.freeze_target, args.freeze_every, args.freeze_for, until)
        flag = "--fault"
        faults += [parse_fault(s) for s in args.fault]
        if args.random_rate is not None:
            flag = "--random-targets"
            kinds = [k.strip() for k in args.random_kinds.split(",") if k.strip()]
            targets = [t.strip() for t in args.random_targets.split(",") if t.strip()]
            for k in kinds:
                for t in targets:
                    if not (k == "partition" and t in ("outer", "coordinator")):
                        check_target(k, t)
            flag = "--random-rate"
            faults += random_faults(args.random_rate, kinds, targets, args.random_duration, until, args.chaos_seed)
        flag = ""
        check_count(len(faults), "--kill-every, --freeze-every, --fault and --random-rate together")
    except ValueError as exc:
        print(f"ddiloco chaos: error: {flag + ': ' if flag else ''}{exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return Schedule(faults, seed=args.chaos_seed)


def unknown_learner(schedule: Schedule, learners: int) -> str | None:
    """The first ``learner:ID`` a fault targets that the run does not have (its learners are
    0 to learners - 1, chaos/run.py), or None."""
    for f in schedule.faults:
        if f.target.startswith("learner:") and int(f.target.split(":")[1]) >= learners:
            return f.target
    return None


def main(args: argparse.Namespace) -> int:
    if args.backend == "docker":
        return _main_docker(args)
    from ddiloco.chaos.run import run_with_chaos
    from ddiloco.launcher.cli import print_summary, signal_exit_code
    from ddiloco.launcher.run import LaunchOptions
    from ddiloco.launcher.topology import TopologyOptions

    from ddiloco.common.runflags import config_or_error

    cfg = config_or_error(args, "chaos")  # bad run flags fail here, before a folder or a process exists
    if cfg is None:
        return 2
    try:
        pacing.check(step_seconds=args.step_seconds, lease_timeout_s=cfg.lease_timeout_s)
    except ValueError as exc:
        print(f"ddiloco chaos: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or pathlib.Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    horizon = cfg.max_seconds  # the run's budget: the schedule plays within it
    schedule = build_schedule(args, horizon)
    shards = [int(f.target.split(":")[1]) for f in schedule.faults if f.target.startswith("outer:")]
    beyond = [i for i in shards if i >= cfg.outer_shards]
    if beyond:
        print(f"ddiloco chaos: error: a fault targets outer:{beyond[0]}, but the run has {cfg.outer_shards} outer "
              f"shard{'s' if cfg.outer_shards > 1 else ''} (--outer-shards)", file=sys.stderr)
        return 2
    learners = args.cfg_learners if args.cfg_learners is not None else 4
    missing = unknown_learner(schedule, learners)
    if missing:
        # it was found only at the end ("fault not injected: no running process for learner:7")
        print(f"ddiloco chaos: error: a fault targets {missing}, but the run's learners are 0 to {learners - 1} "
              f"(--learners)", file=sys.stderr)
        return 2
    # learner i runs in datacenter dc<i> (launcher/processes.py): another name was found only
    # when the fault came, as a partition of nothing
    named = sorted({f.target for f in schedule.faults if f.kind == "partition" and not f.target.startswith("learner")})
    unknown_dc = [d for d in named if d not in {f"dc{i}" for i in range(learners)}]
    if unknown_dc:
        print(f"ddiloco chaos: error: a fault partitions {unknown_dc[0]}, but the run's datacenters are dc0 to "
              f"dc{learners - 1} (one per learner, --learners)", file=sys.stderr)
        return 2
    print(f"chaos schedule: {schedule.describe()}", file=sys.stderr)
    options = LaunchOptions(out=out, run_flags=forward_run_flags(args), learners=learners, outer_shards=cfg.outer_shards,
                            device=args.device,
                            progress=not args.quiet, step_seconds=args.step_seconds,
                            topology=TopologyOptions(args.topology, args.wan_profile, args.wan_qdisc))
    try:
        options.topology.validate()
    except ValueError as exc:
        raise SystemExit(f"ddiloco chaos: {exc}")
    if args.topology != "netns" and any(f.kind == "partition" for f in schedule.faults):
        raise SystemExit("ddiloco chaos: partitions cut datacenter links, which exist only with --topology netns")
    result = run_with_chaos(options, schedule)
    if result.report is not None:
        from ddiloco.report import overlap

        print_summary(result.report, sys.stdout, overlap.of_run(out, cfg.learner.sync))
        _print_goodput(result.report, out)
    for err in result.fault_errors:
        print(f"fault not injected: {err}", file=sys.stderr)
    for name, code in result.failures.items():
        print(f"service {name} failed with exit code {code}; see {out}/logs/", file=sys.stderr)
    if result.interrupted:
        return signal_exit_code(result.signal_name)
    return 0 if result.ok else 1


def _print_goodput(report: dict, out: pathlib.Path) -> None:
    from ddiloco.chaos.audit import audit_run

    a = audit_run(out).summary()
    print("\n| goodput | lost in crash | refused stale | waiting | restarting | acked deltas lost | applied twice |")
    print("|---|---|---|---|---|---|---|")
    w = report.get("waste", {})
    print(
        f"| {report.get('goodput', float('nan')):.3f} | {w.get('lost_in_crash', 0):.3f} | {w.get('refused_stale', 0):.3f} | "
        f"{w.get('waiting', 0):.3f} | {w.get('restarting', 0):.3f} | {a['acked_deltas_lost']} | {a['deltas_applied_twice']} |"
    )
    print(f"\nrun folder: {out}")


def _main_docker(args: argparse.Namespace) -> int:
    from ddiloco.chaos.controller import ChaosController
    from ddiloco.chaos.dockerbackend import DockerBackend, DockerUnavailable
    from ddiloco.common.metrics import MetricsLog

    try:
        backend = DockerBackend.for_compose_project(args.project)
    except DockerUnavailable as exc:
        print(f"ddiloco chaos: {exc}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or backend.run_volume_path()
    if run_dir is None:
        print("ddiloco chaos: no --run-dir and no run volume found for fault events", file=sys.stderr)
        return 2
    horizon = args.cfg_max_seconds if args.cfg_max_seconds is not None else 3600.0
    schedule = build_schedule(args, horizon)
    missing = sorted({f.target for f in schedule.faults if f.target.startswith("outer:")} - set(backend.containers))
    if missing:
        shards = sum(t.startswith("outer:") for t in backend.containers)
        print(f"ddiloco chaos: error: a fault targets {missing[0]}, but project {args.project!r} has {shards} outer "
              f"shard{'s' if shards != 1 else ''} (DDILOCO_OUTER_SHARDS)", file=sys.stderr)
        return 2
    have = sorted(int(t.split(":")[1]) for t in backend.containers if t.startswith("learner:"))
    absent = sorted({f.target for f in schedule.faults if f.target.startswith("learner:")} - set(backend.containers))
    if absent:
        print(f"ddiloco chaos: error: a fault targets {absent[0]}, but project {args.project!r} has "
              f"{'learners ' + ', '.join(map(str, have)) if have else 'no learner'}", file=sys.stderr)
        return 2
    print(f"chaos schedule: {schedule.describe()}\nfault events -> {run_dir}/metrics.jsonl", file=sys.stderr)
    controller = ChaosController(schedule, backend, MetricsLog(run_dir / "metrics.jsonl", "chaos"))
    controller.start()
    try:
        while controller.thread.is_alive() and not backend.run_over():
            controller.thread.join(1.0)
    except KeyboardInterrupt:
        pass
    controller.stop(undo=True)
    print(json.dumps({"injected": controller.injected, "errors": controller.errors}))
    return 0 if not controller.errors else 1
