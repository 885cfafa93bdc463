"""Fragment partition: balanced, deterministic, complete; staggered first windows; outer shards."""

from __future__ import annotations

import pytest

from ddiloco.common.config import MODEL_PRESETS
from ddiloco.common.fragments import offset, partition, shard_fragments, shard_of
from ddiloco.common.model import build_model


def test_every_tensor_lands_in_exactly_one_fragment():
    sizes = [5, 1, 9, 3, 3, 7, 2]
    parts = partition(sizes, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    assert all(p == sorted(p) for p in parts)  # model order inside a fragment


def test_partition_of_the_real_model_is_balanced():
    model = build_model(MODEL_PRESETS["small"], 0)
    sizes = [p.numel() for p in model.parameters()]
    for count in (2, 4, 8):
        loads = [sum(sizes[i] for i in part) for part in partition(sizes, count)]
        # greedy largest-first: no fragment exceeds the mean by more than the largest tensor
        assert max(loads) - sum(loads) / count <= max(sizes)
        assert max(loads) / (sum(loads) / count) < 1.6


def test_partition_is_deterministic_and_refuses_impossible_splits():
    assert partition([4, 4, 4, 4], 2) == partition([4, 4, 4, 4], 2)
    with pytest.raises(ValueError):
        partition([1, 2], 3)


def test_first_windows_are_evenly_staggered_and_the_last_fragment_keeps_h():
    assert [offset(f, 4, 20) for f in range(4)] == [5, 10, 15, 20]
    assert offset(0, 1, 20) == 20


def test_outer_shards_deal_the_fragments_out_round_robin():
    assert [shard_of(f, 3) for f in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [shard_fragments(i, 3, 7) for i in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert shard_fragments(0, 1, 4) == [0, 1, 2, 3]  # one shard: every fragment
    every = sorted(f for i in range(4) for f in shard_fragments(i, 4, 10))
    assert every == list(range(10))  # each fragment has exactly one owner


def test_a_shard_the_run_lacks_or_one_without_a_fragment_is_refused():
    with pytest.raises(ValueError, match="shard 2 does not exist"):
        shard_fragments(2, 2, 4)
    with pytest.raises(ValueError, match="each shard needs a fragment"):
        shard_fragments(0, 3, 2)
    with pytest.raises(ValueError, match="at least one outer shard"):
        shard_of(0, 0)
