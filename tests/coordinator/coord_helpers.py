"""Shared pieces of the coordinator tests: a real coordinator process, and learner-side
requests signed the way a real learner signs them."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import channel
from ddiloco.coordinator.signature import model_signature
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

_SIGNATURES: dict[str, coordinator_pb2.ModelSignature] = {}


def run_signature(stub) -> coordinator_pb2.ModelSignature:
    cfg_json = stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5).config_json
    if cfg_json not in _SIGNATURES:
        _SIGNATURES[cfg_json] = model_signature(RunConfig.from_json(cfg_json))
    return _SIGNATURES[cfg_json]


def register(stub, requested=-1, run_id="", token=None, model=None, ranks=0, address="x:1", datacenter=""):
    """Register as a learner process would; ``token`` None: a new process each call."""
    req = coordinator_pb2.RegisterRequest(
        address=address,
        datacenter=datacenter,
        requested_learner_id=requested,
        run_id=run_id,
        instance_token=token if token is not None else secrets.token_hex(8),
        model=model if model is not None else run_signature(stub),
        ranks=ranks,
    )
    return stub.Register(req, timeout=10)


def announce_outer(stub, run_id="run"):
    stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id=run_id, kind="outer", address="127.0.0.1:9"), timeout=5)


def membership(stub) -> coordinator_pb2.Membership:
    return stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)


def snapshot(stub) -> list[tuple]:
    """What refused input must leave unchanged: who is a member, alive or not, in which
    incarnation, with which statistics, and the run's state."""
    m = membership(stub)
    return [m.state] + [
        (x.learner_id, x.alive, x.left, x.incarnation, x.shard_index, x.stats.SerializeToString(deterministic=True))
        for x in m.members
    ]


# For a coordinator that several tests share (a module-scoped fixture): a lease no module
# outlives, so that no member expires between those tests, nor between one test's snapshots,
# for no reason but the time the others took.
LONG_LEASE = ["--lease-timeout", "3600"]


def start_coordinator(tmp_path, flags=()):
    from support import TINY_RUN, wait_serving

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path)
    cluster.start_coordinator([*TINY_RUN, "--learners", "3", "--max-seconds", "600", *flags])
    wait_serving(cluster.coordinator_address)
    return cluster, coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))


@contextlib.contextmanager
def running_coordinator(tmp_path, flags=()):
    """``start_coordinator`` for a with-block (or a fixture's body): stopped on the way out."""
    cluster, stub = start_coordinator(tmp_path, flags)
    try:
        yield cluster, stub
    finally:
        cluster.stop_all()


@pytest.fixture
def coordinator(tmp_path):
    cluster, stub = start_coordinator(tmp_path, ["--lease-timeout", "1.5"])
    yield cluster, stub
    cluster.stop_all()


def fill_disk(folder: pathlib.Path) -> pathlib.Path:
    """Fill the file system ``folder`` is on (a small tmpfs) with one file; returns it, for
    the test to delete when the disk should have space again."""
    filler = pathlib.Path(folder) / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def refused_state_file(run_dir: pathlib.Path, flags: list[str]) -> str:
    """The last line of ``ddiloco coordinator`` started on ``run_dir``, whose saved state it
    must refuse: exit 1, no traceback, the line naming the state file as unusable."""
    import subprocess
    import sys

    state = pathlib.Path(run_dir) / "coordinator" / "state.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "coordinator", "--bind", "127.0.0.1:0", *flags, "--run-dir", str(run_dir),
         "--insecure", "--exit-when-finished"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ddiloco coordinator: cannot start: coordinator state {state} is unusable"), last
    return last


def events(run_dir: pathlib.Path, kind: str) -> list[dict]:
    """The run's ``metrics.jsonl`` events of ``kind``."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


class OuterAtTheEnd(outer_pb2_grpc.OuterOptimizerServicer):
    """An outer optimizer (one process) that answers Finalize only, counting the calls: for
    tests of how the coordinator ends a run."""

    def __init__(self) -> None:
        self.finalized = 0

    def Finalize(self, request, context):
        self.finalized += 1
        return outer_pb2.FinalizeResponse(final_eval_loss=1.5, final_eval_accuracy=0.25)
