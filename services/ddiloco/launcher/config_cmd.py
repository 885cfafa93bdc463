"""``ddiloco config``: the effective run configuration that the given flags, environment
variables and ``--config`` file make, validated exactly as ``ddiloco run`` and ``ddiloco
coordinator`` validate them, printed as the JSON a ``--config`` file takes."""

from __future__ import annotations

import argparse
import json
import sys

from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.common.runflags import add_run_flags, run_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print", action="store_true", help="print the configuration (the default action)")
    add_run_flags(parser)
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = run_config_from_args(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"ddiloco config: error: {exc.code}", file=sys.stderr)
            return 2
        raise
    print(json.dumps(json.loads(cfg.to_json()), indent=2, sort_keys=True))
    return 0
