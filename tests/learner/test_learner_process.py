"""A learner process whose background thread fails does not train on silently: it logs the
cause, stops training, flushes its uploads, leaves the run with the reason and exits
non-zero, so that the orchestrator restarts it.

Real processes on real sockets: the coordinator and the learner are `python -m ddiloco`
processes; the outer optimizer is a fake on a real gRPC socket (tests/learner/outer_fake.py)
that serves the run's real initial parameters and then answers what the test scripts.
"""

from __future__ import annotations

import contextlib
import json
import signal

import numpy as np
import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.fragments import partition
from ddiloco.common.model import build_model
from ddiloco.common.rpc import channel
from ddiloco.launcher.processes import Cluster
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from outer_fake import CORRUPT, FakeOuter
from support import TINY_RUN


def _events(cluster: Cluster, kind: str) -> list[dict]:
    path = cluster.out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture
def run(tmp_path):
    """A coordinator process, and a fake outer optimizer registered with it."""
    with _running(tmp_path) as running:
        yield running


@contextlib.contextmanager
def _running(tmp_path, flags=()):
    cluster = Cluster(tmp_path)
    try:
        cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", *flags])
        with _fake_outer(cluster) as fake:
            try:
                yield cluster, fake
            finally:  # while the fake still answers: learners flush to it as they stop
                cluster.stop_all(grace=5)
    finally:  # a failing test or set-up too: no process outlives it (a second stop is a no-op)
        cluster.stop_all(grace=5)


@contextlib.contextmanager
def _fake_outer(cluster: Cluster):
    with channel(cluster.coordinator_address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        resp = stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=10)
        config = RunConfig.from_json(resp.config_json)
        model = build_model(config.model, config.seed)
        named = [(n, p.detach().numpy().copy()) for n, p in model.named_parameters()]
        frags = partition([a.size for _, a in named], config.fragments)
        fake = FakeOuter([[named[i] for i in ids] for ids in frags], run_id=config.run_id)
        fake.merge_on_accept = True  # each accepted delta makes a new version, which the learner pulls
        with fake:
            stub.RegisterService(
                coordinator_pb2.RegisterServiceRequest(run_id=config.run_id, kind="outer", address=fake.address), timeout=10
            )
            yield fake


def _learner_exit(cluster: Cluster) -> tuple[int, str]:
    proc = cluster.start_learner(0, ["--device", "cpu"])
    code = proc.popen.wait(timeout=240)
    return code, proc.log_path.read_text()


def test_a_learner_whose_downloads_keep_arriving_corrupt_exits_non_zero_after_flushing(run):
    cluster, fake = run
    fake.pull_script.append(None)  # the start-up download is fine, every later one corrupt
    fake.pull_default = CORRUPT

    code, log = _learner_exit(cluster)

    assert code == 1, log[-3000:]
    assert "learner failing (puller): download of fragment 0 failed 6 times in a row" in log
    assert "checksum mismatch" in log
    stop = _events(cluster, "learner_stop")[-1]
    assert stop["failed"] and stop["flushed"], stop  # its trained windows went up before it left
    left = _events(cluster, "learner_left")[-1]
    assert left["reason"].startswith("failed: puller: download of fragment 0"), left
    windows = _events(cluster, "window")
    assert windows and len(_events(cluster, "upload_acked")) <= len(windows)
    assert sum(e["tokens"] for e in _events(cluster, "upload_acked")) == sum(a.tokens for a in fake.accepted)


def test_a_learner_whose_id_is_used_by_another_process_exits_non_zero_and_acknowledges_nothing_of_it(run):
    cluster, fake = run

    def another_process_took_this_sequence(fake, header):
        fake.last_seq[header.learner_id] = header.seq
        return None  # the server's rule then answers ALREADY_EXISTS

    fake.push_script.append(another_process_took_this_sequence)

    code, log = _learner_exit(cluster)

    assert code == 1, log[-3000:]
    assert "another process uploads as learner 0" in log
    assert _events(cluster, "upload_acked") == []
    assert fake.accepted == []
    assert _events(cluster, "learner_left")[-1]["reason"].startswith("failed: uploader: upload seq 1")
    np.testing.assert_equal(len(_events(cluster, "learner_failed")), 1)


def test_a_learner_whose_first_download_keeps_arriving_corrupt_exits_non_zero_with_the_cause(run):
    cluster, fake = run
    fake.pull_default = CORRUPT

    code, log = _learner_exit(cluster)

    assert code == 1, log[-3000:]
    assert "learner failing (setup): download of fragment 0 failed 6 times in a row" in log
    assert "Traceback" not in log


def test_a_learner_whose_emulated_step_outlasts_the_runs_lease_is_refused_before_it_joins(run):
    cluster, fake = run
    proc = cluster.start_learner(0, ["--device", "cpu", "--step-seconds", "30"])  # the run's lease: 10 s
    code = proc.popen.wait(timeout=240)
    log = proc.log_path.read_text()
    assert code != 0
    assert "learner cannot join this run: step seconds 30.0 must be below the run's lease (10.0 s)" in log
    assert _events(cluster, "learner_start") == [] and fake.accepted == []


