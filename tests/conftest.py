"""Shared fixtures. Services always run as real processes on real sockets."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # lets the suite run from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.launcher.processes import Cluster  # noqa: E402

from support import TINY_RUN, host_wide_lock, wait_serving, wait_until  # noqa: E402,F401


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
    return _rel(item).startswith(HOST_WIDE)


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


# The order the two workers take test files in. xdist would queue files by their number of
# tests, so the few-test files that run longest (the quick benches, the Compose and Swarm runs)
# came last: both workers then waited for one another at the end, on the host-wide lock
# (measured: 101 s of a 916 s run) or on one long file alone. Longest first instead (a
# longest-processing-time schedule), the host-wide ones alternating with others so that the
# two workers rarely want the lock at once; every other file follows, most tests first as
# before. Approximate seconds per file on 2 cores, from `--durations` runs; the order is all
# that matters (tests/test_host_wide_lock.py checks that every file named here exists).
LONG_FILES = (
    "bench/test_chaos_quick.py",  # ~190 s
    "bench/test_bandwidth_quick.py",  # host-wide, ~80 s
    "learner/test_learner_group.py",  # ~75 s
    "docker/test_docker_compose_e2e.py",  # host-wide, ~75 s
    "chaos/test_coordinator_kill.py",  # ~55 s
    "docker/test_docker_swarm_e2e.py",  # host-wide, ~70 s
    "launcher/test_resume.py",  # ~50 s
    "docker/test_docker_monitoring_e2e.py",  # host-wide, ~45 s
    "bench/test_merge_ablation_quick.py",  # ~47 s
    "netns/test_shaped_run.py",  # host-wide, ~30 s
    "chaos/test_outer_restart_quality.py",  # ~45 s
    "chaos/test_outer_shard_kill.py",  # ~44 s
    "workloads/test_examples.py",  # ~41 s
    "launcher/test_end_to_end.py",  # ~40 s
    "workloads/test_hf.py",  # ~39 s
    "bench/test_peer_diloco_quick.py",  # ~33 s
    "launcher/test_fragments_and_mixed_speed.py",  # ~30 s
    "bench/test_learner_overhead_quick.py",  # ~30 s
)


def _rel(item) -> str:
    return pathlib.Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").as_posix()


def order_files(items: list) -> list:
    """``items`` with whole files in the order above: the long ones first, then the rest by
    their number of tests, most first (xdist's own order). Stable within a file."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(_rel(item), []).append(item)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    ordered = sorted(files, key=lambda f: (0, rank[f]) if f in rank else (1, -len(files[f])))
    return [item for f in ordered for item in files[f]]


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
