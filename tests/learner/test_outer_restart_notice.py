"""A learner notices an outer-optimizer restart from its heartbeats, also when the restarted
process serves at the address it had (fixed ports, as in Compose): the coordinator counts
outer registrations and every heartbeat answer carries the count. On a change the learner
takes a new client (a fresh channel connects at once; the old one may be waiting out gRPC's
reconnect backoff) and its uploader retries a failed upload now rather than at the end of
its backoff. In the chaos ablation bench's runs the restarted outer optimizer came back on
its old port, so an address check alone never fired and learners re-sent 1-6 s late.

The heartbeat thread of a real ``Learner`` runs here against a stand-in for the
coordinator's stub that answers from a script (the count itself is checked over gRPC in
tests/coordinator/test_coordinator_service.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from ddiloco.common.config import RunConfig
from ddiloco.learner.stats import Stats
from ddiloco.learner.worker import Learner
from ddiloco.v1 import coordinator_pb2


class ScriptedCoordinator:
    """Answers each heartbeat with the next (outer address, registrations); stops the loop after the last."""

    def __init__(self, answers: list[tuple[str, int]], learner: "Learner") -> None:
        self.answers, self.learner = list(answers), learner

    def Heartbeat(self, req, timeout):
        address, count = self.answers.pop(0)
        if not self.answers:
            self.learner.stop_event.set()
        return coordinator_pb2.HeartbeatResponse(
            state=coordinator_pb2.RUN_STATE_RUNNING, outer_address=address, outer_registrations=count
        )


class RecordingUploader:
    def __init__(self) -> None:
        self.wakes = 0

    def outer_changed(self) -> None:
        self.wakes += 1


def _learner() -> Learner:
    learner = Learner.__new__(Learner)  # only what the heartbeat thread and _set_outer read
    learner.stop_event, learner.drain = threading.Event(), threading.Event()
    learner.heartbeat_s = 0.0
    learner.config = RunConfig()
    learner.options = SimpleNamespace(security=None)
    learner.run_id, learner.learner_id, learner.instance_token = "notice", 0, "t"
    learner.stats = Stats()
    learner.phase = "training"
    learner.train_started = 0.0
    learner.outer_address = ""
    learner._outer_registrations = None
    learner._client = None
    learner._client_lock = threading.Lock()
    learner.incarnation = 1  # as registered: clients name it
    return learner


def _run(answers: list[tuple[str, int]]) -> tuple[RecordingUploader, list]:
    """Heartbeats answered by ``answers`` in turn; returns the uploader and, per answer, the
    client the learner held after it."""
    learner = _learner()
    learner._set_outer(["127.0.0.1:9"])  # at registration: no count yet
    learner.uploader = RecordingUploader()
    clients = []
    original = learner._set_outer

    def set_outer(addresses, registrations=None):
        original(addresses, registrations)
        clients.append(learner._client)

    learner._set_outer = set_outer
    learner.coordinator = ScriptedCoordinator(answers, learner)
    try:
        learner._heartbeat_loop()
    finally:
        for c in {id(c): c for c in clients if c is not None}.values():
            c.close()
    return learner.uploader, clients


def test_a_restart_at_the_same_address_gives_a_new_client_and_wakes_the_uploader():
    uploader, clients = _run([("127.0.0.1:9", 1), ("127.0.0.1:9", 1), ("127.0.0.1:9", 2), ("127.0.0.1:9", 2)])
    assert uploader.wakes == 1, "one restart, one wake"
    assert clients[0] is clients[1], "the first count seen is only remembered"
    assert clients[2] is not clients[1], "the restart: a new client, same address"
    assert clients[3] is clients[2]
    assert clients[2].address == "127.0.0.1:9"


def test_a_new_address_still_wakes_the_uploader_once():
    uploader, clients = _run([("127.0.0.1:9", 1), ("127.0.0.1:10", 2), ("127.0.0.1:10", 2)])
    assert uploader.wakes == 1
    assert [c.address for c in clients] == ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:10"]


def test_a_new_incarnation_number_gives_a_new_client_whose_deltas_name_it():
    """A coordinator that lost its state numbers the id afresh when the learner registers
    again: its deltas must name the new number (the outer optimizer's fence,
    tests/outer/test_incarnation_fence.py), so the client is replaced."""
    learner = _learner()
    learner._set_outer(["127.0.0.1:9"])
    first = learner._client
    learner.uploader = RecordingUploader()
    try:
        assert first.incarnation == 1
        learner._set_outer(["127.0.0.1:9"])
        assert learner._client is first  # nothing changed: the same client
        learner.incarnation = 3  # as _register sets it from the Register answer
        learner._set_outer(["127.0.0.1:9"])
        assert learner._client is not first and learner._client.incarnation == 3
        assert learner.uploader.wakes == 1
    finally:
        first.close()
        learner._client.close()
