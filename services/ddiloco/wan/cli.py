"""``ddiloco wan``: apply or show a WAN bandwidth profile on a network device with tc.

    ddiloco wan apply --profile wan --datacenter 1 --dev eth0
    ddiloco wan apply --profile wan-mixed --datacenter 2 --dev auto --towards outer:50052
    ddiloco wan show --dev eth0 [--json]
    ddiloco wan profiles [--json]

Like every ddiloco flag, these also come from the environment, as DDILOCO_<FLAG>; the
WAN-prefixed names DDILOCO_WAN_PROFILE, DDILOCO_WAN_DEV, DDILOCO_WAN_TOWARDS and
DDILOCO_WAN_QDISC win over those, because a container's environment also configures the
learner, where a bare DDILOCO_PROFILE or DDILOCO_DEV would be ambiguous. DDILOCO_DATACENTER
is shared with ``ddiloco learner``. The Docker learner entrypoint relies on these.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.wan import profiles as P
from ddiloco.wan import tc
from ddiloco.wan.replica import ReplicaError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="{apply,show,clear,profiles,replica-index}")
    sub.required = True

    ap = sub.add_parser("apply", help="shape a device to a datacenter's rate under a profile")
    ap.add_argument("--profile", dest="wan_profile", default=None,
                    help=f"one of: {', '.join(P.profile_names())}")
    ap.add_argument("--datacenter", type=datacenter_index, default=0,
                    help="datacenter index, or a label ending in it such as dc2 (picks the rate in mixed profiles)")
    _dev_arguments(ap)
    ap.add_argument("--qdisc", dest="wan_qdisc", choices=tc.QDISCS, default="tbf", help="shaping qdisc")
    ap.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    _env_defaults(ap)

    sp = sub.add_parser("show", help="read back the egress limit on a device")
    _dev_arguments(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    _env_defaults(sp)

    cp = sub.add_parser("clear", help="remove any shaping from a device")
    _dev_arguments(cp)
    _env_defaults(cp)

    pp = sub.add_parser("profiles", help="list the defined profiles")
    pp.add_argument("--json", action="store_true", help="print one JSON object")

    rp = sub.add_parser(
        "replica-index",
        help="print this Compose replica's 0-based index (its datacenter), from its container name in Docker's DNS",
    )
    rp.add_argument("--dns", default="", metavar="HOST[:PORT]", help="DNS server to ask (default: /etc/resolv.conf's)")


def _env_defaults(p: argparse.ArgumentParser) -> None:
    apply_env_defaults(p)
    for action in p._actions:  # argparse offers no public iterator over actions
        if action.dest.startswith("wan_"):
            value = os.environ.get("DDILOCO_" + action.dest.upper())
            if value is not None:
                action.default = action.type(value) if action.type else value


def datacenter_index(text: str | int) -> int:
    """``2``, ``"2"`` or ``"dc2"`` -> 2: learners are labelled dc<i>, tc wants the index."""
    m = re.fullmatch(r"(?:[A-Za-z][A-Za-z_-]*)?([0-9]+)", str(text).strip())
    if not m:
        raise argparse.ArgumentTypeError(f"datacenter must be an index or a label ending in one (dc2), got {text!r}")
    return int(m.group(1))


def _dev_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dev", dest="wan_dev", default="eth0",
                   help="network device, or 'auto': the one that routes to --towards (default route without it)")
    p.add_argument("--towards", dest="wan_towards", default="",
                   help="HOST[:PORT] whose route picks the device when --dev auto")


def _device(args: argparse.Namespace) -> str:
    if args.wan_dev == "auto":
        return tc.device_towards(args.wan_towards or None)
    return args.wan_dev


def main(args: argparse.Namespace) -> int:
    try:
        return _ACTIONS[args.action](args)
    except (tc.TcError, P.ProfileError, ReplicaError) as exc:
        print(f"ddiloco wan {args.action}: {exc}", file=sys.stderr)
        return 1


def _apply(args: argparse.Namespace) -> int:
    if not args.wan_profile:
        raise P.ProfileError(f"--profile (or DDILOCO_WAN_PROFILE) is required; one of: {', '.join(P.profile_names())}")
    profile = P.get_profile(args.wan_profile)
    rate = profile.rate_for(args.datacenter)
    dev = _device(args)
    what = f"profile {profile.name}, datacenter {args.datacenter}: {dev} egress {P.format_rate(rate)}"
    if args.dry_run:
        print(f"would shape {what} ({args.wan_qdisc})")
        return 0
    if rate is not None:
        tc.require_net_admin()
    got = tc.shape(dev, rate, qdisc=args.wan_qdisc)
    print(f"shaped {what}; kernel reports root qdisc {got.kind}, {P.format_rate(got.rate_bits)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    got = tc.read(_device(args))
    if args.json:
        print(json.dumps({"dev": got.dev, "qdisc": got.kind, "rate_bits": got.rate_bits}))
    else:
        print(f"{got.dev}: root qdisc {got.kind}, egress {P.format_rate(got.rate_bits)}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    dev = _device(args)
    tc.clear(dev)
    print(f"{dev}: shaping removed")
    return 0


def _replica_index(args: argparse.Namespace) -> int:
    from ddiloco.wan.replica import container_index

    host, _, port = args.dns.partition(":")
    print(container_index(host or None, int(port or 53)))
    return 0


def _profiles(args: argparse.Namespace) -> int:
    profiles = P.load_profiles()
    if args.json:
        print(json.dumps({n: {"description": p.description, "rates_bits": list(p.rates)} for n, p in profiles.items()}))
        return 0
    for name, p in profiles.items():
        rates = ", ".join(P.format_rate(r) for r in p.rates)
        print(f"{name:10s} {rates:40s} {p.description}")
    return 0


_ACTIONS = {"apply": _apply, "show": _show, "clear": _clear, "profiles": _profiles, "replica-index": _replica_index}
