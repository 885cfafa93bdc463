"""A learner told by the coordinator that another process holds its id since it was cut off
(ABORTED on a heartbeat, tests/coordinator/test_superseded_process.py) stops at once: its
uploader is stopped before the failure starts the drain, whose flush would otherwise send
the queued windows under the successor's id, and the process exits non-zero.

The heartbeat thread of a real ``Learner`` runs against a stand-in for the coordinator's
stub that answers ABORTED (the coordinator's rule itself runs over gRPC in
tests/coordinator), with a stand-in uploader that records when it is stopped."""

from __future__ import annotations

import threading

import grpc

from ddiloco.common.metrics import MetricsLog
from ddiloco.learner.supervision import Supervisor
from learner_fixtures import heartbeat_learner


class Aborted(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.ABORTED

    def details(self):
        return "learner 3 is held by another process since this one was cut off past its lease (incarnation 2)"


class AbortingCoordinator:
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def Heartbeat(self, req, timeout):
        self.tokens.append(req.instance_token)
        raise Aborted()


class RecordingUploader:
    def __init__(self, drain: threading.Event) -> None:
        self.drain = drain
        self.stopped_before_drain: bool | None = None

    def stop(self) -> None:
        self.stopped_before_drain = not self.drain.is_set()


def test_a_superseded_learner_stops_its_uploads_before_draining_and_fails_loudly():
    learner = heartbeat_learner("run", 3)
    learner.metrics = MetricsLog(None, "learner")
    learner.supervisor = Supervisor("learner", on_failure=learner.drain.set)
    learner.coordinator = AbortingCoordinator()
    learner.uploader = RecordingUploader(learner.drain)

    learner._heartbeat_loop()  # returns: no more heartbeats from a superseded process

    assert learner.coordinator.tokens == ["this-process"]  # it said which process it is
    assert learner.uploader.stopped_before_drain is True
    assert learner.superseded and learner.drain.is_set()
    assert learner.supervisor.exit_code() == 1 and "superseded" in learner.supervisor.failure


def test_told_by_the_heartbeat_and_an_uploader_at_once_it_stops_once(tmp_path):
    """The heartbeat thread and each outer shard's uploader may each learn that another
    process holds the id (the outer optimizer's fence, tests/outer/test_incarnation_fence.py):
    one event, one failure, the first cause kept."""
    import json

    learner = heartbeat_learner("run", 3)
    learner.metrics = MetricsLog(tmp_path / "metrics.jsonl", "learner")
    learner.supervisor = Supervisor("learner", on_failure=learner.drain.set)
    learner.uploader = RecordingUploader(learner.drain)

    learner._superseded("upload of fragment 1 seq 9 refused: incarnation 1 was replaced by incarnation 2", "uploader")
    learner._superseded("learner 3 is held by another process (incarnation 2)", "heartbeat")

    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    superseded = [e for e in events if e["event"] == "learner_superseded"]
    assert [e["by"] for e in superseded] == ["uploader"]
    assert learner.supervisor.failure.startswith("uploader: superseded: upload of fragment 1 seq 9")
    assert learner.uploader.stopped_before_drain is True
