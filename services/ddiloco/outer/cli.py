"""``ddiloco outer``: serve the outer optimizer."""

from __future__ import annotations

import argparse
import sys

from ddiloco.common.cliargs import (
    address, advertised_address, apply_env_defaults, bind_address, limit_threads, log_level, port, run_folder,
    setup_logging, threads, whole,
)
from ddiloco.common.config_rules import MAX_FRAGMENTS
from ddiloco.common.security import add_security_arguments, security_from_args


# 0 up to the most shards a run may have; whether the run has this one is known once the
# coordinator answers (``ShardError``, exit 1)
shard = whole(0, MAX_FRAGMENTS - 1, f"a shard from 0 to the run's --outer-shards minus 1 (at most {MAX_FRAGMENTS - 1})",
              "shard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", type=bind_address, default="127.0.0.1:50052", help="HOST:PORT to listen on (port 0: any free port)")
    parser.add_argument("--advertise", type=advertised_address, default="", help="HOST:PORT learners should use (default: the bound address)")
    parser.add_argument("--coordinator", type=address, default="127.0.0.1:50051", help="coordinator HOST:PORT")
    parser.add_argument("--run-dir", type=run_folder, default=None, help="checkpoints, journal and metrics go here")
    parser.add_argument("--exit-when-finished", action="store_true", help="exit once the coordinator reports the run finished")
    parser.add_argument("--shard", type=shard, default=0,
                        help="which outer shard this process is, 0 to the run's --outer-shards minus 1 (default 0)")
    parser.add_argument("--threads", type=threads, default=1, help="torch threads")
    parser.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus /metrics on this port of the bind host (default 0: off)")
    parser.add_argument("--log-level", type=log_level, default="INFO")
    add_security_arguments(parser, revocation=True)
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    setup_logging("outer", args.log_level)
    try:
        security = security_from_args(args, "outer")
    except SystemExit as exc:
        print(f"ddiloco outer: error: {exc.code}", file=sys.stderr)
        return 2
    limit_threads(args.threads)
    from ddiloco.outer.service import OuterOptions, OuterService

    svc = OuterService(
        OuterOptions(
            bind=args.bind,
            advertise=args.advertise,
            coordinator=args.coordinator,
            run_dir=args.run_dir,
            exit_when_finished=args.exit_when_finished,
            metrics_port=args.metrics_port,
            security=security,
            shard=args.shard,
        )
    )
    import signal

    signal.signal(signal.SIGTERM, lambda *_: svc.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: svc.stop_event.set())
    from ddiloco.common.durable import FolderInUse
    from ddiloco.common.rpc import BindError
    from ddiloco.outer.checkpoint import CheckpointError
    from ddiloco.outer.journal import JournalCorrupt, MergeRecordCorrupt
    from ddiloco.outer.service import ShardError
    from ddiloco.outer.state import ModelFitError

    try:
        svc.start()
    except InterruptedError:
        return 0  # stopped by a signal before the coordinator answered
    except (CheckpointError, JournalCorrupt, MergeRecordCorrupt, ShardError, ModelFitError, FolderInUse, BindError) as exc:
        # state on disk that cannot be trusted, or a run that cannot hold its model: say
        # what and stop, no traceback
        print(f"ddiloco outer: cannot start: {exc}", file=sys.stderr)
        return 1
    return svc.wait()
