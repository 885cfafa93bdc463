"""A delta refused as stale is an answer for good: the learner trained it, the outer
optimizer drops it by design, and a restarted learner must resume its shard *past* it, not
read its latest acknowledged batches again. So the outer optimizer counts the tokens of
stale refusals beside the accepted ones (``resume_tokens`` in its status) and the last
sequence it refused as stale (a restarted learner numbers its deltas past both).

Before, the status carried accepted tokens only: for each window refused, a restarted
learner resumed one window before the end of its acknowledged work and trained those
acknowledged batches a second time.

In process on a real ``OuterState`` (its own journal and checkpoints), and once over gRPC on
a real outer optimizer process."""

from __future__ import annotations

import errno
import os

import grpc
import pytest
from outer_helpers import WINDOW_TOKENS, Remote, make_delta, push, serving_run, state_specs, tiny_config
from support import wait_until

from ddiloco.common.durable import StorageError
from ddiloco.common.errors import FailedPrecondition, InvalidArgument, Stale, Superseded
from ddiloco.outer.records import LearnerRecord
from ddiloco.outer.state import OuterState

OTHER_MERGES = 12  # learner 1's windows, one merge each: far past the staleness bound of learner 0's base


def _stale_setting(tmp_path):
    """Learner 0 has one window accepted and merged; learner 1 merged ``OTHER_MERGES`` since.
    Returns (state, base) where ``base`` is the version learner 0 last held: stale now."""
    state = OuterState(tiny_config(), tmp_path)
    push(state, 0, 1, seed=1)
    assert state.merge(0, force=True)
    base = state.fragment(0).version
    for seq in range(1, OTHER_MERGES + 1):
        push(state, 1, seq, seed=100 + seq)
        assert state.merge(0, force=True)
    return state, base


def _mine(state, learner_id: int = 0):
    return next(r for r in state.status().learners if r.learner_id == learner_id)


def _delta(state, seq: int, base: int):
    return make_delta(state_specs(state), state.config.run_id, 0, seq, base, seed=seq)


def test_a_stale_refusal_moves_the_resume_position_past_its_window_once(tmp_path):
    state, base = _stale_setting(tmp_path)
    header, payload = _delta(state, 2, base)

    with pytest.raises(Stale, match="stale"):
        state.accept(header, payload)
    mine = _mine(state)
    assert (mine.tokens_accepted, mine.resume_tokens) == (WINDOW_TOKENS, 2 * WINDOW_TOKENS)
    assert (mine.last_seq, mine.last_seq_refused_stale) == (1, 2)
    assert mine.answered_tokens == {0: 2 * WINDOW_TOKENS}

    # the same delta again (its first answer was lost), on the header path and in full:
    # answered the same, counted once
    with pytest.raises(Stale):
        state.check_header(header)
    with pytest.raises(Stale):
        state.accept(header, payload)
    assert _mine(state).resume_tokens == 2 * WINDOW_TOKENS

    # the next window, refused on its header alone, counts too; then a fresh one is accepted
    h3, _ = _delta(state, 3, base)
    with pytest.raises(Stale):
        state.check_header(h3)
    assert _mine(state).resume_tokens == 3 * WINDOW_TOKENS
    push(state, 0, 4, seed=4)
    mine = _mine(state)
    assert (mine.tokens_accepted, mine.resume_tokens, mine.last_seq, mine.last_seq_refused_stale) == (
        2 * WINDOW_TOKENS, 4 * WINDOW_TOKENS, 4, 3,
    )


