"""A run's membership and each outer shard's status travel in one gRPC message each: the
configuration rules refuse a run whose worst case would not fit (``config_rules
.largest_messages``), and the worst cases here, built from the protos with every number at
its largest and every string at its longest in 4-byte characters, stay within what the rules
reckon. A run id is never empty (an empty one reads as "none given": every pull was refused)."""

from __future__ import annotations

import math

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.config_rules import MAX_MESSAGE_BYTES, MAX_RUN_ID_CHARS, largest_messages, problems
from ddiloco.v1 import common_pb2, coordinator_pb2, outer_pb2

I64 = (1 << 63) - 1
WIDE = "\U0010ffff"  # 4 bytes in UTF-8


def config(learners: int, fragments: int = 1, shards: int = 1, run_id: str = "r" * MAX_RUN_ID_CHARS) -> RunConfig:
    cfg = RunConfig(run_id=run_id)
    cfg.learners, cfg.fragments, cfg.outer_shards = learners, fragments, shards
    return cfg


def worst_membership(cfg: RunConfig) -> coordinator_pb2.Membership:
    stats = common_pb2.LearnerStats(**{f.name: 1e300 if f.type == f.TYPE_DOUBLE else I64
                                       for f in common_pb2.LearnerStats.DESCRIPTOR.fields})
    member = coordinator_pb2.Member(learner_id=-1, address=WIDE * 255, datacenter=WIDE * 64, alive=True, left=True,
                                    ms_since_heartbeat=-1, shard_index=-1, incarnation=-1, stats=stats)
    return coordinator_pb2.Membership(run_id=cfg.run_id, state=coordinator_pb2.RUN_STATE_DRAINING, outer_address=WIDE * 255,
                                      members=[member] * (2 * cfg.learners), elapsed_seconds=1e300,
                                      outer_shards=[WIDE * 255] * cfg.outer_shards)


def worst_status(cfg: RunConfig) -> outer_pb2.OuterStatus:
    ids, held = range(-1, -1 - 2 * cfg.learners, -1), math.ceil(cfg.fragments / cfg.outer_shards)
    learners = []
    for i in ids:
        s = outer_pb2.LearnerMergeStats(learner_id=i, **{f.name: -1 for f in outer_pb2.LearnerMergeStats.DESCRIPTOR.fields
                                                         if f.name not in ("learner_id", "answered_tokens")})
        for f in range(held):
            s.answered_tokens[-1 - f] = -1
        learners.append(s)
    fragments = []
    for f in range(held):
        fs = outer_pb2.FragmentStatus(fragment=-1 - f, version=-1, tokens_merged=-1, parameters=-1)
        for i in ids:
            fs.merged_by_learner[i] = -1
            fs.lead_seconds[i] = 1e300
        fragments.append(fs)
    return outer_pb2.OuterStatus(run_id=cfg.run_id, ready=True, version=-1, outer_steps=-1, tokens_merged=-1,
                                 pending_deltas=-1, learners=learners, initial_eval_loss=1e300, last_eval_loss=1e300,
                                 last_eval_accuracy=1e300, last_eval_version=-1, bytes_received=-1, bytes_sent=-1,
                                 model_parameters=-1, fragments=fragments)


@pytest.mark.parametrize("learners, fragments, shards", [(1, 1, 1), (3, 5, 2), (16, 16, 4), (40, 64, 1)])
def test_the_worst_case_messages_stay_within_what_the_rules_reckon(learners, fragments, shards):
    cfg = config(learners, fragments, shards)
    membership, status = largest_messages(cfg)
    assert worst_membership(cfg).ByteSize() <= membership
    assert worst_status(cfg).ByteSize() <= status


@pytest.mark.parametrize("learners, fragments, shards, which", [
    (4000, 1, 1, "its membership could reach"),  # 8,000 members of 1.4 kB
    (100, 1024, 1, "an outer shard's status could reach"),  # 200 ids x 1,024 fragments of per-learner maps
])
def test_a_run_whose_messages_could_not_fit_is_refused(learners, fragments, shards, which):
    found = problems(config(learners, fragments, shards, run_id="run"))
    assert len(found) == 1 and which in found[0] and f"more than one message carries ({MAX_MESSAGE_BYTES:,})" in found[0]


def test_the_same_fragments_over_more_outer_shards_fit():
    assert problems(config(100, 1024, 8, run_id="run")) == []
    assert problems(config(2048, 1, 1, run_id="run")) == []


@pytest.mark.parametrize("run_id", ["", " run", "a/b", "x" * (MAX_RUN_ID_CHARS + 1), "-run"])
def test_a_run_id_that_is_empty_too_long_or_not_a_name_is_refused(run_id):
    found = problems(config(2, run_id=run_id))
    assert found and found[0].startswith(f"--run-id must be 1 to {MAX_RUN_ID_CHARS} letters, digits or ._:-")


def test_run_ids_in_use_are_names():
    for run_id in ("run", "bandwidth-wan", "quality_scale.v2", "run:7", "R" * MAX_RUN_ID_CHARS):
        assert problems(config(2, run_id=run_id)) == []
