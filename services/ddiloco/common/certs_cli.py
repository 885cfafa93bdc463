"""``ddiloco certs``: a run's certificate authority, its services' certificates, revocation.

    ddiloco certs init DIR                                 # the run CA
    ddiloco certs issue DIR --name learner-4 --role learner  # one more learner, any time
    ddiloco certs setup DIR --learners 4                   # CA + every service of a run
    ddiloco certs revoke DIR --name learner-4              # deny list, reloaded by servers
    ddiloco certs show DIR/learner-4                       # who a certificate speaks for
    ddiloco certs unbundle DIR/learners.json --name learner-2 --into /tmp/tls
                                                           # one learner's folder from the bundle

Keys are written with mode 0600 and never printed (docs/security.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from ddiloco.common.certs import (
    DEFAULT_DAYS,
    MAX_DAYS,
    ROLES,
    CertError,
    identity_of,
    init_ca,
    issue,
    load_cert,
    revoke,
    setup_run,
    unbundle,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("init", help="create the run CA (ca.crt, ca.key) in DIR")
    p.add_argument("dir", type=pathlib.Path)
    p = sub.add_parser("issue", help="issue a key and certificate for one service into DIR/NAME")
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--name", required=True, help="coordinator, outer, learner-3, ... (also the folder name)")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--learner-id", type=int, default=None, help="a learner's id (default: the number in learner-<id>)")
    p.add_argument("--host", action="append", default=[], help="another DNS name or IP address to certify (repeatable)")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity, 1 to {MAX_DAYS} (default {DEFAULT_DAYS})")
    p = sub.add_parser("setup", help="CA and certificates of a whole run (coordinator, outer, operator, learners); keeps what exists")
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--learners", type=int, required=True,
                   help="the run's M: learner certificates for every id it admits, learner-0 .. learner-<2M-1>")
    p.add_argument("--host", action="append", default=[], help="another DNS name or IP address to certify (repeatable)")
    p = sub.add_parser("revoke", help="add a certificate to DIR/revoked.txt (the servers reload it)")
    p.add_argument("dir", type=pathlib.Path)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--name", help="revoke the current certificate of DIR/NAME")
    who.add_argument("--serial", type=lambda t: int(t, 16), help="revoke this serial number (hex)")
    p = sub.add_parser("unbundle", help="write one identity of a learners.json bundle as an identity folder")
    p.add_argument("bundle", type=pathlib.Path)
    p.add_argument("--name", required=True)
    p.add_argument("--into", type=pathlib.Path, required=True,
                   help="the identity folder to write; made with mode 0700 if missing (an existing one keeps its mode)")
    p = sub.add_parser("show", help="print the identity, serial and validity of an identity folder's certificate")
    p.add_argument("identity", type=pathlib.Path, help="DIR/NAME (or a tls.crt file)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "init":
            print(init_ca(args.dir))
        elif args.action == "issue":
            print(issue(args.dir, args.name, args.role, args.learner_id, tuple(args.host), args.days))
        elif args.action == "setup":
            if args.learners < 0:
                raise CertError(f"--learners must be at least 0, got {args.learners}")
            issued = setup_run(args.dir, args.learners, tuple(args.host))
            print(f"{args.dir}: issued {', '.join(issued) if issued else 'nothing (all present)'}")
        elif args.action == "revoke":
            serial = revoke(args.dir, args.name, args.serial)
            print(f"revoked serial {serial:x} in {args.dir / 'revoked.txt'}")
        elif args.action == "unbundle":
            print(unbundle(args.bundle, args.name, args.into))
        elif args.action == "show":
            path = args.identity / "tls.crt" if args.identity.is_dir() else args.identity
            cert = load_cert(path)
            ident = identity_of(cert)
            print(f"{ident.describe()}  serial {ident.serial:x}  valid {cert.not_valid_before_utc:%Y-%m-%d} "
                  f"to {cert.not_valid_after_utc:%Y-%m-%d}")
    except CertError as exc:
        print(f"ddiloco certs: error: {exc}", file=sys.stderr)
        return 2
    return 0