def test_refusals_that_are_not_about_staleness_move_nothing(tmp_path):
    state, base = _stale_setting(tmp_path)
    before = _mine(state)

    # a base newer than the fragment: no learner can hold it, it is not trained work
    newer, newer_payload = _delta(state, 2, state.fragment(0).version + 5)
    with pytest.raises(FailedPrecondition, match="newer") as refused:
        state.accept(newer, newer_payload)
    assert not isinstance(refused.value, Stale)

    # a stale delta of a process that was replaced: its successor already read its position
    def replaced() -> None:
        raise Superseded("learner 0 incarnation 1 was replaced by incarnation 2")

    header, payload = _delta(state, 2, base)
    with pytest.raises(Superseded):
        state.accept(header, payload, fence=replaced)

    after = _mine(state)
    assert (after.resume_tokens, after.last_seq_refused_stale) == (before.resume_tokens, 0) == (WINDOW_TOKENS, 0)
    assert after.deltas_refused == before.deltas_refused + 2


def test_the_count_of_stale_refusals_survives_a_restart(tmp_path):
    state, base = _stale_setting(tmp_path)
    header, payload = _delta(state, 2, base)
    with pytest.raises(Stale):
        state.accept(header, payload)
    assert state.checkpoint() is not None
    del state  # the crash

    restarted = OuterState(tiny_config(), tmp_path)
    mine = _mine(restarted)
    assert (mine.tokens_accepted, mine.resume_tokens, mine.last_seq, mine.last_seq_refused_stale) == (
        WINDOW_TOKENS, 2 * WINDOW_TOKENS, 1, 2,
    )


@pytest.mark.parametrize("damage", ["no tensors", "unknown codec", "oversized"])
def test_a_header_both_stale_and_invalid_is_refused_as_invalid_and_moves_nothing(tmp_path, damage):
    """Its layout is checked before its staleness: a header no learner of this run could
    send is not trained work, so it must not move where its learner resumes. Before, it was
    answered "stale" and counted its claimed tokens."""
    state, base = _stale_setting(tmp_path)
    before = _mine(state)
    header, payload = _delta(state, 2, base)
    if damage == "no tensors":
        header.payload.ClearField("tensors")
    elif damage == "unknown codec":
        header.payload.codec = 77
    else:
        header.payload.payload_bytes = 1 << 40  # more than the fragment can encode to
    for path in (lambda: state.check_header(header), lambda: state.accept(header, payload)):
        with pytest.raises(InvalidArgument):
            path()
    after = _mine(state)
    assert (after.resume_tokens, after.last_seq_refused_stale) == (before.resume_tokens, 0)
    assert not list((tmp_path / "refusals").glob("*.json"))


def test_a_stale_refusal_answered_after_the_last_checkpoint_survives_a_crash(tmp_path):
    """Each refusal is recorded durably before it is answered: before, one answered after
    the last checkpoint was forgotten by a crash, and the learner then resumed one window
    early per such refusal (its last acknowledged batches trained twice)."""
    state, base = _stale_setting(tmp_path)
    assert state.checkpoint() is not None
    header, payload = _delta(state, 2, base)
    with pytest.raises(Stale):
        state.accept(header, payload)
    h3, _ = _delta(state, 3, base)
    with pytest.raises(Stale):
        state.check_header(h3)  # refused on its header alone: recorded too
    del state  # the crash, no checkpoint since the refusals

    restarted = OuterState(tiny_config(), tmp_path)
    mine = _mine(restarted)
    assert (mine.tokens_accepted, mine.resume_tokens, mine.last_seq, mine.last_seq_refused_stale) == (
        WINDOW_TOKENS, 3 * WINDOW_TOKENS, 1, 3,
    )
    with pytest.raises(Stale):  # a retry of an answered refusal, after the restart: counted once
        restarted.check_header(h3)
    assert _mine(restarted).resume_tokens == 3 * WINDOW_TOKENS


def test_refusal_records_a_checkpoint_covers_are_counted_once_and_pruned(tmp_path):
    state, base = _stale_setting(tmp_path)
    for seq in (2, 3):
        with pytest.raises(Stale):
            state.check_header(_delta(state, seq, base)[0])
        assert state.checkpoint() is not None
    refusals = tmp_path / "refusals"
    # the first refusal is in both kept checkpoints; the second one's record stays, since a
    # fall back to the older checkpoint would need it
    assert sorted(p.name for p in refusals.glob("*.json")) == ["00000-0000000003.json"]
    del state

    restarted = OuterState(tiny_config(), tmp_path)
    assert (_mine(restarted).resume_tokens, _mine(restarted).last_seq_refused_stale) == (3 * WINDOW_TOKENS, 3)


