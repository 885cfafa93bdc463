"""Kernel byte counters of network devices, from ``/sys/class/net/<dev>/statistics``.

/sys/class/net shows the devices of the network namespace that mounted /sys, so the counters
of the hub's links can only be read from inside the hub namespace (``ip netns exec`` mounts a
fresh /sys there). The launcher therefore runs this module there as a small helper process:

    ip netns exec HUB python -m ddiloco.netns.counters --interval 1 dc0 dc1 ...

which prints one JSON line per tick, ``{"t": wall, "m": monotonic, "c": {dev: [tx, rx]}}``,
and a last line when its stdin closes (the launcher's "stop": the end-of-run reading), or
exits when its parent dies.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import sys
import time

SYSFS_NET = pathlib.Path("/sys/class/net")


def read_counters(dev: str, root: pathlib.Path = SYSFS_NET) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``dev`` as the kernel counts them (headers included)."""
    stats = root / dev / "statistics"
    try:
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no network device {dev!r} in this namespace ({stats} missing)") from None


def sample(devs: list[str], root: pathlib.Path = SYSFS_NET) -> dict:
    # wall time for joining with metrics.jsonl, monotonic for exact window lengths
    return {"t": time.time(), "m": time.monotonic(), "c": {d: list(read_counters(d, root)) for d in devs}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddiloco.netns.counters")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("devs", nargs="+")
    args = ap.parse_args(argv)
    if args.interval <= 0:
        ap.error("--interval must be positive")
    parent = os.getppid()

    def emit() -> None:
        sys.stdout.write(json.dumps(sample(args.devs)) + "\n")
        sys.stdout.flush()

    emit()
    next_tick = time.monotonic() + args.interval
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, next_tick - time.monotonic()))
        if ready and not os.read(sys.stdin.fileno(), 4096):
            emit()  # stdin closed: the final reading, then done
            return 0
        if os.getppid() != parent:
            return 0  # the launcher died; nobody reads us any more
        if time.monotonic() >= next_tick:
            emit()
            # ticks stay on the original grid; after a stall, skip to the next future tick
            next_tick += args.interval * max(1, int((time.monotonic() - next_tick) // args.interval) + 1)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
