"""``ddiloco coordinator``: serve membership, leases and the run configuration."""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

from ddiloco.common.cliargs import BadValue, apply_env_defaults, bind_address, log_level, port, run_folder, setup_logging
from ddiloco.common.runflags import add_run_flags, run_config_from_args
from ddiloco.common.security import add_security_arguments, security_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", type=bind_address, default="127.0.0.1:50051", help="HOST:PORT to listen on (port 0: any free port)")
    parser.add_argument("--run-dir", type=run_folder, default=None, help="config.json, metrics.jsonl, report.json go here")
    parser.add_argument("--exit-when-finished", action="store_true", help="exit once the report is written")
    parser.add_argument("--port-file", type=pathlib.Path, default=None,
                        help="write the bound port here once serving (its folder is created, as --run-dir is)")
    # not --resume: `ddiloco run --resume RUN` owns DDILOCO_RESUME, which its children inherit
    parser.add_argument("--reopen", action="store_true",
                        help="continue the stopped run saved in --run-dir: its budget clock and learners' statistics go on")
    parser.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus /metrics on this port of the bind host (default 0: off)")
    parser.add_argument("--status-port", type=port, default=0, help="serve the live status page on this port of the bind host (default 0: off)")
    parser.add_argument("--log-level", type=log_level, default="INFO")
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
    if args.reopen and not (args.run_dir / "coordinator" / "state.json").is_file():
        # without it the coordinator started a fresh run (and created the folder), silently
        print(f"ddiloco coordinator: error: --reopen: {args.run_dir} holds no saved run (coordinator/state.json)",
              file=sys.stderr)
        return 2
    if args.port_file is not None:
        problem = _port_file_problem(args.port_file)
        if problem:
            print(f"ddiloco coordinator: error: --port-file: {problem}", file=sys.stderr)
            return 2
    options = CoordinatorOptions(
        args.bind, args.run_dir, args.exit_when_finished, reopen=args.reopen,
        metrics_port=args.metrics_port, status_port=args.status_port, security=security,
    )
    from ddiloco.common.rpc import BindError

    try:
        svc = CoordinatorService(config, options)
    except (StateFileError, BindError) as exc:  # saved state that cannot be trusted, a --bind in use: say what, no traceback
        print(f"ddiloco coordinator: cannot start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    signal.signal(signal.SIGINT, lambda *_: svc.stop())
    svc.start()
    if args.port_file:
        try:
            args.port_file.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(args.port_file, str(svc.port).encode())
        except OSError as exc:  # StorageError too: checked above, but the disk can still refuse (full, read-only)
            svc.stop()
            svc.wait()
            print(f"ddiloco coordinator: cannot start: --port-file {args.port_file}: {exc}", file=sys.stderr)
            return 1
    return svc.wait()


def _port_file_problem(path: pathlib.Path) -> str | None:
    """Why the bound port cannot be written to ``path``, known before anything starts (it
    was a traceback after the server had started). Its folder is created, as --run-dir is,
    so that ``--run-dir R --port-file R/port`` works for a new R."""
    if path.is_dir():
        return f"{str(path)!r} is a folder, not a file"
    try:
        run_folder(str(path.parent))
    except BadValue as exc:
        return f"its folder: {exc}"
    return None