def test_an_unusable_refusal_record_is_skipped_with_an_error_and_costs_only_its_window(tmp_path, caplog):
    state, base = _stale_setting(tmp_path)
    assert state.checkpoint() is not None
    for seq in (2, 3):
        with pytest.raises(Stale):
            state.check_header(_delta(state, seq, base)[0])
    del state
    damaged = tmp_path / "refusals" / "00000-0000000003.json"
    damaged.write_text(damaged.read_text().replace('"tokens": ', '"tokens": 1'))  # the seal no longer holds

    restarted = OuterState(tiny_config(), tmp_path)  # starts: no acknowledged delta is at stake
    assert (_mine(restarted).resume_tokens, _mine(restarted).last_seq_refused_stale) == (2 * WINDOW_TOKENS, 2)
    assert any("00000-0000000003.json" in r.getMessage() and "SHA-256" in r.getMessage() for r in caplog.records)


def test_a_refusal_whose_record_cannot_be_written_is_still_answered_and_counted(tmp_path, caplog):
    state, base = _stale_setting(tmp_path)

    def enospc(path, obj):
        raise StorageError(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    state.refusal_journal.writer = enospc
    with pytest.raises(Stale):
        state.check_header(_delta(state, 2, base)[0])
    assert _mine(state).resume_tokens == 2 * WINDOW_TOKENS  # in memory, and at the next checkpoint
    assert any("not recorded durably" in r.getMessage() and "ENOSPC" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "refusals").glob("*.json"))


def test_with_fragments_the_position_is_the_work_every_fragment_has_answered():
    rec = LearnerRecord()
    rec.count_accepted(0, 1, 100)
    rec.count_accepted(1, 2, 100)
    assert rec.count_refused_stale(0, 3, 100)
    assert not rec.count_refused_stale(0, 3, 100), "a retry of the same sequence"
    assert not rec.count_refused_stale(1, 2, 100), "a sequence already accepted"
    assert rec.resume_tokens([0, 1]) == 100  # fragment 1 has not answered its second window yet
    assert rec.count_refused_stale(1, 4, 100)
    assert rec.resume_tokens([0, 1]) == 200
    assert rec.resume_tokens([0]) == 200 and rec.work(rec.tokens_accepted, [0, 1]) == 100
    # where each fragment's work ends: accepted and refused together, per fragment
    assert rec.answered([0, 1]) == {0: 200, 1: 200} and rec.answered([0]) == {0: 200}
    # a record saved before these fields existed loads with none counted
    old = rec.to_json()
    for key in ("last_seq_refused_stale", "tokens_refused_stale"):
        del old[key]
    assert LearnerRecord.from_json(old).resume_tokens([0, 1]) == 100
    assert LearnerRecord.from_json(rec.to_json()) == rec


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving_run(tmp_path_factory.mktemp("stale-resume"), "stale-resume")


def test_a_real_outer_optimizer_answers_where_a_learner_refused_as_stale_resumes(served):
    cluster, ids = served
    me, other = (Remote(cluster.outer_address, "stale-resume", i) for i in ids)
    me.push(1)
    base = me.global_state()[0]
    for seq in range(1, OTHER_MERGES + 1):
        version = other.global_state()[0]
        other.push(seq, seed=seq, base=version)
        wait_until(lambda: other.global_state()[0] > version, 60, f"learner {ids[1]}'s window {seq} merged")
    with pytest.raises(grpc.RpcError) as refused:
        me.push(2, base=base)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in refused.value.details()
    mine = next(r for r in me.status().learners if r.learner_id == ids[0])
    assert (mine.tokens_accepted, mine.resume_tokens, mine.last_seq, mine.last_seq_refused_stale) == (
        WINDOW_TOKENS, 2 * WINDOW_TOKENS, 1, 2,
    )
