"""An unreadable journal entry is never skipped: it holds an acknowledged delta (entries are
written atomically, so a crash cannot tear one), and the outer optimizer refuses to start
with an error naming the file, unless the checkpoint already covers that delta."""

from __future__ import annotations

import os
import signal

import pytest

from outer_helpers import Remote, fingerprint, push, register, tiny_config

from ddiloco.outer.journal import JournalCorrupt
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
    assert entry.exists(), "the damaged entry must be left for the operator"


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


def test_the_outer_process_exits_non_zero_on_a_damaged_journal(tmp_path):
    """Over real processes: SIGKILL the outer optimizer with an acknowledged delta in its
    journal, damage the entry, start it again: it exits non-zero and its log names the file."""
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
        _damage(entry, "flipped-bit")

        again = cluster.start_outer()
        assert again.popen.wait(120) != 0
        log = again.log_path.read_text()
        assert "cannot start" in log and str(entry) in log
        assert "Traceback" not in log, "a damaged journal is a precise one-line error, not a traceback"
    finally:
        cluster.stop_all(grace=10)
