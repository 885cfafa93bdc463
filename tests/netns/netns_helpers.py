"""Real namespaces, real veth links, real tc: these tests need root. Without it they skip,
and say why."""

from __future__ import annotations

import os
import subprocess

import pytest

NOT_ROOT = os.geteuid() != 0
NOT_ROOT_REASON = (
    f"needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) to create network namespaces and shape links with tc; "
    f"running as uid {os.geteuid()}"
)
requires_root = pytest.mark.skipif(NOT_ROOT, reason=NOT_ROOT_REASON)

if NOT_ROOT:
    print(f"tests/netns: skipping the namespace tests: {NOT_ROOT_REASON}")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def leftovers(prefix: str) -> list[str]:
    """Everything on the machine that still carries a run's name prefix."""
    return sorted(n for n in namespaces() | root_links() if n.startswith(prefix))
