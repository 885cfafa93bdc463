"""``ddiloco config``: the effective run configuration that the given flags, environment
variables and ``--config`` file make, validated exactly as ``ddiloco run`` and ``ddiloco
coordinator`` validate them, printed as the JSON a ``--config`` file takes."""

from __future__ import annotations

import argparse
import json

from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.common.runflags import add_run_flags, config_or_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print", action="store_true", help="print the configuration (the default action)")
    add_run_flags(parser)
    apply_env_defaults(parser)


def main(args: argparse.Namespace) -> int:
    cfg = config_or_error(args, "config")
    if cfg is None:
        return 2
    print(json.dumps(json.loads(cfg.to_json()), indent=2, sort_keys=True))
    return 0