def test_a_learner_cut_off_past_its_lease_and_replaced_stops_at_its_first_heartbeat_and_sends_nothing(tmp_path):
    """Frozen (SIGSTOP) past its lease, as a partitioned node's process is cut off, while a
    second process takes its id; thawed, its first heartbeat is refused as superseded, and
    it exits non-zero without another upload or a Leave (ddiloco.coordinator.membership).
    Frozen just after an acknowledgement, so its next window is H steps away, and its
    heartbeat, overdue, goes first."""
    from support import wait_until

    with _running(tmp_path, ["--lease-timeout", "3"]) as (cluster, fake):
        old = cluster.start_learner(0, ["--device", "cpu"], name="learner-0-old")
        wait_until(lambda: len(fake.accepted) >= 2, 120, "the first process's uploads")
        seen = len(fake.accepted)
        wait_until(lambda: len(fake.accepted) > seen, 60, "one more upload")
        old.popen.send_signal(signal.SIGSTOP)
        frozen_at = len(fake.accepted)

        def replaced():
            m = cluster.membership()
            return m is not None and any(x.learner_id == 0 and x.incarnation == 2 and x.alive for x in m.members)

        new = cluster.start_learner(0, ["--device", "cpu"], name="learner-0-new")
        wait_until(replaced, 120, "the second process to take learner id 0")
        wait_until(lambda: len(fake.accepted) > frozen_at, 120, "the second process's uploads")
        before = len(fake.accepted)
        seqs_before = [(a.learner_id, a.seq) for a in fake.accepted]

        old.popen.send_signal(signal.SIGCONT)
        code = old.popen.wait(timeout=60)
        log = old.log_path.read_text()
        assert code == 1, log[-3000:]
        assert "superseded: learner 0 is held by another process (incarnation 2)" in log
        superseded = [e for e in _events(cluster, "learner_superseded")]
        assert len(superseded) == 1
        # nothing from the old process after it was thawed: every delta accepted since is the
        # new process's, in its own unbroken sequence
        assert [(a.learner_id, a.seq) for a in fake.accepted[:before]] == seqs_before
        wait_until(lambda: len(fake.accepted) > before + 1, 120, "the second process to go on uploading")
        assert new.returncode() is None, new.log_path.read_text()[-3000:]
        assert "another process uploads as learner 0" not in new.log_path.read_text()
        m = cluster.membership()
        member = {x.learner_id: x for x in m.members}[0]
        assert member.alive and not member.left and member.incarnation == 2
        assert not [e for e in _events(cluster, "learner_left") if e.get("learner") == 0]


def test_a_learner_resumes_past_its_work_refused_as_stale_and_numbers_past_it(run):
    """A learner restarted after some of its deltas were refused as stale reads its shard
    from where its work answered for good ends (accepted, or refused: dropped by design, not
    trained again) and numbers its next delta past the last refused one, as the outer
    optimizer's status says (``resume_tokens``, ``last_seq_refused_stale``). Before, it
    resumed at its accepted tokens: for each refused window one window early, training
    acknowledged batches a second time."""
    from support import wait_until

    cluster, fake = run
    window = 5 * 4 * 64  # TINY_RUN: H = 5, batch 4, context 64
    fake.last_seq[0], fake.tokens_accepted[0] = 3, 3 * window  # seqs 1-3 accepted
    fake.refused_stale[0] = (5, 2 * window)  # seqs 4 and 5 refused as stale

    proc = cluster.start_learner(0, ["--device", "cpu"])
    wait_until(lambda: fake.accepted_seqs(0), 180, "the learner's first upload")
    start = _events(cluster, "learner_start")[-1]
    assert (start["batch_index"], start["first_seq"]) == (5 * 5, 6)
    assert fake.accepted_seqs(0)[0] == 6
    assert proc.returncode() is None, proc.log_path.read_text()[-3000:]


def test_with_fragments_a_learner_resumes_where_the_fragment_furthest_behind_ends_and_does_not_send_the_others_again(tmp_path):
    """Fragments end their windows at different steps, so a killed learner may have had one
    fragment's windows answered further than another's. It resumes at the fragment
    furthest behind, and a fragment further ahead ends its first window where its answered
    work ends and sends nothing of it (``window_skipped``). Before, that fragment sent those
    batches again: its count of answered tokens then ran past where its work ends, and a
    learner killed once more resumed past batches that fragment never received."""
    from support import wait_until

    with _running(tmp_path, flags=("--fragments", "2")) as (cluster, fake):
        step = 4 * 64  # TINY_RUN: batch 4, context 64; H = 5, so windows end at steps 2, 7, ... and 5, 10, ...
        fake.last_seq[0], fake.tokens_accepted[0] = 5, 10 * step
        fake.answered[0] = {0: 12 * step, 1: 10 * step}  # fragment 0 is answered two steps further

        proc = cluster.start_learner(0, ["--device", "cpu"])
        firsts = lambda: {a.fragment for a in fake.accepted if a.learner_id == 0} == {0, 1}  # noqa: E731
        wait_until(firsts, 180, "a window of each fragment sent")
        assert _events(cluster, "learner_start")[-1]["batch_index"] == 10
        skipped = _events(cluster, "window_skipped")
        assert [(e["fragment"], e["steps"], e["batch_index"]) for e in skipped] == [(0, 2, 12)]
        # fragment 0's windows from batch 12 on, fragment 1's from batch 10 on: whole windows,
        # no batch twice (uploads may coalesce windows queued behind a slow one)
        windows = _events(cluster, "window")
        assert [e["steps"] for e in windows if e["fragment"] == 0][:1] == [5]
        assert [e["steps"] for e in windows if e["fragment"] == 1][:1] == [5]
        sent = [a for a in fake.accepted if a.learner_id == 0]
        assert all(a.tokens == a.inner_steps * step for a in sent)
        assert fake.accepted[0].seq == 6
        assert proc.returncode() is None, proc.log_path.read_text()[-3000:]
