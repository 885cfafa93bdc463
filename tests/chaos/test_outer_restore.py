"""The outer optimizer's state survives a crash at any point between two checkpoints: a new
``OuterState`` on the same folder (what a restarted process builds) holds bit for bit the
parameters, momentum and versions the dead one had published, applies no delta twice, and
still holds every acknowledged delta that was not merged yet.

These run ``OuterState`` in-process on a real folder (the crash is the object being dropped
without a clean shutdown, exactly what SIGKILL leaves on disk); the process-level tests in
this folder SIGKILL real services."""

from __future__ import annotations

import json

import numpy as np
import torch

from ddiloco.common import codec
from ddiloco.common.config import MODEL_PRESETS, RunConfig
from ddiloco.common.wire import payload_info
from ddiloco.outer.state import OuterState
from ddiloco.v1 import outer_pb2


def _config(checkpoint_every: int) -> RunConfig:
    cfg = RunConfig(run_id="restore", learners=2)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.learner.inner_steps, cfg.learner.batch_size = 5, 4
    cfg.outer.checkpoint_every = checkpoint_every
    return cfg


def _push(state: OuterState, learner: int, seq: int, base: int, seed: int, more_queued: bool = False) -> None:
    rng = np.random.default_rng(seed)
    # well inside what H AdamW steps can move a coordinate (outer/admission.py)
    arrays = [(n, (rng.normal(size=p.shape) * 1e-3).astype(np.float32)) for n, p in zip(state.names, state.params)]
    enc = codec.encode(arrays, "int8", 64)
    header = outer_pb2.DeltaHeader(
        run_id="restore", learner_id=learner, base_version=base, tokens=640, inner_steps=5, seq=seq, payload=payload_info(enc),
        more_queued=more_queued,
    )
    state.accept(header, enc.payload)


def _fingerprint(state: OuterState) -> tuple:
    momentum = [b.clone() for f in state.fragments for b in (f.optimizer.buffers or [])]
    return state.version, [p.clone() for p in state.params], momentum


def test_restart_rebuilds_every_published_version_and_applies_nothing_twice(tmp_path):
    cfg = _config(checkpoint_every=3)
    state = OuterState(cfg, tmp_path)
    seq = {0: 0, 1: 0}
    for step in range(8):  # 8 merges: a checkpoint at 3 and 6, then 2 merges only in the merge journal
        lid = step % 2
        seq[lid] += 1
        _push(state, lid, seq[lid], state.version, seed=step)
        assert state.merge(0)
    _push(state, 0, seq[0] + 1, state.version, seed=99)  # acknowledged, not merged
    before = _fingerprint(state)
    assert before[0] == 8

    restarted = OuterState(cfg, tmp_path)  # the crash: no checkpoint after merge 8
    after = _fingerprint(restarted)
    assert after[0] == 8, "the version after restart is the one learners had seen"
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])), "parameters rebuilt bit for bit"
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2])), "momentum rebuilt bit for bit"
    pending = [(p.learner_id, p.seq) for f in restarted.fragments for p in f.pending]
    assert pending == [(0, seq[0] + 1)], "only the unmerged acknowledged delta is pending again"
    # the sequence numbers a restarted learner resumes from
    assert restarted.learners[0].last_seq_accepted == seq[0] + 1
    assert restarted.learners[1].last_seq_accepted == seq[1]
    # the pending delta merges into version 9, never an already-used version
    assert restarted.merge(0) and restarted.version == 9


def test_a_delta_replayed_from_the_journal_is_pending_but_not_counted_as_re_sent(tmp_path):
    """The restart hold waits for what learners send after the restart (outer/decision.py):
    a delta acknowledged before the crash is merged, but does not stand for the work its
    learner trained during the outage."""
    cfg = _config(checkpoint_every=100)
    state = OuterState(cfg, tmp_path)
    _push(state, 0, 1, 0, seed=1)  # acknowledged and journaled, not merged
    assert state.resent_learners() == [{0}], "a delta accepted by this process counts"

    restarted = OuterState(cfg, tmp_path)
    assert restarted.pending_learners() == [{0}], "the acknowledged delta is pending again"
    assert restarted.resent_learners() == [set()], "but it was not re-sent"
    _push(restarted, 1, 1, 0, seed=2)
    _push(restarted, 0, 2, 0, seed=3)  # learner 0's work from the outage
    assert restarted.resent_learners() == [{0, 1}]
    assert restarted.merge(0) and restarted.version == 1
    assert restarted.pending_learners() == [set()], "the replayed delta merged with the re-sent ones"


