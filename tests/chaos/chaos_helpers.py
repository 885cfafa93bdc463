"""A small real system for fault tests: coordinator, outer optimizer and learners as processes
on 127.0.0.1 (tiny model, windows of 5 steps), faults injected through the chaos package's
own local backend, and checks read back from the run's event log and checkpoint folder."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import threading
from dataclasses import dataclass, field


import grpc
import pytest

from ddiloco.chaos.audit import audit_run
from ddiloco.chaos.controller import ChaosController
from ddiloco.chaos.faults import Schedule
from ddiloco.chaos.local import LocalBackend, role_of
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.rpc import channel
from ddiloco.launcher.processes import Cluster
from ddiloco.v1 import outer_pb2, outer_pb2_grpc


# shared with the rest of the suite (tests/support.py)
from support import TINY_RUN, wait_serving, wait_until  # noqa: E402,F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_latest_checkpoint(out: pathlib.Path) -> int | None:
    """Version of the checkpoint LATEST names, fully loaded; None if there is none yet.

    Raises if LATEST names something unloadable. A reader racing the writer's clean-up of
    *older* folders retries once with the new LATEST."""
    from safetensors.torch import load_file

    root = out / "outer" / "checkpoints"
    for attempt in range(2):
        latest = root / "LATEST"
        if not latest.exists():
            return None
        name = latest.read_text().strip()
        try:
            tensors = load_file(str(root / name / "global.safetensors"))
            state = json.loads((root / name / "state.json").read_text())
        except (FileNotFoundError, OSError):
            if attempt == 0 and (root / "LATEST").read_text().strip() != name:
                continue  # LATEST moved on and the writer pruned the old folder meanwhile
            raise
        assert any(k.startswith("param/") for k in tensors)
        assert state["version"] == int(name[1:].split("-")[0])  # vVERSION-gGENERATION (outer/checkpoint.py)
        return state["version"]
    return None


class CheckpointWatch:
    """Loads the checkpoint LATEST names every few tenths of a second for the whole test:
    every load must succeed, and versions must never go backwards."""

    def __init__(self, out: pathlib.Path, interval: float = 0.2) -> None:
        self.out = out
        self.interval = interval
        self.versions: list[int] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def check_now(self) -> int | None:
        try:
            v = load_latest_checkpoint(self.out)
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            self.errors.append(repr(exc))
            return None
        if v is not None:
            self.versions.append(v)
        return v

    def _loop(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.check_now()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(5)
        self.check_now()

    def assert_ok(self) -> None:
        assert not self.errors, f"a checkpoint on disk was not loadable: {self.errors[:3]}"
        assert self.versions == sorted(self.versions), "checkpoint versions went backwards"


@dataclass
class System:
    out: pathlib.Path
    cluster: Cluster
    backend: LocalBackend
    watch: CheckpointWatch
    chaos: ChaosController  # faults by hand (``inject``/``recover``), each logged as a fault event
    extra: dict = field(default_factory=dict)

    def events(self, kind: str | None = None) -> list[dict]:
        """Events so far; a line still being appended by a service is left for next time."""
        path = self.out / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        lines = text.split("\n")[:-1]  # whatever follows the last newline is incomplete
        evs = [json.loads(line) for line in lines if line.strip()]
        return [e for e in evs if kind is None or e["event"] == kind]

    def merges_with(self, learner: int, after: float = 0.0) -> list[dict]:
        return [e for e in self.events("merge") if e["t"] > after and any(d[0] == learner for d in e["deltas"])]

    def finish(self, timeout: float = 120.0) -> outer_pb2.OuterStatus:
        """End the run: learners drain (SIGTERM: flush, leave), the outer optimizer merges
        what is pending, then shuts down cleanly (its final checkpoint). Not through
        Finalize: the outer optimizer accepts that only from a run the coordinator reports
        draining, which a test's long budget never reaches."""
        learners = [p for p in self.cluster.procs if role_of(p) == "learner" and p.returncode() is None]
        for p in learners:
            os.killpg(p.popen.pid, signal.SIGTERM)
        for p in learners:
            p.popen.wait(timeout=timeout)
            assert p.returncode() == 0, f"{p.name} exited with {p.returncode()}; see {p.log_path}"

        def settled():
            try:
                with channel(self.cluster.registered_outer()) as ch:
                    st = outer_pb2_grpc.OuterOptimizerStub(ch).GetStatus(outer_pb2.StatusRequest(), timeout=3)
            except grpc.RpcError:
                return None
            return st if st.pending_deltas == 0 else None

        status = wait_until(settled, timeout, "the outer optimizer to merge every pending delta")
        for p in [p for p in self.cluster.procs if role_of(p) == "outer" and p.returncode() is None]:
            os.killpg(p.popen.pid, signal.SIGTERM)
            p.popen.wait(timeout=timeout)
            assert p.returncode() == 0, f"{p.name} exited with {p.returncode()}; see {p.log_path}"
        self.watch.stop()
        return status

    def assert_invariants(self) -> None:
        """After ``finish``: versions only increased, nothing applied twice, nothing
        acknowledged lost, every checkpoint seen was loadable."""
        a = audit_run(self.out)
        assert a.versions_monotonic, f"global versions went backwards: {a.versions}"
        assert not a.applied_twice, f"deltas applied twice: {a.applied_twice}"
        assert not a.acked_lost, f"acknowledged deltas never merged: {a.acked_lost}"
        self.watch.assert_ok()
        assert load_latest_checkpoint(self.out) is not None


