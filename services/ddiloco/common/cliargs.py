"""Command-line helpers: every flag may also come from the environment, which is how
containers configure services (``--coordinator`` <- ``DDILOCO_COORDINATOR``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str = "DDILOCO_") -> None:
    """Use ``DDILOCO_<FLAG>`` as the default of each optional flag (``--max-seconds`` reads
    ``DDILOCO_MAX_SECONDS``); a flag on the command line still wins."""
    for action in parser._actions:  # argparse offers no public iterator over actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        value = os.environ.get(prefix + longs[0][2:].replace("-", "_").upper())
        if value is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        elif action.type is not None:
            action.default = action.type(value)
        else:
            action.default = value


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def limit_threads(n: int) -> None:
    """One process per core is the norm here; oversubscribed BLAS threads only fight."""
    import torch

    torch.set_num_threads(max(1, n))
