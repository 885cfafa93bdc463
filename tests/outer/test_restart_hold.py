"""After a restart the outer optimizer holds merges until the learners' re-sent deltas are in
(at most ``RESTART_GRACE_S``), and waits only for learners that are heartbeating: a learner
that died just before or after the restart keeps its lease until the lease timeout, and a
hold that waited for it kept every other learner training on the pre-outage base the whole
time (docs/chaos.md, "Which faults cost what").

Real processes: a coordinator and an outer optimizer; three learner ids registered over
gRPC, two of them heartbeating from this test, the third silent but still holding its lease
(the lease timeout is 60 s). The outer optimizer is SIGKILLed with a delta of the first
learner pending and started again. The second heartbeating learner sends its delta: the
replayed delta of the first does not stand for what the first trained during the outage,
so nothing merges yet. Then the first re-sends: the merge must come at once, not when the
hold runs out."""

from __future__ import annotations

import os
import signal
import threading
import time

from outer_helpers import TOKENS, Remote, register

from ddiloco.common.metrics import read_events
from ddiloco.common.rpc import channel
from ddiloco.outer.known_learners import RESPONSIVE_HEARTBEAT_MS
from ddiloco.outer.service import RESTART_GRACE_S
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


class Heartbeats:
    """Heartbeat for ``ids`` every 0.3 s (a learner's own rate is 1 s) until stopped."""

    def __init__(self, address: str, run_id: str, ids: list[int]) -> None:
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel(address))
        self.run_id, self.ids = run_id, ids
        self.tokens = [TOKENS[(address, i)] for i in ids]
        self.stop = threading.Event()
        self.errors: list[Exception] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, token in zip(self.ids, self.tokens):
                try:
                    self.stub.Heartbeat(
                        coordinator_pb2.HeartbeatRequest(run_id=self.run_id, learner_id=i, stats=common_pb2.LearnerStats(),
                                                         instance_token=token),
                        timeout=5,
                    )
                except Exception as exc:  # noqa: BLE001 - reported by the test, not swallowed
                    self.errors.append(exc)
            self.stop.wait(0.3)


def _events(run_dir, name: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [e for e in read_events(path) if e["event"] == name] if path.exists() else []


def _member(cluster, learner_id: int):
    membership = cluster.membership()
    return next((m for m in membership.members if m.learner_id == learner_id), None) if membership else None


def test_a_learner_that_stopped_heartbeating_does_not_hold_the_merges_after_a_restart(tmp_path):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path)
    beats = None
    try:
        # M = 3, K = 2; leases outlive the test, so the silent learner stays live throughout
        cluster.start_coordinator([*TINY_RUN, "--learners", "3", "--quorum", "2", "--lease-timeout", "60",
                                   "--eval-interval", "600", "--max-seconds", "600", "--run-id", "hold"])
        outer = cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        a_id, b_id, silent = register(cluster.coordinator_address, 3)
        beats = Heartbeats(cluster.coordinator_address, "hold", [a_id, b_id])
        a = Remote(cluster.outer_address, "hold", a_id)
        a.push(seq=1, seed=1)  # acknowledged and journaled; alone it is below the quorum
        assert a.status().version == 0 and a.status().pending_deltas == 1

        os.killpg(outer.popen.pid, signal.SIGKILL)
        outer.popen.wait(10)
        cluster.start_outer()
        # outer_ready is logged once the hold is set, right after the registration
        wait_until(lambda: len(_events(tmp_path, "outer_ready")) == 2, 120, "the outer optimizer to serve again")
        restarted = time.monotonic()  # the hold runs until RESTART_GRACE_S from about here
        cluster.registered_outer()  # its new address
        # the silent learner: still holding its lease, and not heartbeating for longer than
        # the responsive bound (registration was its last sign of life)
        wait_until(
            lambda: (m := _member(cluster, silent)) is not None and m.alive
            and m.ms_since_heartbeat > RESPONSIVE_HEARTBEAT_MS + 1000,
            60, "the silent learner to be live but unresponsive",
        )
        b = Remote(cluster.outer_address, "hold", b_id)
        assert b.status().pending_deltas == 1, "the journaled delta is pending again after the restart"
        # the headers report no compute time, so no step time is known and the grace window
        # after the hold is 0 (outer/timing.py): once the hold ends, the merge is immediate
        b.push(seq=1, seed=2, base=0)
        # the merge loop looks every 0.25 s: had the replayed delta counted as a's, the hold
        # would have ended and merged within this window (the former rule, which counted
        # replays, did exactly that)
        window_end = time.monotonic() + 1.5
        while time.monotonic() < window_end:
            assert b.status().version == 0, "merged before a re-sent the work of its outage"
            time.sleep(0.1)
        a = Remote(cluster.outer_address, "hold", a_id)
        a.push(seq=2, seed=3, base=0)
        sent = time.monotonic()
        assert sent - restarted < RESTART_GRACE_S / 2, "precondition: the deltas arrived while the hold was on"
        wait_until(lambda: b.status().version >= 1, RESTART_GRACE_S + 30, "the merge after the restart")
        waited = time.monotonic() - sent
        status = b.status()
        assert status.pending_deltas == 0, "the replayed and the two re-sent deltas merged together"
        assert not beats.errors, beats.errors[:1]
        assert _member(cluster, silent).alive, "the silent learner still held its lease at the merge"
        # the hold runs RESTART_GRACE_S (10 s) from the restart: a hold that waited for the
        # silent learner would have merged only when it ran out
        assert waited < RESTART_GRACE_S / 2, f"merged {waited:.1f} s after the last responsive learner's delta"
    finally:
        if beats is not None:
            beats.stop.set()
        cluster.stop_all(grace=10)
