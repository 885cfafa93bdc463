"""A real learner process at registration: it is refused, with the coordinator's message and
a non-zero exit, when its model is not the run's; restarted under the id of a learner whose
lease is still alive, it waits that lease out and then joins, within about one lease.

The two refusals share one coordinator (each checks that its learner changed nothing); the
restart, which takes an id, has one of its own."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from coord_helpers import (
    LONG_LEASE,
    announce_outer,
    coordinator,  # noqa: F401 - a fixture
    membership,
    register,
    running_coordinator,
    snapshot,
)

from ddiloco.launcher.processes import child_env
from ddiloco.v1 import common_pb2, coordinator_pb2


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    """A coordinator, its outer optimizer known, for learners that must be turned away."""
    with running_coordinator(tmp_path_factory.mktemp("refusing"), LONG_LEASE) as (cluster, stub):
        announce_outer(stub)
        yield cluster, stub


# a learner built from other model code: a 300-symbol vocabulary instead of 256 bytes
OTHER_MODEL_LEARNER = (
    "import sys; import ddiloco.common.model as m; m.VOCAB = 300; from ddiloco.cli import main; "
    "sys.exit(main(['learner', '--coordinator', sys.argv[1], '--device', 'cpu', '--insecure']))"
)


def test_a_learner_whose_model_differs_exits_with_the_reason_and_no_traceback(refusing):
    cluster, stub = refusing
    before = snapshot(stub)
    proc = subprocess.run(
        [sys.executable, "-c", OTHER_MODEL_LEARNER, cluster.coordinator_address],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAILED_PRECONDITION" in out and "wte.weight: [300, 64] instead of [256, 64]" in out, out
    assert "Traceback" not in out, out
    assert snapshot(stub) == before


def test_a_learner_restarted_under_a_live_id_waits_for_the_lease_then_joins(coordinator):
    from support import wait_until

    cluster, stub = coordinator
    announce_outer(stub)
    register(stub, requested=0, token="previous-process")
    previous_alive = threading.Event()
    previous_alive.set()

    def previous_process_heartbeats():
        while previous_alive.is_set():
            stub.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=0, stats=common_pb2.LearnerStats(),
                                                            instance_token="previous-process"), timeout=5)
            time.sleep(0.3)

    beats = threading.Thread(target=previous_process_heartbeats, daemon=True)
    beats.start()
    proc = cluster.start_learner(0, ["--device", "cpu"])
    # while the previous process keeps its lease, the new one is refused and keeps asking
    wait_until(lambda: "learner 0 is held by another live process" in proc.log_path.read_text(), 90, "the learner to be told the id is held")
    time.sleep(2)  # more than a lease: the holder is still the previous process
    assert membership(stub).members[0].incarnation == 1
    previous_alive.clear()
    beats.join()
    # the previous process is gone: within about one lease (1.5 s) the new one holds the id
    wait_until(lambda: membership(stub).members[0].incarnation == 2, 1.5 + 3, "the restarted learner to take id 0")
    assert proc.returncode() is None and membership(stub).members[0].alive


# a learner whose workload builds the run's tensors with other values (its own randomness)
OTHER_VALUES_LEARNER = """
import sys
import ddiloco.workloads.checked as checked
built = checked.Workload.build_model
def other_values(self):
    model = built(self)
    next(model.parameters()).data[0, 0] += 1.0
    return model
checked.Workload.build_model = other_values
from ddiloco.cli import main
sys.exit(main(['learner', '--coordinator', sys.argv[1], '--device', 'cpu', '--insecure']))
"""


def test_a_learner_whose_initial_parameters_differ_is_refused_before_it_trains(refusing):
    cluster, stub = refusing
    before = snapshot(stub)
    proc = subprocess.run(
        [sys.executable, "-c", OTHER_VALUES_LEARNER, cluster.coordinator_address],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAILED_PRECONDITION" in out and "the run's tensors but other initial values" in out, out
    assert "Traceback" not in out, out
    assert snapshot(stub) == before
