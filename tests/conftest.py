"""Shared fixtures. Services always run as real processes on real sockets."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # lets the suite run from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.launcher.processes import Cluster  # noqa: E402

from support import TINY_RUN, host_wide_lock, order_files, file_of, wait_serving, wait_until  # noqa: E402,F401


# ---------------------------------------------------------------- the slow tier
# Tests marked ``@pytest.mark.slow`` (e.g. the >= 5,000-request fuzz runs in tests/fuzz) are
# skipped unless ``--slow`` is given or DDILOCO_SLOW=1 is set; their quick forms always run.
def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="also run tests marked slow (or DDILOCO_SLOW=1)")


def slow_enabled(config) -> bool:
    import os

    return bool(config.getoption("--slow")) or os.environ.get("DDILOCO_SLOW", "") not in ("", "0")


# ---------------------------------------------------------------- parallel workers
# The suite runs on two xdist workers, a test file at a time each (README's test command:
# -n 2 --dist loadfile; by file, so a module's fixtures start once). Most tests spend much of
# their time waiting on real processes, which the second worker fills. Test files that use something host-wide hold one lock, file by file,
# so that they run one at a time across workers: the Docker engine (its images, a swarm,
# compose projects) and the kernel's network namespaces and tc qdiscs (bench/bandwidth.py
# builds its links from them too). A lock, not xdist's groups: pytest 9.2 ignores the node
# ids xdist 3.8 rewrites for them.
HOST_WIDE = ("docker/", "netns/", "wan/test_wan_tc.py", "chaos/test_partition.py", "chaos/test_docker_",
             "bench/test_bandwidth_quick.py")
_held: dict = {}  # the open lock file while this process holds it


def _host_wide(item) -> bool:
    return file_of(item).startswith(HOST_WIDE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the host-wide lock from the first test of such a file (its module fixtures start
    there) until its last one ends (they stop in its teardown)."""
    if _host_wide(item) and "lock" not in _held:
        _held["lock"] = host_wide_lock()
        _held["lock"].__enter__()
    yield
    if "lock" in _held and (nextitem is None or nextitem.fspath != item.fspath):
        _held.pop("lock").__exit__(None, None, None)


def pytest_collection_modifyitems(config, items):
    # the workers' collections must be the same: this order depends on the items alone
    items[:] = order_files(items)
    if slow_enabled(config):
        return
    skip = pytest.mark.skip(reason="slow tier: run with --slow or DDILOCO_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


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
