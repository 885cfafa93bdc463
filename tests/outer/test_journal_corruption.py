"""An unreadable journal entry is never skipped: it holds an acknowledged delta (entries are
written atomically, so a crash cannot tear one), and the outer optimizer refuses to start
with an error naming the file, the learner and sequence, and what is wrong, unless the
checkpoint already covers that delta. The same for an entry that reads back but cannot be
the delta it was (its header is not covered by the digest), and for a merge record that
names a delta the journal lacks."""

from __future__ import annotations

import os
import signal

import pytest

from outer_helpers import Remote, fingerprint, push, register, tiny_config

from ddiloco.outer.journal import JournalCorrupt, MergeRecordCorrupt, encode_entry, read_entry
from ddiloco.outer.state import OuterState


def _damage(path, how: str) -> None:
    blob = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    elif how == "flipped-bit":
        blob[-5] ^= 0x01
        path.write_bytes(bytes(blob))
    elif how == "garbage-header":
        path.write_bytes(b"\xff\xff\xff\x7f" + bytes(blob[4:]))
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "flipped-bit", "garbage-header", "empty"])
def test_an_unreadable_acknowledged_delta_stops_the_restart_naming_the_file(tmp_path, how):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)  # acknowledged, pending
    entry = tmp_path / "journal" / "00000-0000000001.delta"
    assert entry.exists()
    _damage(entry, how)
    with pytest.raises(JournalCorrupt) as info:
        OuterState(cfg, tmp_path)
    assert str(entry) in str(info.value)
    assert "(learner 0, sequence 1)" in str(info.value)
    assert (info.value.learner_id, info.value.seq) == (0, 1)
    assert entry.exists(), "the damaged entry must be left for the operator"


def _rewrite_header(path, change) -> None:
    """Change the entry's header and write it back whole: it still parses, and its payload
    still matches the payload digest, as a header damaged on disk can."""
    header, payload = read_entry(path)
    change(header)
    path.write_bytes(encode_entry(header, payload))


def _other_fragment(h):
    h.fragment = 5


def _other_shape(h):
    h.payload.tensors[0].shape[0] += 1


def _no_steps(h):
    h.inner_steps = 0


def _more_steps_than_a_delta_holds(h):
    h.inner_steps = 10**6


def _tokens_of_thousands_of_rounds(h):
    h.tokens = 2**40  # would take a merge's whole weight and a step of that many rounds


def _negative_compute_time(h):
    h.compute_seconds = -1.0


@pytest.mark.parametrize(
    "change, reason",
    [
        (_other_fragment, "fragment 5 does not exist; this run has 1"),
        (_other_shape, "has shape"),
        (_no_steps, "inner_steps=0"),
        (_more_steps_than_a_delta_holds, "inner_steps=1000000 is outside"),
        (_tokens_of_thousands_of_rounds, f"tokens={2**40} is not inner_steps"),
        (_negative_compute_time, "compute_seconds=-1.0"),
    ],
)
def test_a_journaled_delta_whose_header_no_longer_fits_the_run_stops_the_restart(tmp_path, change, reason):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    push(state, 1, 1, seed=1)
    entry = tmp_path / "journal" / "00001-0000000001.delta"
    _rewrite_header(entry, change)
    with pytest.raises(JournalCorrupt) as info:
        OuterState(cfg, tmp_path)
    message = str(info.value)
    assert f"journal entry {entry} (learner 1, sequence 1) is unreadable" in message
    assert reason in message and "not a delta of this run" in message
    assert entry.exists()


def test_a_journaled_delta_a_merge_record_names_is_checked_too(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    assert state.merge(0, force=True)  # recorded in merges/, no checkpoint yet
    entry = tmp_path / "journal" / "00000-0000000001.delta"
    _rewrite_header(entry, _other_shape)
    with pytest.raises(JournalCorrupt, match="has shape") as info:
        OuterState(cfg, tmp_path)
    assert str(entry) in str(info.value)


def test_a_merge_record_naming_a_missing_delta_stops_the_restart(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    push(state, 1, 1, seed=1)
    assert state.merge(0, force=True)
    (tmp_path / "journal" / "00001-0000000001.delta").unlink()
    with pytest.raises(MergeRecordCorrupt) as info:
        OuterState(cfg, tmp_path)
    record = tmp_path / "merges" / "0000000001.json"
    assert str(record) in str(info.value) and "(learner 1, sequence 1)" in str(info.value)


def test_a_merge_record_damaged_but_still_parsing_stops_the_restart(tmp_path):
    """A digit of a weight changed on disk: the replay would apply a merge that never
    happened, and every version after it would differ from the one learners were served.
    The record's own SHA-256 notices, and the restart stops naming it."""
    import json

    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    push(state, 1, 1, seed=1)
    assert state.merge(0, force=True)
    path = tmp_path / "merges" / "0000000001.json"
    record = json.loads(path.read_text())
    record["weights"][0] += 0.125
    path.write_text(json.dumps(record))
    with pytest.raises(MergeRecordCorrupt, match="does not match its own SHA-256") as info:
        OuterState(cfg, tmp_path)
    assert str(path) in str(info.value)


def test_an_unreadable_entry_the_checkpoint_covers_does_not_stop_the_restart(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=0)
    assert state.merge(0, force=True)
    assert state.checkpoint() is not None  # covers delta (0, 1); its entry stays for the fallback
    push(state, 1, 1, seed=1)  # pending, not covered
    before = fingerprint(state)
    _damage(tmp_path / "journal" / "00000-0000000001.delta", "truncated")
    assert fingerprint(OuterState(cfg, tmp_path)) == before


@pytest.mark.parametrize("damage", ["flipped-bit", "header-rewritten"])
def test_the_outer_process_exits_non_zero_on_a_damaged_journal(tmp_path, damage):
    """Over real processes: SIGKILL the outer optimizer with an acknowledged delta in its
    journal, damage the entry (its payload, or its header so that it still reads back),
    start it again: it exits non-zero and its log names the file, learner and sequence."""
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path / "run")
    try:
        cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", "journal"])
        outer = cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        a = Remote(cluster.outer_address, "journal", register(cluster.coordinator_address, 1)[0])
        a.push(seq=1)
        entry = next((tmp_path / "run" / "outer" / "journal").glob("*.delta"))
        os.killpg(outer.popen.pid, signal.SIGKILL)
        outer.popen.wait(10)
        if damage == "flipped-bit":
            _damage(entry, damage)
        else:
            _rewrite_header(entry, _other_shape)

        again = cluster.start_outer()
        assert again.popen.wait(120) != 0
        log = again.log_path.read_text()
        assert "cannot start" in log and str(entry) in log
        assert f"(learner {a.learner_id}, sequence 1)" in log
        if damage == "header-rewritten":
            assert "has shape" in log
        assert "Traceback" not in log, "a damaged journal is a precise one-line error, not a traceback"
    finally:
        cluster.stop_all(grace=10)