def test_a_re_sent_delta_with_more_queued_behind_it_does_not_end_the_hold_for_its_learner(tmp_path):
    """A learner back from an outage sends its oldest window first, the rest of its backlog
    right after (``DeltaHeader.more_queued``): it counts as in once its last one is."""
    restarted = OuterState(_config(checkpoint_every=100), tmp_path)
    _push(restarted, 0, 1, 0, seed=1, more_queued=True)
    _push(restarted, 1, 1, 0, seed=2)
    assert restarted.resent_learners() == [{1}], "learner 0 said more follows"
    _push(restarted, 0, 2, 0, seed=3, more_queued=True)
    assert restarted.resent_learners() == [{1}]
    _push(restarted, 0, 3, 0, seed=4)  # its last queued upload
    assert restarted.resent_learners() == [{0, 1}]


def test_a_torn_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    cfg = _config(checkpoint_every=2)
    state = OuterState(cfg, tmp_path)
    for step in range(4):
        _push(state, 0, step + 1, state.version, seed=step)
        state.merge(0)
    root = tmp_path / "checkpoints"
    latest = (root / "LATEST").read_text()
    assert latest.startswith("v00000004-")  # version, then a generation: every write a new name
    # a checkpoint that died half-written: its folder is still the temporary one
    torn = root / ".v00000005-g000003.tmp"
    torn.mkdir()
    (torn / "global.safetensors").write_bytes(b"\x00" * 17)
    restarted = OuterState(cfg, tmp_path)
    assert restarted.version == 4
    assert not torn.exists(), "torn temporaries are removed at start"
    state_json = json.loads((root / latest / "state.json").read_text())
    assert state_json["version"] == 4 and state_json["pending"] == []


def _push_arrays(state: OuterState, learner: int, seq: int, arrays, steps: int, tokens: int) -> None:
    enc = codec.encode(arrays, "fp32")
    header = outer_pb2.DeltaHeader(
        run_id="restore", learner_id=learner, base_version=state.version, tokens=tokens, inner_steps=steps, seq=seq,
        payload=payload_info(enc),
    )
    state.accept(header, enc.payload)


def test_a_delta_coalesced_during_an_outage_moves_the_model_like_its_windows(tmp_path):
    """While the outer optimizer is down a learner coalesces k windows into one delta (k x H
    steps, k x the tokens, about k x the displacement). Applied, it must move the model about
    as far as its k windows merged one by one, not k^2 times one window (which blew the
    model up after an 8 s outage)."""
    cfg = _config(checkpoint_every=1000)
    rng = np.random.default_rng(0)
    window = [(n, (rng.normal(size=p.shape) * 1e-3).astype(np.float32)) for n, p in zip(
        OuterState(cfg, None).names, OuterState(cfg, None).params)]
    h, tokens = cfg.learner.inner_steps, cfg.learner.inner_steps * cfg.learner.batch_size * cfg.model.context
    k = cfg.learner.max_coalesce_windows  # the largest delta an uploader makes

    one_by_one = OuterState(cfg, None)
    start = [p.clone() for p in one_by_one.params]
    for i in range(k):
        _push_arrays(one_by_one, 0, i + 1, window, h, tokens)
        assert one_by_one.merge(0)
    moved_one_by_one = sum(float((p - s).norm() ** 2) for p, s in zip(one_by_one.params, start)) ** 0.5

    coalesced = OuterState(cfg, None)
    _push_arrays(coalesced, 0, 1, [(n, a * k) for n, a in window], k * h, k * tokens)
    assert coalesced.merge(0)
    moved_coalesced = sum(float((p - s).norm() ** 2) for p, s in zip(coalesced.params, start)) ** 0.5
    assert moved_coalesced < 1.3 * moved_one_by_one, (moved_coalesced, moved_one_by_one)
