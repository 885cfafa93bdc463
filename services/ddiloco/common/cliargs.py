"""Command-line helpers: every flag may also come from the environment, which is how
containers configure services (``--coordinator`` <- ``DDILOCO_COORDINATOR``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import pathlib
import re
import shlex
import sys

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A flag's value that is not what the flag takes. argparse prints an ArgumentTypeError's
    own words after the flag's name (a ValueError it reduces to "invalid <type> value"), and
    code that parses the same forms outside argparse (a ``--fault`` spec) catches a ValueError."""


def duration(text: str) -> float:
    """Seconds from ``60s``, ``1.5m``, ``500ms``, ``2h``, ``20`` (seconds) or ``inf``: the one
    form every duration flag of every command accepts."""
    if text.strip().lower() in ("inf", "never", "forever"):
        return math.inf
    m = _DURATION.match(text)
    if not m:
        raise BadValue(f"not a duration: {text!r} (examples: 60s, 1.5m, 500ms, 20, inf)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_folder(text: str) -> pathlib.Path:
    """A folder a command writes into: one that exists, or one it can create (its nearest
    existing parent a writable folder). Checked when the flags are read, so that a path that
    is a file, or under one, is a one-line error before anything starts, not a traceback
    from the first write seconds later."""
    if not text.strip():
        raise BadValue("a folder, got an empty path")
    path = pathlib.Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise BadValue(f"{text!r} is a file, not a folder")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise BadValue(f"{text!r} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadValue(f"{text!r} cannot be {'written' if parent == path.absolute() else 'created'}: {parent} is not writable")
    return path


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """One of ``LOG_LEVELS``, in any case (an unknown one was taken as INFO without a word)."""
    if text.upper() not in LOG_LEVELS:
        raise BadValue(f"one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


MAX_THREADS = 1024


def whole(low: int, high: int, allowed: str, name: str = "whole"):
    """An argparse type for a whole number from ``low`` to ``high``; a refusal says
    ``allowed`` and what was given (a number the wire or the run cannot carry was a
    traceback, a silent clamp or a late failure)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise BadValue(f"{allowed}, got {text!r}") from None
        if not low <= value <= high:
            raise BadValue(f"{allowed}, got {value}")
        return value

    parse.__name__ = name
    return parse


# Torch threads of a process (0 and negatives were taken as 1)
threads = whole(1, MAX_THREADS, f"a whole number of threads, 1 to {MAX_THREADS}", "threads")


def bind_address(text: str) -> str:
    """``HOST:PORT`` to listen on, the port 0 (any free one) to 65535: gRPC took a port
    beyond that modulo 65536 and listened there, and raised a traceback for no port at all."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise BadValue(f"HOST:PORT to listen on (PORT 0 for any free one), got {text!r}")
    if int(port_text) > 65535:
        raise BadValue(f"a port is 0 (any free one) to 65535, got {port_text}")
    return text


# A TCP port for an HTTP endpoint
port = whole(0, 65535, "a port is 0 (off) or 1 to 65535", "port")


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(flag: str, prefix: str = "DDILOCO_") -> str:
    """The environment variable of a long flag: ``--max-seconds`` -> ``DDILOCO_MAX_SECONDS``."""
    return prefix + flag[2:].replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str = "DDILOCO_") -> None:
    """Use ``DDILOCO_<FLAG>`` as the default of each optional flag (``--max-seconds`` reads
    ``DDILOCO_MAX_SECONDS``; an empty value counts as unset); a flag on the command line
    still wins. Each flag's help names
    its variable. A value that its flag would refuse (a number that is not one, a choice
    that is not offered, a boolean that is neither on nor off) ends the command with one
    error line and exit code 2, as a bad flag does, rather than a traceback or a silent
    default."""
    for action in parser._actions:  # argparse offers no public iterator over actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        name = env_name(longs[0], prefix)
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {name}]".strip()
        value = os.environ.get(name)
        if value is None or value == "":  # empty = unset (Compose passes unset variables so)
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            word = value.strip().lower()
            if word not in TRUE + FALSE:
                _env_error(parser, f"{name}={value!r}: expected one of {'/'.join(TRUE)} or {'/'.join(FALSE)}")
            on = word in TRUE
            action.default = on if isinstance(action, argparse._StoreTrueAction) else not on
            continue
        if isinstance(action, argparse._AppendAction):
            # a repeatable flag: several values, shell-quoted (``a=1 'b=two words'``)
            try:
                words = shlex.split(value)
            except ValueError as exc:
                _env_error(parser, f"{name}={value!r}: not shell-quoted words ({exc})")
            action.default = [_env_value(parser, action, name, longs[0], w) for w in words]
            continue
        converted = _env_value(parser, action, name, longs[0], value)
        if action.choices is not None and converted not in action.choices:
            _env_error(parser, f"{name}={value!r}: {longs[0]} must be one of {', '.join(map(str, action.choices))}")
        action.default = converted


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, flag: str, value: str):
    try:
        return action.type(value) if action.type is not None else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        kind = getattr(action.type, "__name__", "value")
        _env_error(parser, f"{name}={value!r}: not a valid {kind} for {flag} ({exc})")


def _env_error(parser: argparse.ArgumentParser, message: str) -> None:
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


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


def address(text: str) -> str:
    """A server's ``HOST:PORT`` to dial (``[v6]:PORT`` for an IPv6 literal), the port 1 to
    65535. gRPC took an empty target only to fail seconds later with a traceback, and a
    missing port as 443."""
    host, sep, port_text = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    if (not sep or not host or any(c.isspace() or c == "/" for c in text) or (":" in host and not bracketed)
            or not port_text.isdigit() or not 1 <= int(port_text) <= 65535):
        raise BadValue(f"HOST:PORT with a port from 1 to 65535, got {text!r}")
    return text


def advertised_address(text: str) -> str:
    """'' (the bound address) or a ``HOST:PORT`` others dial."""
    return address(text) if text else text


def seconds(low: float, high: float, what: str = "seconds"):
    """An argparse type: a finite number of seconds from ``low`` (excluded when 0: a wait of
    nothing is no wait) to ``high``; nan, inf and out-of-range values are refused in words."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise BadValue(f"a number of {what}, got {text!r}") from None
        if not (math.isfinite(value) and (value > 0 if low == 0 else value >= low) and value <= high):
            lowest = "above 0" if low == 0 else f"from {low:g}"
            raise BadValue(f"{what} {lowest} to {high:.0f}{_in_words(high)}, got {text}")
        return value

    parse.__name__ = "seconds"  # argparse names the type in its own messages
    return parse


def _in_words(seconds_: float) -> str:
    """`` (30 days)`` for a bound of whole days or hours, else nothing."""
    for unit, size in (("day", 86400), ("hour", 3600)):
        if seconds_ >= size and seconds_ % size == 0:
            n = int(seconds_ // size)
            return f" ({n} {unit}{'s' if n > 1 else ''})"
    return ""
