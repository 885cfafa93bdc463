"""The outer optimizer's records (``outer/records.py``): the staleness clock of a fragment,
the per-learner counters, and their checkpoint form (which old checkpoints must still load)."""

from __future__ import annotations

import pytest

from ddiloco.common import errors, merge
from ddiloco.outer import admission
from ddiloco.outer.records import MAX_TRACKED_VERSIONS, Fragment, LearnerRecord


def _fragment() -> Fragment:
    return Fragment(0, [0, 1], merge.WorkClockNesterov())


def test_a_fragment_measures_staleness_as_other_learners_work_since_the_base():
    frag = _fragment()
    frag.tokens_merged = 3000
    frag.publish_version({7: 1000})  # version 1: 3,000 tokens merged, 1,000 of them learner 7's
    frag.tokens_merged = 6000
    frag.publish_version({7: 2000})
    # since version 1: 3,000 more tokens, 1,000 of them learner 7's
    assert frag.version == 2
    assert frag.rounds_behind(1, 7, own_now=2000, round_tokens=1000) == pytest.approx(2.0)
    assert frag.rounds_behind(1, 8, own_now=0, round_tokens=1000) == pytest.approx(3.0)


def test_a_fragment_forgets_versions_no_delta_could_still_be_accepted_on():
    frag = _fragment()
    for step in range(1, 8):
        frag.tokens_merged = step * 1000
        frag.publish_version({})
    frag.prune_versions(max_staleness_rounds=2, round_tokens=1000)
    # kept: merged at most (2 + 1) rounds ago, and always the current version
    assert sorted(frag.tokens_at_version) == [4, 5, 6, 7]
    assert sorted(frag.own_at_version) == [4, 5, 6, 7]
    assert not frag.tracks(3) and frag.tracks(4)


def test_a_version_stays_while_what_followed_it_is_mostly_one_learners_own_work():
    """Admission counts only *other* learners' work behind a delta's base, so a version is
    forgotten only when every learner would find more than the bound behind it. Pruned by
    the total, a learner's catch-up merge of its own backlog dropped the version its next
    delta was based on, refused as "no longer tracked" with little of others' work behind."""
    frag = _fragment()
    frag.tokens_merged = 1000
    frag.publish_version({7: 500, 8: 500})  # version 1
    frag.tokens_merged = 10_000
    frag.publish_version({7: 9_500, 8: 500})  # version 2: learner 7's backlog, 9 rounds of it
    frag.prune_versions(max_staleness_rounds=2, round_tokens=1000)
    assert frag.tracks(1)  # learner 7's next delta on it has no others' work behind it
    assert admission.check_staleness(frag, 1, 7, 9_500, round_tokens=1000, max_rounds=2) == 1.0
    with pytest.raises(errors.FailedPrecondition, match="9.00 rounds of other learners' work"):
        admission.check_staleness(frag, 1, 8, 500, round_tokens=1000, max_rounds=2)  # learner 8's: refused by the rule
    frag.tokens_merged = 14_000
    frag.publish_version({7: 9_500, 8: 4_500})  # now learner 7 has 4 rounds of 8's work behind version 1
    frag.prune_versions(max_staleness_rounds=2, round_tokens=1000)
    assert not frag.tracks(1) and frag.tracks(2)


def test_no_more_than_the_newest_thousand_versions_are_tracked():
    """A learner alone never has others' work behind it: the cap bounds the record."""
    frag = _fragment()
    for step in range(1, MAX_TRACKED_VERSIONS + 11):
        frag.tokens_merged = step * 1000
        frag.publish_version({7: step * 1000})
        frag.prune_versions(max_staleness_rounds=2, round_tokens=1000)
    assert len(frag.tokens_at_version) == MAX_TRACKED_VERSIONS and frag.tracks(frag.version)
    assert min(frag.tokens_at_version) == frag.version - MAX_TRACKED_VERSIONS + 1


def test_a_fragment_round_trips_through_its_checkpoint_form():
    frag = _fragment()
    frag.tokens_merged = 1500
    frag.merged_by_learner = {3: 2}
    frag.publish_version({3: 1500})
    saved = frag.to_json(["a", "b"])
    assert saved["tensors"] == ["a", "b"]
    back = _fragment()
    back.load_json(saved)
    assert (back.version, back.tokens_merged, back.tokens_at_version, back.own_at_version, back.merged_by_learner) == (
        1, 1500, {0: 0, 1: 1500}, {0: {}, 1: {3: 1500}}, {3: 2}
    )


def test_a_learner_record_from_an_old_checkpoint_without_accepted_tokens_loads():
    rec = LearnerRecord.from_json({"last_seq_accepted": 4, "last_seq_applied": 3, "accepted": 4, "merged": 3, "refused": 0,
                                   "tokens_merged": {"0": 900}})
    assert rec.tokens_merged == {0: 900} and rec.tokens_accepted == {}
    assert LearnerRecord.from_json(rec.to_json()) == rec


def test_after_a_restore_what_was_accepted_but_not_applied_is_counted_again():
    rec = LearnerRecord()
    rec.count_accepted(0, 1, 100)
    rec.count_accepted(0, 2, 100)
    rec.count_merged(0, 1, 100)
    rec.forget_unapplied()
    assert (rec.last_seq_accepted, rec.accepted, rec.tokens_accepted) == (1, 1, {0: 100})
    rec.count_accepted(0, 2, 100)  # re-queued from the journal
    assert (rec.last_seq_accepted, rec.accepted, rec.tokens_accepted) == (2, 2, {0: 200})


def test_work_every_fragment_has_is_the_minimum_over_fragments():
    rec = LearnerRecord(tokens_merged={0: 300, 1: 200})
    assert rec.work(rec.tokens_merged, range(2)) == 200
    assert rec.work(rec.tokens_merged, range(3)) == 0
