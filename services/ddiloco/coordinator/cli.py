"""``ddiloco coordinator``: serve membership, leases and the run configuration."""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

from ddiloco.common.cliargs import apply_env_defaults, port, setup_logging
from ddiloco.common.runflags import add_run_flags, run_config_from_args
from ddiloco.common.security import add_security_arguments, security_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:50051", help="HOST:PORT to listen on (port 0: any free port)")
    parser.add_argument("--run-dir", type=pathlib.Path, default=None, help="config.json, metrics.jsonl, report.json go here")
    parser.add_argument("--exit-when-finished", action="store_true", help="exit once the report is written")
    parser.add_argument("--port-file", type=pathlib.Path, default=None, help="write the bound port here once serving")
    # not --resume: `ddiloco run --resume RUN` owns DDILOCO_RESUME, which its children inherit
    parser.add_argument("--reopen", action="store_true",
                        help="continue the stopped run saved in --run-dir: its budget clock and learners' statistics go on")
    parser.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus /metrics on this port of the bind host (default 0: off)")
    parser.add_argument("--status-port", type=port, default=0, help="serve the live status page on this port of the bind host (default 0: off)")
    parser.add_argument("--log-level", default="INFO")
    add_security_arguments(parser, revocation=True)
    add_run_flags(parser)
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    setup_logging("coordinator", args.log_level)
    from ddiloco.common.durable import write_bytes
    from ddiloco.coordinator.membership import StateFileError
    from ddiloco.coordinator.service import CoordinatorOptions, CoordinatorService

    config = run_config_from_args(args)
    try:
        security = security_from_args(args, "coordinator")
    except SystemExit as exc:
        print(f"ddiloco coordinator: error: {exc.code}", file=sys.stderr)
        return 2
    if args.reopen and args.run_dir is None:
        print("ddiloco coordinator: error: --reopen continues the run saved in --run-dir; give --run-dir", file=sys.stderr)
        return 2
    options = CoordinatorOptions(
        args.bind, args.run_dir, args.exit_when_finished, reopen=args.reopen,
        metrics_port=args.metrics_port, status_port=args.status_port, security=security,
    )
    try:
        svc = CoordinatorService(config, options)
    except StateFileError as exc:  # saved state that cannot be trusted: say what and stop, no traceback
        print(f"ddiloco coordinator: cannot start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    signal.signal(signal.SIGINT, lambda *_: svc.stop())
    svc.start()
    if args.port_file:
        write_bytes(args.port_file, str(svc.port).encode())
    return svc.wait()
