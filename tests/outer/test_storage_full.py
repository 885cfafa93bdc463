"""A full disk never stops the outer optimizer or loses work.

* A journal write that fails refuses the delta with RESOURCE_EXHAUSTED naming the path and
  errno (learners retry it), changes nothing (not acknowledged, sequence not consumed), and
  the same delta is accepted once there is space again.
* A checkpoint write that fails is logged and reported (``checkpoint_failed``), merges go
  on (the journal and merge records cover them), and it is retried until it succeeds.

The process-level tests use a real full disk: a tiny tmpfs mounted over the journal or
checkpoint folder, which needs root; without root they are skipped, and the in-process
tests (an injected writer raising OSError(ENOSPC)) still cover the logic.
"""

from __future__ import annotations

import errno
import json
import os

import grpc
import pytest

from outer_helpers import Remote, Tmpfs, fingerprint, push, register, tiny_config

from ddiloco.common.durable import StorageError
from ddiloco.outer.state import OuterState


def enospc(path, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---------------------------------------------------------------- in process, injected
def test_a_failed_journal_write_changes_nothing_and_the_same_delta_is_accepted_later(tmp_path):
    state = OuterState(tiny_config(), tmp_path)
    push(state, 0, 1, seed=0)
    assert state.merge(0, force=True)
    before = fingerprint(state)
    real_writer = state.journal.writer

    state.journal.writer = enospc
    with pytest.raises(StorageError) as info:
        push(state, 0, 2, seed=1)
    assert info.value.errno == errno.ENOSPC
    assert fingerprint(state) == before, "a delta that was not journaled changed the state"
    assert list((tmp_path / "journal").glob(".*")) == []

    state.journal.writer = real_writer
    push(state, 0, 2, seed=1)  # the same sequence: it was not consumed
    assert state.status().learners[0].last_seq == 2


def test_an_entry_in_place_whose_folder_could_not_be_synced_is_not_left_for_a_restart(tmp_path):
    """The rename landed but the folder's fsync failed (an I/O error; injected: no device here
    fails that way on demand): the delta is refused as not journaled, so its entry must not
    stay for a restart to find and merge, which would take its sequence number from the
    learner's retry of it (answered ALREADY_EXISTS for a delta it was told was refused)."""
    from ddiloco.common import durable

    state = OuterState(tiny_config(), tmp_path)
    before = fingerprint(state)

    def written_then_folder_sync_fails(path, data):
        durable.write_bytes(path, data)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    state.journal.writer = written_then_folder_sync_fails
    with pytest.raises(StorageError) as info:
        push(state, 0, 1, seed=0)
    assert info.value.errno == errno.EIO
    assert list((tmp_path / "journal").iterdir()) == []
    assert fingerprint(OuterState(tiny_config(), tmp_path)) == before  # the restart finds nothing


def test_durable_write_leaves_no_temporary_when_the_disk_is_full(tmp_path, monkeypatch):
    from ddiloco.common import durable

    def full_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durable.os, "fsync", full_fsync)
    with pytest.raises(StorageError, match=r"cannot write .*entry.*Errno 28 ENOSPC"):
        durable.write_bytes(tmp_path / "entry", b"x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_checkpoint_is_reported_merging_goes_on_and_it_is_retried(tmp_path):
    cfg = tiny_config(checkpoint_every=2)
    state = OuterState(cfg, tmp_path)
    full = {"on": True}

    def hook(step):
        if full["on"] and step == "tensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    state.checkpoints.hook = hook
    seq = {0: 0, 1: 0}
    for i in range(5):  # checkpoints fall due at merges 2 and 4 and fail
        lid = i % 2
        seq[lid] += 1
        push(state, lid, seq[lid], seed=i)
        assert state.merge(0, force=True)
    assert state.version == 5
    assert state.checkpoints.failures >= 2
    assert "Errno 28" in state.checkpoints.last_error
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [], "a failed checkpoint left files"
    before = fingerprint(state)

    full["on"] = False
    assert state.checkpoint() is not None  # what the service's retry loop or the next merge does
    assert state.checkpoints.last_error is None
    assert fingerprint(OuterState(cfg, tmp_path)) == before


# ---------------------------------------------------------------- real processes, real full disk
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a real full disk needs a tmpfs mount, which needs root")


@pytest.fixture
def outer_on(tmp_path):
    """Start coordinator + outer optimizer with a tiny tmpfs over one of the outer's folders."""
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    mounts, clusters = [], []

    def start(folder: str, size: str, flags: list[str]):
        cluster = Cluster(tmp_path / "run")
        clusters.append(cluster)
        mounts.append(Tmpfs(tmp_path / "run" / "outer" / folder, size))
        cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", "disk", *flags])
        proc = cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        ids = register(cluster.coordinator_address, 2)
        return cluster, proc, mounts[-1], [Remote(cluster.outer_address, "disk", i) for i in ids]

    yield start
    for c in clusters:
        c.stop_all(grace=10)
    for m in mounts:
        m.unmount()


@needs_root
def test_full_disk_on_the_journal_answers_resource_exhausted_and_the_retry_is_accepted(outer_on):
    cluster, proc, disk, (a, b) = outer_on("journal", "16k", [])
    before = a.global_state()
    status = a.status()
    with pytest.raises(grpc.RpcError) as info:
        a.push(seq=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "Errno 28" in info.value.details() and "journal" in info.value.details()
    assert a.global_state() == before
    after = a.status()
    assert (after.version, after.pending_deltas, after.bytes_received) == (status.version, status.pending_deltas, status.bytes_received)
    mine = [r for r in after.learners if r.learner_id == a.learner_id]
    assert all(r.last_seq == 0 and r.deltas_accepted == 0 for r in mine), "the sequence was consumed"
    assert proc.returncode() is None, "the outer optimizer stopped on a full disk"

    disk.resize("64m")  # space is back: the learner's retry of the same sequence goes through
    assert a.push(seq=1).global_version == before[0]
    assert [f for f in os.listdir(disk.path) if f.startswith(".")] == []


@needs_root
def test_full_disk_on_checkpoints_keeps_merging_and_the_checkpoint_is_retried(outer_on):
    from support import wait_until

    from ddiloco.common.metrics import read_events

    cluster, proc, disk, (a, b) = outer_on("checkpoints", "32k", ["--checkpoint-every", "1"])
    for seq in (1, 2, 3):
        v = a.global_state()[0]
        a.push(seq=seq, seed=seq, base=v)
        b.push(seq=seq, seed=10 + seq, base=v)
        wait_until(lambda: a.global_state()[0] > v, 60, f"merge {seq}")
    events = read_events(cluster.out / "metrics.jsonl")
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert failed and "Errno 28" in failed[0]["error"]
    assert proc.returncode() is None, "a failed checkpoint stopped the outer optimizer"
    assert not [p for p in os.listdir(disk.path) if not p.startswith(".")], "a failed checkpoint left a folder"

    disk.resize("64m")
    wait_until(
        lambda: any(e["event"] == "checkpoint_recovered" for e in read_events(cluster.out / "metrics.jsonl")),
        30, "the checkpoint retry",
    )
    # the retried checkpoint holds the live version
    version = a.global_state()[0]
    latest = (disk.path / "LATEST").read_text().strip()
    assert json.loads((disk.path / latest / "state.json").read_text())["version"] == version


def test_a_merge_whose_record_cannot_be_written_applies_nothing_and_runs_once_the_disk_has_room(tmp_path):
    """The merge record is durable before a merge is applied; when it cannot be written the
    deltas stay pending (acknowledged, journaled) and the merge runs once there is room."""
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    push(state, 1, 1, seed=1)
    before = fingerprint(state)
    real = state.merge_journal.writer

    def full(path, data):
        raise StorageError(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    state.merge_journal.writer = full
    with pytest.raises(StorageError):
        state.merge(0, force=True)
    assert fingerprint(state) == before, "a merge without its durable record changed the model"
    assert state.pending_count() == 2
    state.merge_journal.writer = real
    assert state.merge(0, force=True)
    assert state.version == 1 and state.pending_count() == 0
    after = fingerprint(state)
    assert fingerprint(OuterState(cfg, tmp_path)) == after, "the restart does not rebuild the merged state"


@needs_root
def test_a_final_merge_on_a_full_disk_is_refused_as_resource_exhausted_and_done_once_there_is_room(tmp_path):
    """Finalize's merge cannot write its record (the merge records' disk is full): Finalize
    answers RESOURCE_EXHAUSTED naming the errno, as a push does for a full journal (it used
    to be UNKNOWN: an exception out of the handler), merges nothing and keeps serving. The
    coordinator asks again; once there is room the final merge holds the pending delta and
    the run finishes."""
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.common.metrics import read_events
    from ddiloco.launcher.processes import Cluster
    from ddiloco.v1 import outer_pb2

    cluster = Cluster(tmp_path / "run")
    disk = Tmpfs(tmp_path / "run" / "outer" / "merges", "64k")
    try:
        # a short budget, and leases that lapse fast: the learner ids below never heartbeat,
        # so the run drains 6 s after they join and the coordinator finalizes it
        cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "6", "--lease-timeout", "2", "--run-id", "fin-full"])
        proc = cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        fd = os.open(disk.path / "filler", os.O_WRONLY | os.O_CREAT)  # no room left for any merge record
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        a, _ = (Remote(cluster.outer_address, "fin-full", i) for i in register(cluster.coordinator_address, 2))
        a.push(seq=1)  # journaled (another disk); its merge cannot be recorded

        def finalize_answer() -> grpc.RpcError | None:
            try:
                a.stub.Finalize(outer_pb2.FinalizeRequest(), timeout=30)
            except grpc.RpcError as exc:
                return None if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else exc  # running still
            raise AssertionError("Finalize answered although no merge record can be written")

        refused = wait_until(finalize_answer, 60, "the run to drain")
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (refused.code(), refused.details())
        assert "Errno 28" in refused.details() and "merges" in refused.details(), refused.details()
        status = a.status()
        assert (status.version, status.pending_deltas) == (0, 1)
        assert proc.returncode() is None and not (cluster.out / "report.json").exists()

        (disk.path / "filler").unlink()  # room again: the coordinator's next Finalize merges
        # the event, not report.json: the coordinator writes the report first
        finished = wait_until(
            lambda: [e for e in read_events(cluster.out / "metrics.jsonl") if e["event"] == "finished"], 60,
            "the coordinator to finalize the run",
        )
        assert [e["outer_steps"] for e in finished] == [1]
        assert (cluster.out / "report.json").exists()
    finally:
        cluster.stop_all(grace=10)
        disk.unmount()
