"""A learner's heartbeat reports its wall time as it is, also while the training loop is
blocked (a synchronous learner waiting out an outer-optimizer outage). Reported only from
the loop, wall_seconds jumped by the whole wait at the next step; the coordinator refuses a
counter that grows faster than time between two reports, so every later heartbeat was
refused, the lease expired and live learners were declared dead (the quorum of a
synchronous run collapsed to one: bench/results/chaos.json at 40a8ceb).

The heartbeat thread of a real ``Learner`` runs here against a stand-in for the
coordinator's stub that records the requests (the coordinator's rule itself is exercised
over gRPC in tests/coordinator); the clock is real, the loop's blockage is simply that no
step runs."""

from __future__ import annotations

import threading
import time

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.errors import InvalidArgument
from ddiloco.coordinator.stats_rules import Bounds, check_report, stats_to_dict
from ddiloco.learner.worker import Learner
from ddiloco.v1 import coordinator_pb2


class RecordingCoordinator:
    def __init__(self, beats: int, stop: threading.Event) -> None:
        self.requests, self.beats, self.stop = [], beats, stop

    def Heartbeat(self, req, timeout):
        self.requests.append((time.monotonic(), coordinator_pb2.HeartbeatRequest.FromString(req.SerializeToString())))
        if len(self.requests) >= self.beats:
            self.stop.set()
        return coordinator_pb2.HeartbeatResponse(state=coordinator_pb2.RUN_STATE_RUNNING, outer_address="127.0.0.1:1")


def _learner_blocked_in_training(seconds_ago: float) -> Learner:
    from learner_fixtures import heartbeat_learner

    learner = heartbeat_learner("hb", 0, heartbeat_s=0.05)
    learner.train_started = time.monotonic() - seconds_ago
    learner._set_outer = lambda addresses, registrations=None: None
    return learner


def test_wall_time_is_reported_as_it_is_while_the_loop_is_blocked():
    learner = _learner_blocked_in_training(seconds_ago=30.0)
    learner.stats.set(wall_seconds=1.0)  # the last step ran 29 s ago
    learner.coordinator = RecordingCoordinator(beats=3, stop=learner.stop_event)
    learner._heartbeat_loop()
    sent = [(t, r.stats.wall_seconds) for t, r in learner.coordinator.requests]
    assert len(sent) == 3
    for t, wall in sent:
        assert abs(wall - (t - learner.train_started)) < 0.5, sent
    # and the coordinator's rule admits each report after the previous one
    bounds = Bounds.for_run(RunConfig())
    for (t0, r0), (t1, r1) in zip(learner.coordinator.requests, learner.coordinator.requests[1:]):
        check_report(bounds, stats_to_dict(r0.stats), stats_to_dict(r1.stats), t1 - t0)


def test_a_jump_of_the_whole_wait_is_what_the_coordinator_refuses():
    """The former report: wall time frozen during a 12 s wait, then the jump."""
    bounds = Bounds.for_run(RunConfig())
    before = {"wall_seconds": 100.0}
    with pytest.raises(InvalidArgument, match="wall_seconds grew by"):
        check_report(bounds, before, {"wall_seconds": 113.0}, 1.0)
