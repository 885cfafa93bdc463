"""Shared by the Docker tests: paths, the skip-or-fail rule, and a docker CLI runner."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = ROOT / "docker" / "engine.sh"
COMPOSE_FILE = ROOT / "compose.yaml"
STACK_FILE = ROOT / "docker" / "stack.yaml"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
IMAGE = os.environ.get("DDILOCO_IMAGE", "ddiloco:latest")
IN_CI = os.environ.get("CI", "").lower() == "true"


def skip_or_fail(reason: str) -> None:
    """Skip, saying why; under CI=true fail instead, since CI has root and the packages."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the Docker tests must run, not skip)")
    print(f"\ntests/docker: skipping: {reason}", file=sys.stderr)
    pytest.skip(reason)


def tool(name: str) -> str:
    """A console script of the test environment (next to this Python), else from PATH."""
    beside = pathlib.Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        skip_or_fail(f"{name} is not installed (pip install '.[test]')")
    return found  # type: ignore[return-value]


def run(*args: str, check: bool = True, timeout: float = 120, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    merged = {**os.environ, **(env or {})}  # a None value unsets the variable
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={k: v for k, v in merged.items() if v is not None}, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"`{' '.join(args)}` exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def docker_up() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
