"""One process serves as each outer shard. A second one for the same folder is refused at
start (exit 1, one line naming the folder and the holder), and the first serves on; a second
one with a folder of its own takes the coordinator's map, and the first, finding its entry
answered by a live process as the same shard, stops (exit 1). Before, neither was told: the
second restored from the folder the first still wrote, and both published their own version 2
of one fragment, the later one overwriting the first's merge record (an acknowledged delta
vanished from the record of a published version). Real processes."""

from __future__ import annotations

import contextlib

from outer_helpers import Remote, register
from support import TINY_RUN, wait_serving, wait_until

from ddiloco.launcher.processes import Cluster


@contextlib.contextmanager
def _serving(tmp_path, run_id: str):
    """A coordinator and one outer optimizer process serving (for a run of one learner):
    yields (cluster, the outer process); stops every process after."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start_coordinator([*TINY_RUN, "--learners", "1", "--max-seconds", "600", "--run-id", run_id])
        first = cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        yield cluster, first
    finally:
        cluster.stop_all()


def test_a_second_process_for_the_same_folder_is_refused_and_the_first_serves_on(tmp_path):
    with _serving(tmp_path, "locked") as (cluster, first):
        address = cluster.outer_address
        second = cluster.start_outer(name="outer-again")
        assert second.exited_within(120), "the second process is still running"
        assert second.returncode() == 1
        log = second.log_path.read_text()
        assert f"ddiloco outer: cannot start: {tmp_path / 'outer'} is in use by another process (pid {first.popen.pid})" in log
        assert "Traceback" not in log
        (learner,) = register(cluster.coordinator_address, 1)
        assert cluster.outer_address == address and first.returncode() is None
        assert Remote(address, "locked", learner).push(1).outcome == 1  # the first one still accepts


def test_a_process_replaced_by_another_serving_as_the_same_shard_stops(tmp_path):
    with _serving(tmp_path, "replaced") as (cluster, first):
        old = cluster.outer_address
        second = cluster.start_outer(["--run-dir", str(tmp_path / "elsewhere")], name="outer-elsewhere")
        wait_until(lambda: cluster.registered_outer() and cluster.outer_address != old, 120, "the second registered")
        assert first.exited_within(60), "the replaced process is still serving"
        assert first.returncode() == 1
        assert f"another process serves as outer shard 0 at {cluster.outer_address}" in first.log_path.read_text()
        assert second.returncode() is None
