"""Shared fixtures. Services always run as real processes on real sockets."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # lets the suite run from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.common.health import check  # noqa: E402
from ddiloco.launcher.processes import Cluster  # noqa: E402

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


@pytest.fixture
def cluster_factory(tmp_path):
    """Start coordinator + outer optimizer (and optionally learners) as processes."""
    clusters: list[Cluster] = []

    def start(run_flags: list[str] | None = None, learners: int = 0, max_seconds: float = 600.0) -> Cluster:
        out = tmp_path / f"run{len(clusters)}"
        cluster = Cluster(out)
        clusters.append(cluster)
        flags = [*TINY_RUN, "--learners", str(max(learners, 2)), "--max-seconds", str(max_seconds), *(run_flags or [])]
        cluster.start_coordinator(flags)
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "the outer optimizer to register")
        wait_serving(cluster.outer_address)
        for i in range(learners):
            cluster.start_learner(i, ["--device", "cpu"])
        return cluster

    yield start
    for c in clusters:
        c.stop_all(grace=10)
