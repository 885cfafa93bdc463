"""A coordinator restarted on its saved state: the end of a finished run is completed, never
lost, and a state file that cannot be trusted stops it at start with one line naming the file.

* The end of the run is saved (FINISHED, with the outer optimizer's final answers) before
  report.json is written. A coordinator that died between the two, restarted, writes the
  report from the saved answers (its outer optimizer has exited by then) and finishes; one
  whose report is written just finishes. Before, the restart served FINISHED forever: the
  end is reached only from DRAINING, so no report was written and --exit-when-finished never
  exited.
* FINISHED is not shown before it is saved: the outer optimizer exits once it reads it, and
  a restart that found the run still draining would ask it for answers it can no longer give.
* A torn, empty, altered or impossible state file (an unknown run state, a member that no
  coordinator writes) is refused: exit 1, no traceback. Before, the CLI died with a bare
  JSONDecodeError that named no file, or served a state that never drains.

The outer optimizer is a stand-in: a real gRPC server answering Finalize, all the
coordinator asks it at the end of a run; the coordinators serve on real sockets.
"""

from __future__ import annotations

import json
import threading

import pytest
from coord_helpers import OuterAtTheEnd, refused_state_file
from support import wait_until

from ddiloco.common.config import RunConfig
from ddiloco.common.durable import StorageError
from ddiloco.common.rpc import Server
from ddiloco.coordinator import membership as membership_mod
from ddiloco.coordinator import service as service_mod
from ddiloco.coordinator.membership import MemberRecord, Membership
from ddiloco.coordinator.service import CoordinatorOptions, CoordinatorService
from ddiloco.v1 import coordinator_pb2, outer_pb2_grpc

FINISHED = coordinator_pb2.RUN_STATE_FINISHED
DRAINING = coordinator_pb2.RUN_STATE_DRAINING


class _Crash(Exception):
    """The process dying at this point (the timer's supervisor stops the coordinator)."""


def _serve_until_finished(svc: CoordinatorService) -> int:
    """Start ``svc`` (--exit-when-finished) and return its exit status once it exits."""
    status: list[int] = []
    threading.Thread(target=lambda: status.append(svc.wait()), daemon=True).start()
    svc.start()
    try:
        wait_until(lambda: status, 60, "the restarted coordinator to finish the run and exit")
    finally:
        svc.stop()
    return status[0]


def _restarted(tmp_path) -> CoordinatorService:
    return CoordinatorService(RunConfig(), CoordinatorOptions(bind="127.0.0.1:0", run_dir=tmp_path,
                                                              exit_when_finished=True, linger_s=0.5))