@pytest.fixture
def system_factory(tmp_path):
    systems: list[System] = []
    throttles = []
    topologies = []

    def start(
        learners: int = 2, flags: list[str] | None = None, throttle_rate: float | None = None, max_seconds: float = 600,
        learner_flags: list[str] | None = None, topology: str = "local",
    ) -> System:
        out = tmp_path / f"run{len(systems)}"
        partitioner = None
        if topology == "netns":
            from ddiloco.chaos.partition import NetnsPartitioner
            from ddiloco.launcher.topology import NetnsTopology, TopologyOptions

            topo = NetnsTopology(TopologyOptions("netns", "lan"), learners, out)
            topo.__enter__()
            topologies.append(topo)
            cluster = Cluster(out, hub=topo.hub, datacenters=list(topo.datacenters))
            partitioner = NetnsPartitioner(topo.session.plan)
        else:
            cluster = Cluster(out)
        cluster.start_coordinator([*TINY_RUN, "--learners", str(learners), "--max-seconds", str(max_seconds), *(flags or [])])
        extra = {}
        if throttle_rate:
            from throttle import Throttle  # tests/chaos/throttle.py

            throttle = Throttle(free_port(), throttle_rate)
            throttles.append(throttle)
            extra["throttle"] = throttle
            for attempt in range(3):
                # the outer binds the port the relay forwards to, free a moment ago; any process's
                # outgoing connection may take it in between (the kernel hands out the same range),
                # and then the outer stops at once, naming the port: start it on another
                port = throttle.upstream[1]
                proc = cluster.spawn(
                    "outer",
                    ["outer", "--bind", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{throttle.port}",
                     "--coordinator", cluster.coordinator_address, "--run-dir", str(out), "--exit-when-finished",
                     *cluster.security_flags("outer", "outer")],
                )
                wait_until(lambda: cluster.registered_outer() or proc.returncode() is not None, 120,
                           "the outer optimizer to register or exit")
                if cluster.outer_address or attempt == 2:
                    break
                assert "Failed to bind" in proc.log_path.read_text(), f"the outer optimizer exited; see {proc.log_path}"
                cluster.procs.remove(proc)
                throttle.upstream = ("127.0.0.1", free_port())
        else:
            cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "the outer optimizer to register")
        wait_serving(cluster.outer_address)
        for i in range(learners):
            cluster.start_learner(i, ["--device", "cpu", "--learner-id", str(i), *(learner_flags or [])])
        backend = LocalBackend(cluster, partitioner)
        chaos = ChaosController(Schedule([]), backend, MetricsLog(out / "metrics.jsonl", "chaos"))
        system = System(out, cluster, backend, CheckpointWatch(out), chaos, extra)
        systems.append(system)
        return system

    yield start
    for s in systems:
        s.watch.stop_event.set()
        for p in list(s.cluster.procs):  # a test that failed may leave a process stopped
            try:
                os.killpg(p.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.cluster.stop_all(grace=10)
    for t in throttles:
        t.close()
    for topo in topologies:
        topo.__exit__(None, None, None)
