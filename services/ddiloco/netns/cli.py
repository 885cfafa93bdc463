"""``ddiloco netns``: the network-namespace topology outside a run.

    ddiloco netns cleanup [--all]   remove what dead runs left behind (all runs' with --all)
    ddiloco netns list [--json]     runs that hold namespaces, and whether their launcher lives
    ddiloco netns up --profile wan --datacenters 2
                                    build a topology and hold it until Ctrl-C (for experiments)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

from ddiloco.netns import registry
from ddiloco.netns import topology as T
from ddiloco.wan import tc
from ddiloco.wan.profiles import ProfileError, profile_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=pathlib.Path, default=registry.DEFAULT_STATE_DIR,
                        help="where runs' marker files live")
    sub = parser.add_subparsers(dest="action", metavar="{cleanup,list,up}")
    sub.required = True
    cp = sub.add_parser("cleanup", help="remove namespaces, links and processes of dead runs")
    cp.add_argument("--all", action="store_true", help="also those of runs whose launcher still lives")
    lp = sub.add_parser("list", help="runs holding namespaces")
    lp.add_argument("--json", action="store_true")
    up = sub.add_parser("up", help="build a topology and hold it until Ctrl-C")
    up.add_argument("--profile", required=True, help=f"one of: {', '.join(profile_names())}")
    up.add_argument("--datacenters", type=int, default=2)
    up.add_argument("--qdisc", choices=tc.QDISCS, default="tbf")


def main(args: argparse.Namespace) -> int:
    try:
        return {"cleanup": _cleanup, "list": _list, "up": _up}[args.action](args)
    except (T.NetnsError, tc.TcError, ProfileError, ValueError) as exc:
        print(f"ddiloco netns {args.action}: {exc}", file=sys.stderr)
        return 1


def _cleanup(args: argparse.Namespace) -> int:
    result = registry.cleanup(args.state_dir, include_live=args.all)
    for prefix, what in sorted(result.removed.items()):
        print(f"removed {prefix}: {', '.join(what) if what else 'nothing left (marker only)'}")
    for prefix in result.kept_live:
        print(f"kept {prefix}: its launcher is still running (--all removes it too)")
    if not result.removed and not result.kept_live:
        print("nothing to clean up")
    return 0


def _list(args: argparse.Namespace) -> int:
    runs = [{**m.__dict__, "alive": registry.owner_alive(m)} for m in registry.markers(args.state_dir)]
    claimed = {ns for r in runs for ns in r["namespaces"]}
    orphans = [ns for ns in T.list_namespaces() if T.NAMESPACE_RE.match(ns) and ns not in claimed]
    if args.json:
        print(json.dumps({"runs": runs, "orphan_namespaces": orphans}))
        return 0
    for r in runs:
        state = "running" if r["alive"] else "dead (ddiloco netns cleanup removes it)"
        print(f"{r['prefix']} pid {r['pid']} {state}: {' '.join(r['namespaces'])}")
    for ns in orphans:
        print(f"{ns}: no owner (ddiloco netns cleanup removes it)")
    if not runs and not orphans:
        print("no topologies")
    return 0


def _up(args: argparse.Namespace) -> int:
    from ddiloco.netns.session import NetnsSession, describe

    with NetnsSession(args.profile, args.datacenters, qdisc=args.qdisc, state_dir=args.state_dir) as session:
        assert session.plan is not None
        print(describe(session.plan))
        print("run a command inside a datacenter with: ip netns exec NAMESPACE COMMAND; Ctrl-C tears down",
              flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    print("torn down")
    return 0
