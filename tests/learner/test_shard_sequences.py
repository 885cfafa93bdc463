"""A learner's sequence numbers with S outer shards: shard I gets I + 1, I + 1 + S, ...; each
shard sees steady steps of S whatever the others do, a (learner, sequence) pair names one
delta across the run, and a restarted learner continues each shard after that shard's last."""

from __future__ import annotations

from ddiloco.learner.shard_uploader import next_seq
from ddiloco.outer.admission import MAX_SEQ_JUMP


def test_each_shard_starts_at_its_index_and_steps_by_the_shard_count():
    assert [next_seq(i, 3, 0) for i in range(3)] == [1, 2, 3]
    assert next_seq(1, 3, 2) == 5 and next_seq(1, 3, 5) == 8


def test_the_shards_sequences_never_collide_and_stay_within_what_admission_allows():
    shards = 4
    seen: set[int] = set()
    for i in range(shards):
        last, seqs = 0, []
        for _ in range(50):
            last = next_seq(i, shards, last)
            seqs.append(last)
        assert not seen & set(seqs)
        seen |= set(seqs)
        steps = {b - a for a, b in zip(seqs, seqs[1:])}
        assert steps == {shards} and shards <= MAX_SEQ_JUMP
