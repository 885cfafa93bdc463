"""Helpers shared by the test folders. A plain module with a unique name: `conftest` is
ambiguous as an import once several test folders have one."""

from __future__ import annotations

import os
import time

from ddiloco.common.health import check

# A tiny model and short windows keep every multi-process test within seconds on 2 cores.
TINY_RUN = ["--model", "tiny", "--inner-steps", "5", "--batch-size", "4", "--data-bytes", "600000", "--eval-interval", "2"]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll a condition (never a bare sleep standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_serving(address: str, timeout: float = 120.0) -> None:
    wait_until(lambda: check(address, timeout=1.0)[0], timeout, f"{address} to answer SERVING")


def read_pty(fd: int) -> bytes:
    """Everything written to a pseudo-terminal until every writer has closed it."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)
