"""A delta refused after it was journaled (its process replaced while it streamed) has its
journal entry removed durably: the folder is fsynced after the unlink. Without the fsync a
power cut could bring the entry back, and the restart would merge a delta never
acknowledged, whose work the learner's successor trains again.

A power cut cannot happen in a test: the fsync is observed instead (``fsync_dir`` wrapped to
record the folder and whether the entry was already gone when it ran)."""

from __future__ import annotations

import pytest
from outer_helpers import make_delta, state_specs, tiny_config

from ddiloco.common import durable
from ddiloco.common.errors import Superseded
from ddiloco.outer.state import OuterState


def _replaced() -> None:
    raise Superseded("learner 0 incarnation 1 was replaced by incarnation 2")


def test_the_entry_of_a_delta_refused_at_commit_is_unlinked_then_its_folder_synced(tmp_path, monkeypatch):
    state = OuterState(tiny_config(), tmp_path)
    header, payload = make_delta(state_specs(state), state.config.run_id, 0, 1, 0, seed=1)
    entry = state.journal.path_for(0, 1)
    synced = []
    real = durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_dir", lambda path: (synced.append((path, entry.exists())), real(path)))

    with pytest.raises(Superseded):
        state.accept(header, payload, fence=_replaced)

    assert not entry.exists()
    # the write's own fsync (entry in place), then the discard's (entry gone)
    assert synced[-1] == (state.journal.folder, False)
    assert [e for e in synced if e[1]] == [(state.journal.folder, True)]
    assert list(state.journal.load(lambda learner, seq: False)) == []


def test_a_folder_that_cannot_be_synced_leaves_the_refusal_standing(tmp_path, monkeypatch, caplog):
    state = OuterState(tiny_config(), tmp_path)
    header, payload = make_delta(state_specs(state), state.config.run_id, 0, 1, 0, seed=1)
    real = durable.fsync_dir
    calls = []

    def failing_second(path):
        calls.append(path)
        if len(calls) > 1:  # the write's own sync succeeds, the discard's fails
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(durable, "fsync_dir", failing_second)
    with pytest.raises(Superseded):
        state.accept(header, payload, fence=_replaced)
    assert "may survive a power cut" in caplog.text
    assert not state.journal.path_for(0, 1).exists()
