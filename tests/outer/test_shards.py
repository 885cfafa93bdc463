"""Outer shards: shard I of S owns the fragments f with f % S == I, holds only their tensors,
and merges them exactly as one process holding every fragment would, given the same deltas
in the same order per fragment. In-process states, a fixed schedule, no clocks or threads."""

from __future__ import annotations

import pytest
import torch

from outer_helpers import make_delta, state_specs, tiny_config

from ddiloco.common.errors import InvalidArgument, WrongShard
from ddiloco.common.rpc import status_code
from ddiloco.common.shard_status import combine_statuses
from ddiloco.outer.service import status_message
from ddiloco.outer.state import OuterState

P = 4


def sharded_config(shards: int):
    cfg = tiny_config(run_id="shards", fragments=P, checkpoint_every=3)
    cfg.outer_shards = shards
    return cfg


def schedule():
    """(learner, fragment, seed) per delta, in arrival order, with merges between: every
    fragment gets deltas from both learners over several rounds, fragments out of step."""
    events = []
    seq = {0: 0, 1: 0}
    seed = 0
    for rnd in range(4):
        for fragment in [rnd % P, *[f for f in range(P) if f != rnd % P]]:
            for learner in (0, 1) if (fragment + rnd) % 2 else (1, 0):
                seq[learner] += 1
                seed += 1
                events.append(("push", learner, seq[learner], fragment, seed))
            events.append(("merge", fragment))
    return events


def play(states: list[OuterState], owner) -> None:
    """Feed the schedule to ``owner(fragment)``'s state; the same deltas, bases and order, at
    the same (injected) times."""
    now = {"t": 0.0}
    for state in states:
        state.clock = lambda: now["t"]
    for event in schedule():
        now["t"] += 0.125
        if event[0] == "push":
            _, learner, seq, fragment, seed = event
            state = owner(fragment)
            header, payload = make_delta(
                state_specs(state, fragment), "shards", learner, seq, state.fragment(fragment).version, seed, fragment
            )
            state.accept(header, payload)
        else:
            assert owner(event[1]).merge(event[1], force=True)


def test_two_shards_make_exactly_the_merges_of_one_process(tmp_path):
    one = OuterState(sharded_config(1), tmp_path / "one")
    play([one], lambda f: one)
    shards = [OuterState(sharded_config(2), tmp_path / f"outer-{i}", shard=i) for i in range(2)]
    play(shards, lambda f: shards[f % 2])
    for f in range(P):
        shard = shards[f % 2]
        a, b = one.fragment(f), shard.fragment(f)
        assert (a.version, a.tokens_merged) == (b.version, b.tokens_merged)
        for i in a.tensor_ids:
            assert torch.equal(one.params[i], shard.params[i]), one.names[i]
        for x, y in zip(a.optimizer.buffers, b.optimizer.buffers):
            assert torch.equal(x, y)
    # the versions add up to the one process's, and the combined status is its status
    assert sum(s.version for s in shards) == one.version
    combined = combine_statuses([status_message(s.status()) for s in shards])
    alone = status_message(one.status())
    assert combined.version == alone.version and combined.tokens_merged == alone.tokens_merged
    assert combined.model_parameters == alone.model_parameters
    assert list(combined.fragments) == list(alone.fragments)
    assert list(combined.learners) == list(alone.learners)
    # where each fragment's work ends, per learner: every shard's fragments together
    assert all(sorted(r.answered_tokens) == list(range(P)) for r in combined.learners)


def test_a_shard_holds_only_its_fragments_and_refuses_the_others():
    shard = OuterState(sharded_config(2), None, shard=1)
    assert [f.index for f in shard.fragments] == [1, 3]
    held = {i for f in shard.fragments for i in f.tensor_ids}
    assert all((p is not None) == (i in held) for i, p in enumerate(shard.params))
    assert sum(p.numel() for p in shard.params if p is not None) < sum(
        p.numel() for p in OuterState(sharded_config(1), None).params
    )
    other = OuterState(sharded_config(2), None, shard=0)
    header, payload = make_delta(state_specs(other, 0), "shards", 0, 1, 0, seed=1, fragment=0)
    with pytest.raises(WrongShard, match="fragment 0 belongs to outer shard 0, this is shard 1") as wrong:
        shard.accept(header, payload)
    # the request is right and the address it went to is not (a stale map of shard addresses):
    # UNAVAILABLE, which callers retry once their map is refreshed, not INVALID_ARGUMENT
    assert status_code(wrong.value).name == "UNAVAILABLE"
    header.fragment = P
    with pytest.raises(InvalidArgument, match=f"fragment {P} does not exist"):
        shard.accept(header, payload)
    assert 0 not in shard.learners  # refused before anything was counted
    with pytest.raises(ValueError, match="snapshot a fragment"):
        shard.snapshot()


def test_a_shard_restarts_from_its_own_checkpoint_and_journal(tmp_path):
    shards = [OuterState(sharded_config(2), tmp_path / f"outer-{i}", shard=i) for i in range(2)]
    play(shards, lambda f: shards[f % 2])
    before = shards[1]
    again = OuterState(sharded_config(2), tmp_path / "outer-1", shard=1)
    assert again.version == before.version
    for f in (1, 3):
        assert again.fragment(f).version == before.fragment(f).version
        for i in again.fragment(f).tensor_ids:
            assert torch.equal(again.params[i], before.params[i])
    # its folder is its own: another shard's folder is refused, not read as this one
    from ddiloco.outer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="holds fragments"):
        OuterState(sharded_config(2), tmp_path / "outer-0", shard=1)


def test_a_shard_the_run_lacks_cannot_be_built():
    with pytest.raises(ValueError, match="shard 2 does not exist"):
        OuterState(sharded_config(2), None, shard=2)
