"""A delta acknowledged on a base version that left the staleness clock before it merged
(later merges pruned the version; then the process crashed) is queued again after the
restart and merged at the staleness bound's discount, as ``merge.plan_merge`` treats every
acknowledged delta whose base is no longer tracked. Its base stays off the clock.

Before, the requeue put the base back on the clock at the current tokens merged: the delta
merged as if fresh (discount 1, a work fraction five times the bound's), and until the
version was pruned again any learner pushing on it was taken as fresh too, a record the
next checkpoint would have saved."""

from __future__ import annotations

import pytest
from outer_helpers import make_delta, push, state_specs, tiny_config

from ddiloco.common.errors import FailedPrecondition
from ddiloco.outer.state import OuterState


def test_a_requeued_delta_on_a_pruned_base_merges_at_the_bound_and_leaves_the_base_untracked(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    # one window each, learners 0 and 2 in turn: each finds more than (max_staleness_rounds
    # + 1) rounds of the other's work behind version 0 (a version stays on the clock while
    # what followed it is mostly one learner's own work, which that learner's delta does
    # not count)
    merges = 24
    for k in range(merges):
        push(state, 2 * (k % 2), k // 2 + 1, seed=k + 1)
        assert state.merge(0, force=True)
    assert not state.fragment(0).tracks(0), "version 0 is off the staleness clock"
    # learner 1's delta on version 0, acknowledged (journaled) while those merges went on
    header, payload = make_delta(state_specs(state), cfg.run_id, 1, 1, 0, seed=99)
    state.journal.write(header, payload)
    del state  # the crash

    restarted = OuterState(cfg, tmp_path)
    frag = restarted.fragment(0)
    assert [(p.learner_id, p.seq, p.base_version) for p in frag.pending] == [(1, 1, 0)]
    assert not frag.tracks(0)
    late, late_payload = make_delta(state_specs(restarted), cfg.run_id, 0, merges // 2 + 1, 0, seed=7)
    with pytest.raises(FailedPrecondition, match="stale"):
        restarted.accept(late, late_payload)

    assert restarted.merge(0, force=True)
    _, record = list(restarted.merge_journal.records())[-1]
    assert record["deltas"] == [[1, 1]]
    round_tokens = restarted.workload.round_tokens()
    bound_discount = 1 / (1 + cfg.outer.max_staleness_rounds)
    assert record["fraction"] == pytest.approx(bound_discount * header.tokens / round_tokens)
