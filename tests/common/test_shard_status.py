"""Reading several outer shards as one outer optimizer (``common/shard_status.py``): which
shard an answer is from, and where each fragment's work ends, combined."""

from __future__ import annotations

import grpc
import pytest

from ddiloco.common.shard_status import WrongShardAnswer, check_shard, combine_statuses
from ddiloco.v1 import outer_pb2


def _status(fragments: list[int], answered: dict[int, int] | None = None) -> outer_pb2.OuterStatus:
    return outer_pb2.OuterStatus(
        fragments=[outer_pb2.FragmentStatus(fragment=f) for f in fragments],
        learners=[outer_pb2.LearnerMergeStats(learner_id=0, answered_tokens=answered or {})],
    )


def test_an_answer_is_the_shards_when_every_fragment_it_lists_is_one_that_shard_owns():
    # 2 shards of 4 fragments: shard 0 owns 0 and 2, shard 1 owns 1 and 3
    assert check_shard(_status([0, 2]), 0, 2, "a:1").fragments[1].fragment == 2
    assert check_shard(_status([1, 3]), 1, 2, "b:1")
    assert check_shard(_status([0, 1, 2]), 0, 1, "a:1")  # one process holds every fragment


@pytest.mark.parametrize("fragments,shard", [([1, 3], 0), ([0, 2], 1), ([0, 1], 0), ([], 0)])
def test_another_shards_answer_is_unavailable_naming_the_address_and_what_it_holds(fragments, shard):
    with pytest.raises(WrongShardAnswer) as wrong:
        check_shard(_status(fragments), shard, 2, "b:1")
    assert isinstance(wrong.value, grpc.RpcError) and wrong.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wrong.value.details() == (
        f"b:1 answers for fragments {fragments}, not for outer shard {shard}'s: the map of shard addresses is out of date"
    )


def test_where_each_fragments_work_ends_is_every_shards_by_fragment():
    combined = combine_statuses([_status([0, 2], {0: 1280, 2: 2560}), _status([1, 3], {1: 1280, 3: 1280})])
    (learner,) = combined.learners
    assert dict(learner.answered_tokens) == {0: 1280, 1: 1280, 2: 2560, 3: 1280}
