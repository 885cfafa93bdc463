"""A run is refused before it starts when any learner's shard of the text could not give
one batch, not only shard 0: the learner of a short shard would die at its first batch."""

from __future__ import annotations

import pytest

from ddiloco.common.config import MODEL_PRESETS, DataConfig, RunConfig
from ddiloco.common.data import check_shards, load_corpus
from ddiloco.workloads import WorkloadError
from ddiloco.workloads.preflight import preflight


def run_on(folder, learners: int) -> RunConfig:
    cfg = RunConfig(learners=learners)
    cfg.model = MODEL_PRESETS["tiny"]  # context 64
    cfg.learner.batch_size = 4  # one batch: 4 x 64 + 1 = 257 bytes
    cfg.data = DataConfig(path=str(folder), eval_every_nth_doc=2)
    return cfg


def documents(tmp_path, sizes: list[int]):
    for i, size in enumerate(sizes):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(b"x" * size)
    return tmp_path


def test_a_short_shard_beyond_shard_0_is_refused_naming_it_its_size_and_what_a_batch_needs(tmp_path):
    # training documents (every 2nd is held out): 5000, 100 -> shard 0 gets 5000, shard 1 gets 100
    folder = documents(tmp_path, [5000, 300, 100, 300])
    cfg = run_on(folder, learners=2)
    assert [s.size for s in load_corpus(cfg.data, 2).shards] == [5000, 100]
    with pytest.raises(WorkloadError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "shard 1 of 2" in message and "holds 100 bytes" in message and "needs 257" in message
    assert "fewer learners (--learners) or more data" in message


def test_the_same_text_in_one_shard_is_accepted(tmp_path):
    cfg = run_on(documents(tmp_path, [5000, 300, 100, 300]), learners=1)
    preflight(cfg)


def test_the_smallest_of_many_shards_is_named():
    corpus = load_corpus(DataConfig(), 100)
    sizes = [int(s.size) for s in corpus.shards]
    smallest = sizes.index(min(sizes))
    # one window of min(sizes) bytes needs one byte more than the smallest shard holds
    with pytest.raises(ValueError, match=rf"shard {smallest} of 100 \(the smallest\) holds {min(sizes):,} bytes"):
        check_shards(corpus, context=min(sizes), batch_size=1)
    check_shards(corpus, context=min(sizes) - 1, batch_size=1)
