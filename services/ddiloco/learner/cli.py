"""``ddiloco learner``: run one learner until the run drains."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys

from ddiloco.common import pacing
from ddiloco.common.config_rules import MAX_RANKS_PER_LEARNER, RULES
from ddiloco.common.cliargs import (
    BadValue, address, advertised_address, apply_env_defaults, bind_address, limit_threads, log_level, port, run_folder,
    setup_logging, threads, whole,
)
from ddiloco.common.security import add_security_arguments, security_from_args

# requested_learner_id travels as a protobuf int32 (ddiloco/v1/coordinator.proto): a larger
# id raised "Value out of range" in the learner after it had started
MAX_WIRE_ID = 2**31 - 1


# -1 (any free id) or an id the wire carries; the coordinator refuses one beyond its run's
learner_id = whole(-1, MAX_WIRE_ID, f"-1 (any free id) or an id from 0 to {MAX_WIRE_ID}", "learner_id")


def _override(path: str, name: str):
    """An integer flag that overrides the run's ``path`` for this learner: 0 (the run's) or
    what the run configuration's own rule allows (common/config_rules.py)."""
    ok, allowed = next((ok, allowed) for p, _flag, ok, allowed in RULES if p == path)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise BadValue(f"0 (the run's) or {allowed}, got {text!r}") from None
        if value != 0 and not ok(value):
            raise BadValue(f"0 (the run's) or {allowed}, got {value}")
        return value

    parse.__name__ = name
    return parse


batch_size = _override("learner.batch_size", "batch_size")
inner_steps = _override("learner.inner_steps", "inner_steps")


def state_folder(text: str) -> pathlib.Path | str:
    """'' (off) or a folder this learner can write its inner state into."""
    return run_folder(text) if text else text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", type=address, default="127.0.0.1:50051", help="coordinator HOST:PORT")
    parser.add_argument("--bind", type=bind_address, default="127.0.0.1:0", help="HOST:PORT of this learner's status/health endpoint")
    parser.add_argument("--advertise", type=advertised_address, default="", help="HOST:PORT others should use to reach this learner")
    parser.add_argument("--run-dir", type=run_folder, default=None, help="append events to RUN_DIR/metrics.jsonl")
    parser.add_argument(
        "--state-dir", type=state_folder, default=None, metavar="DIR",
        help="keep this learner's AdamW moments and schedule step in DIR, every H steps, so that a restart goes on "
        "from them (default: RUN_DIR/learner-state with --run-dir, else off; '' turns it off)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--learner-id", type=learner_id, default=-1, help="rejoin under this id, 0 up to the run's limit (default -1: a free one)")
    parser.add_argument("--datacenter", default="", help="label of this learner's datacenter")
    parser.add_argument("--slowdown", type=float, default=1.0, help="emulate hardware this many times slower")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, metavar="T",
        help="emulate dedicated hardware: each inner step takes at least T seconds, the wait counted as compute "
        "(default 0: off; for many learners sharing a machine's cores, see docs/chaos.md)",
    )
    parser.add_argument("--batch-size", type=batch_size, default=0, help="override the run's batch size for this learner (default 0: the run's)")
    parser.add_argument("--inner-steps", type=inner_steps, default=0, help="override H for this learner (default 0: the run's)")
    parser.add_argument("--threads", type=threads, default=1, help="torch CPU threads (of each rank)")
    parser.add_argument(
        "--nproc-per-learner", type=int, default=0, metavar="R",
        help=f"run this learner as a torch.distributed group of R processes on this host (1 to {MAX_RANKS_PER_LEARNER}; "
        "rank 0, this process, alone speaks gRPC; default 0: the run's --ranks-per-learner). A group of another "
        "size than the run's does that many batches' work per step, as a learner with its own --batch-size does",
    )
    parser.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus /metrics on this port of the bind host (default 0: off)")
    parser.add_argument("--log-level", type=log_level, default="INFO")
    add_security_arguments(parser)
    apply_env_defaults(parser)


def _state_dir(args: argparse.Namespace) -> pathlib.Path | None:
    if args.state_dir is None:
        return args.run_dir / "learner-state" if args.run_dir is not None else None
    return pathlib.Path(args.state_dir) if args.state_dir else None


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.nproc_per_learner <= MAX_RANKS_PER_LEARNER:
        print(f"ddiloco learner: error: --nproc-per-learner must be 0 (the run's) or 1 to {MAX_RANKS_PER_LEARNER}, got {args.nproc_per_learner}",
              file=sys.stderr)
        return 2
    try:
        pacing.check(args.slowdown, args.step_seconds)
    except ValueError as exc:
        print(f"ddiloco learner: error: {exc}", file=sys.stderr)
        return 2
    state_dir = _state_dir(args)
    if state_dir is not None and args.state_dir is None:
        try:  # the default, RUN_DIR/learner-state: checked as --state-dir is
            run_folder(str(state_dir))
        except BadValue as exc:
            print(f"ddiloco learner: error: --state-dir (default RUN_DIR/learner-state): {exc}", file=sys.stderr)
            return 2
    setup_logging("learner", args.log_level)
    try:
        security = security_from_args(args, "learner")
    except SystemExit as exc:
        print(f"ddiloco learner: error: {exc.code}", file=sys.stderr)
        return 2
    learner_id = args.learner_id
    if security.identity is not None:
        # the certificate says who this learner is; a --learner-id may only repeat it
        own = security.identity.learner_id
        if learner_id not in (-1, own):
            print(f"ddiloco learner: error: --learner-id {learner_id}, but the certificate in --tls-dir is learner {own}'s",
                  file=sys.stderr)
            return 2
        learner_id = own
    limit_threads(args.threads)
    from ddiloco.common.rpc import BindError
    from ddiloco.learner.worker import Learner, LearnerOptions

    try:
        learner = Learner(
            LearnerOptions(
                coordinator=args.coordinator,
                bind=args.bind,
                advertise=args.advertise,
                run_dir=args.run_dir,
                state_dir=state_dir,
                device=args.device,
                learner_id=learner_id,
                datacenter=args.datacenter,
                slowdown=args.slowdown,
                step_seconds=args.step_seconds,
                batch_size=args.batch_size,
                inner_steps=args.inner_steps,
                metrics_port=args.metrics_port,
                security=security,
                ranks=args.nproc_per_learner,
                threads=args.threads,
            )
        )
    except BindError as exc:  # --bind in use, or not this host's: one line, no traceback
        print(f"ddiloco learner: cannot start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: learner.request_stop())
    signal.signal(signal.SIGINT, lambda *_: learner.request_stop())
    code = learner.run()
    # By now the learner has flushed its uploads and left the run. Skip interpreter
    # finalisation: a daemon thread still inside a gRPC call there can make gRPC's C++ core
    # abort the process ("terminate called without an active exception"), turning a clean
    # exit into SIGABRT.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