def test_a_coordinator_that_died_before_writing_the_report_writes_it_at_restart_from_the_saved_answers(tmp_path, monkeypatch):
    outer = OuterAtTheEnd()
    server = Server("127.0.0.1:0", ["ddiloco.v1.OuterOptimizer"])
    outer_pb2_grpc.add_OuterOptimizerServicer_to_server(outer, server.grpc_server)
    server.start()
    server.set_ready()
    write_json = service_mod.write_json

    def dies_at_the_report(path, obj):
        if path.name == "report.json":
            raise _Crash("killed between the FINISHED save and the report")
        write_json(path, obj)

    monkeypatch.setattr(service_mod, "write_json", dies_at_the_report)
    first = CoordinatorService(RunConfig(), CoordinatorOptions(bind="127.0.0.1:0", run_dir=tmp_path))
    try:
        first.members.outer_shards = [f"127.0.0.1:{server.port}"]
        with first.members.lock:  # every learner has left a draining run: the timer ends it
            first.members.state = DRAINING
            first.members.drain_started = first.members.clock()
        first.start()
        assert first.wait() == 1  # died at the report
    finally:
        first.stop()
        server.stop(grace=0)  # the outer optimizer saw FINISHED and exited
    monkeypatch.undo()
    assert json.loads((tmp_path / "coordinator" / "state.json").read_text())["state"] == FINISHED
    assert not (tmp_path / "report.json").exists()

    assert _serve_until_finished(_restarted(tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["state"], report["final_eval_loss"], report["final_eval_accuracy"]) == ("finished", 1.5, 0.25)
    assert outer.finalized == 1, "the end is completed from what was saved, not asked again"


def test_a_run_finished_without_its_answers_saved_gets_a_report_whose_outer_figures_are_unknown(tmp_path):
    # a state file saved FINISHED before the answers were saved with it
    members = Membership(RunConfig(), tmp_path / "coordinator" / "state.json")
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, instance_token="t", left=True)
    members.state = FINISHED
    members.save()

    assert _serve_until_finished(_restarted(tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["state"] == "finished"
    assert report["final_eval_loss"] is None and report["outer_steps"] is None, "unknown, not a loss of 0"
    assert [x["learner_id"] for x in report["learners"]] == [0]


def test_a_run_finished_with_its_report_written_just_finishes_and_keeps_the_report(tmp_path):
    members = Membership(RunConfig(), tmp_path / "coordinator" / "state.json")
    members.state = FINISHED
    members.save()
    written = json.dumps({"run_id": "run", "state": "finished", "final_eval_loss": 1.5, "written": "first"})
    (tmp_path / "report.json").write_text(written)

    assert _serve_until_finished(_restarted(tmp_path)) == 0
    assert (tmp_path / "report.json").read_text() == written


def test_finished_is_not_shown_before_it_is_saved(tmp_path, monkeypatch):
    members = Membership(RunConfig(), tmp_path / "state.json")
    members.state = DRAINING
    members.save()

    def full_disk(path, obj):
        raise StorageError(path, OSError(28, "No space left on device"))

    monkeypatch.setattr(membership_mod, "write_json", full_disk)
    with pytest.raises(StorageError):
        members.finish()
    assert members.state == DRAINING
    assert members.membership_pb().state == DRAINING


def _state_doc(**fields) -> dict:
    """A state file as a coordinator of the default run writes it, unsealed (from before the
    seal), with ``fields`` replaced."""
    member = {"learner_id": 0, "shard_index": 0, "address": "x:1", "datacenter": "", "ranks": 1, "incarnation": 1,
              "instance_token": "t", "left": False, "stats": {"tokens": 64}, "carried": {}}
    doc = {"run_id": "run", "state": coordinator_pb2.RUN_STATE_RUNNING, "outer_shards": ["127.0.0.1:9"],
           "outer_registrations": 1, "elapsed": 12.5, "members": [member]}
    return {**doc, **fields}


def _sealed_then_altered(tmp_path) -> bytes:
    members = Membership(RunConfig(), tmp_path / "sealed.json")
    members.elapsed_before = 120.0
    members.save()
    return (tmp_path / "sealed.json").read_text().replace("120.0", "12.0").encode()


@pytest.mark.parametrize("damage, words", [
    ("truncated", "not JSON"),
    ("empty", "not JSON (empty)"),
    ("state 7", "state 7 is not a run state"),
    ("altered after sealing", "does not match its seal"),
])
def test_the_cli_refuses_a_damaged_state_file_in_one_line_naming_it(tmp_path, damage, words):
    state = tmp_path / "coordinator" / "state.json"
    state.parent.mkdir(parents=True)
    good = json.dumps(_state_doc()).encode()
    state.write_bytes({
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "state 7": json.dumps(_state_doc(state=7)).encode(),
        "altered after sealing": _sealed_then_altered(tmp_path),
    }[damage])
    assert words in refused_state_file(tmp_path, ["--model", "tiny", "--learners", "1"])


@pytest.mark.parametrize("fields, words", [
    ({"state": 0}, "is not a run state"),
    ({"state": True}, "is not a run state"),
    ({"elapsed": -1.0}, "elapsed"),
    ({"outer_shards": ["a:1", "b:1"]}, "outer shards"),
    ({"members": [{"learner_id": 2, "shard_index": 0}]}, "not a learner id of this run"),
    ({"members": [{"learner_id": 1, "shard_index": 1}]}, "not a learner id of this run"),
    ({"members": [{"learner_id": 0, "shard_index": 0}, {"learner_id": 0, "shard_index": 0}]}, "listed twice"),
    ({"members": [{"learner_id": 0, "shard_index": 0, "admin": True}]}, "unknown field 'admin'"),
    ({"members": [{"learner_id": 0, "shard_index": 0, "incarnation": "1"}]}, "incarnation"),
    ({"members": [{"learner_id": 0, "shard_index": 0, "left": 1}]}, "left"),
    ({"members": [{"learner_id": 0, "shard_index": 0, "stats": {"tokens": -5}}]}, "stats"),
    ({"members": [{"learner_id": 0, "shard_index": 0, "carried": {"bogus": 1}}]}, "carried"),
    ({"members": ["0"]}, "not a record"),
])
def test_a_state_file_no_coordinator_writes_is_refused_naming_it_and_what_is_wrong(tmp_path, fields, words):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_state_doc(**fields)))
    with pytest.raises(ValueError) as refused:  # StateFileError
        Membership(RunConfig(learners=1), path)
    assert str(path) in str(refused.value) and words in str(refused.value), refused.value


def test_a_state_file_from_before_the_seal_is_still_read_and_is_sealed_when_saved_again(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_state_doc()))
    members = Membership(RunConfig(learners=1), path)
    assert (members.state, members.elapsed_before, members.outer_shards) == (coordinator_pb2.RUN_STATE_RUNNING, 12.5, ["127.0.0.1:9"])
    assert members.members[0].stats == {"tokens": 64} and members.members[0].incarnation == 1
    members.save()
    saved = json.loads(path.read_text())
    assert "sealed_sha256" in saved
    assert Membership(RunConfig(learners=1), path).members[0].instance_token == "t"
