"""The outer optimizer keeps the run's typical staleness discount per fragment
(``merge.plan_merge``): a run whose merges are steadily half a round stale applies its work
at the synchronous step per round, and a restart, from a checkpoint or by replaying merge
records after one, continues with the same typical discount, so it plans the next merge
exactly as the process that died would have."""

from __future__ import annotations

import json

import pytest

from outer_helpers import WINDOW_TOKENS, fingerprint, make_delta, state_specs, tiny_config

from ddiloco.outer.journal import MergeRecordCorrupt
from ddiloco.outer.state import OuterState


def stale_merges(state: OuterState, n: int, seqs: dict[int, int], seed: int) -> None:
    """``n`` merges of one delta each, learners 0 and 1 in turn, each based on the version
    before the other's merge: half a round (one of two learners' windows) stale."""
    for i in range(n):
        learner = (seqs[0] + seqs[1]) % 2
        seqs[learner] += 1
        base = max(state.fragments[0].version - 1, 0)
        header, payload = make_delta(state_specs(state), state.config.run_id, learner, seqs[learner], base, seed + i)
        state.accept(header, payload)
        assert state.merge(0, force=True)


def last_record(tmp_path) -> dict:
    return json.loads(sorted((tmp_path / "merges").glob("*.json"))[-1].read_text())


def test_steady_half_round_staleness_keeps_the_synchronous_step_per_round(tmp_path):
    state = OuterState(tiny_config(), tmp_path)
    stale_merges(state, 80, {0: 0, 1: 0}, seed=0)
    record = last_record(tmp_path)
    # one window of two learners: half a round of work, discounted 1 / 1.5 against a typical
    # discount that has converged on 1 / 1.5, so counted at its whole work again
    assert state.fragments[0].typical_discount == pytest.approx(1 / 1.5, abs=0.01)
    assert record["fraction"] == pytest.approx(WINDOW_TOKENS / (2 * WINDOW_TOKENS), abs=0.01)
    assert record["typical_discount"] == state.fragments[0].typical_discount


def test_with_no_memory_the_same_run_applies_two_thirds_of_its_work(tmp_path):
    cfg = tiny_config()
    cfg.outer.staleness_memory_rounds = 0.0
    state = OuterState(cfg, tmp_path)
    stale_merges(state, 20, {0: 0, 1: 0}, seed=0)
    assert state.fragments[0].typical_discount == 1.0
    assert last_record(tmp_path)["fraction"] == pytest.approx(0.5 / 1.5)


@pytest.mark.parametrize("restart", ["from-checkpoint", "replaying-records"])
def test_a_restart_continues_with_the_typical_discount_the_dead_process_had(tmp_path, restart):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    seqs = {0: 0, 1: 0}
    stale_merges(state, 30, seqs, seed=0)
    assert state.checkpoint() is not None
    if restart == "replaying-records":
        stale_merges(state, 10, seqs, seed=100)  # recorded after the checkpoint: replayed
    typical = state.fragments[0].typical_discount
    assert typical < 0.9, "the run's merges were not stale: nothing to carry over"

    restored = OuterState(cfg, tmp_path)  # what the restarted process builds
    assert restored.fragments[0].typical_discount == typical
    assert fingerprint(restored) == fingerprint(state)
    # both plan the next merge alike, to the last bit
    stale_merges(state, 1, dict(seqs), seed=500)
    stale_merges(restored, 1, dict(seqs), seed=500)
    assert fingerprint(restored) == fingerprint(state)
    assert restored.fragments[0].typical_discount == state.fragments[0].typical_discount


def test_a_merge_record_with_an_impossible_typical_discount_stops_the_restart(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    stale_merges(state, 2, {0: 0, 1: 0}, seed=0)
    path = sorted((tmp_path / "merges").glob("*.json"))[-1]
    record = json.loads(path.read_text())
    record["typical_discount"] = 7.0
    path.write_text(json.dumps(record))
    with pytest.raises(MergeRecordCorrupt, match="typical discount 7.0") as info:
        OuterState(cfg, tmp_path)
    assert str(path) in str(info.value)
