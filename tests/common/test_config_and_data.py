"""Typed configuration and the deterministic corpus split."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.common.config import DataConfig, RunConfig
from ddiloco.common.data import ShardSampler, eval_windows, load_corpus


def test_run_config_survives_json_round_trip():
    cfg = RunConfig(run_id="x", learners=3)
    cfg.learner.codec = "int4"
    cfg.outer.quorum = 2
    back = RunConfig.from_json(cfg.to_json())
    assert back == cfg


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        RunConfig.from_json('{"learnerz": 3}')


def test_round_tokens_is_m_times_h_times_batch_tokens():
    cfg = RunConfig(learners=4)
    assert cfg.round_tokens() == 4 * cfg.learner.inner_steps * cfg.learner.batch_size * cfg.model.context


def test_a_learner_of_r_ranks_steps_r_batches_so_a_round_is_r_times_the_tokens():
    """A round is M windows of H steps whatever a learner's group size: a group's window is
    one learner's window of work, and counted as R of them its merge would step R times too far."""
    one, two = RunConfig(learners=4), RunConfig(learners=4)
    two.learner.ranks = 2
    assert two.round_tokens() == 2 * one.round_tokens()


def test_ranks_per_learner_is_a_run_flag_from_1_to_16():
    import argparse

    from ddiloco.common.runflags import add_run_flags, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert run_config_from_args(parser.parse_args([])).learner.ranks == 1
    assert run_config_from_args(parser.parse_args(["--ranks-per-learner", "4"])).learner.ranks == 4
    for bad in ("0", "17"):
        with pytest.raises(SystemExit, match="--ranks-per-learner must be 1 to 16 processes"):
            run_config_from_args(parser.parse_args(["--ranks-per-learner", bad]))


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_bytes=400_000), num_shards=3)


def test_split_is_deterministic(corpus):
    again = load_corpus(DataConfig(max_bytes=400_000), num_shards=3)
    for a, b in zip(corpus.shards, again.shards):
        assert np.array_equal(a, b)
    assert np.array_equal(corpus.eval_bytes, again.eval_bytes)


def test_every_shard_and_the_eval_set_hold_real_text(corpus):
    assert len(corpus.shards) == 3
    assert all(s.size > 50_000 for s in corpus.shards)
    assert corpus.eval_bytes.size > 5_000
    text = bytes(corpus.shards[0][:2000]).decode("utf-8", errors="replace")
    assert " the " in text or "def " in text


def test_eval_documents_are_held_out_from_every_shard(corpus):
    trained = {name for docs in corpus.shard_docs for name in docs}
    assert corpus.eval_docs and not trained & set(corpus.eval_docs)
    # every shard gets its own documents: no document is trained on by two learners
    assert sum(len(d) for d in corpus.shard_docs) == len(trained)


def test_sampler_batches_are_a_pure_function_of_their_index(corpus):
    a = ShardSampler(corpus.shards[1], context=32, batch_size=4, seed=7)
    b = ShardSampler(corpus.shards[1], context=32, batch_size=4, seed=7)
    for i in (0, 5, 1000):
        xa, ya = a.batch(i)
        xb, yb = b.batch(i)
        assert np.array_equal(xa.numpy(), xb.numpy())
        assert np.array_equal(xa[:, 1:].numpy(), ya[:, :-1].numpy())  # targets are inputs shifted by one


def test_user_text_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 5000)
    (tmp_path / "b.txt").write_text("other text " * 5000)
    c = load_corpus(DataConfig(path=str(tmp_path)), num_shards=2)
    assert all(s.size > 0 for s in c.shards) and c.eval_bytes.size > 0
    assert eval_windows(c.eval_bytes, 16, 8).shape == (8, 17)


def test_missing_user_text_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(DataConfig(path=str(tmp_path / "nope")), 2)


def test_the_coalescing_bound_defaults_to_the_staleness_bound_and_is_a_run_flag():
    import argparse

    from ddiloco.common.runflags import add_run_flags, run_config_from_args

    cfg = RunConfig()
    assert cfg.learner.max_coalesce_windows == cfg.outer.max_staleness_rounds == 4
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert run_config_from_args(parser.parse_args(["--max-coalesce-windows", "8"])).learner.max_coalesce_windows == 8
    for bad in ("0", "1025"):
        with pytest.raises(SystemExit, match="--max-coalesce-windows must be 1 to 1024"):
            run_config_from_args(parser.parse_args(["--max-coalesce-windows", bad]))


@pytest.mark.parametrize("text,message", [
    ('{"learners": "4"}', "learners must be int, got '4'"),
    ('{"outer": {"lr": "fast"}}', "outer.lr must be float, got 'fast'"),
    ('{"learner": {"sync": "yes"}}', "learner.sync must be bool, got 'yes'"),
    ('{"learner": 3}', "learner must be an object"),
    ('{"learnerz": 4}', "unknown RunConfig keys: ['learnerz']"),
    ('{"learner": {"codec": "int2"}}', "learner.codec must be one of fp32, int8, int4, got 'int2'"),
    ('{"learner": {"codec": 8}}', "learner.codec must be one of fp32, int8, int4, got 8"),
    ('{"outer": {"merge_rule": "median"}}', "outer.merge_rule must be one of weighted, mean, rda, got 'median'"),
])
def test_a_config_file_with_a_wrong_value_is_refused_by_name(text, message):
    with pytest.raises(ValueError) as exc:
        RunConfig.from_json(text)
    assert message in str(exc.value)


def test_an_int_where_a_float_belongs_is_accepted():
    assert RunConfig.from_json('{"max_seconds": 60}').max_seconds == 60.0


def test_a_bad_config_file_is_one_error_for_the_cli(tmp_path):
    import argparse

    from ddiloco.common.runflags import add_run_flags, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    with pytest.raises(SystemExit, match="cannot read it"):
        run_config_from_args(parser.parse_args(["--config", str(tmp_path / "missing.json")]))
    bad = tmp_path / "bad.json"
    bad.write_text('{"learners": "4"}')
    with pytest.raises(SystemExit, match="learners must be int"):
        run_config_from_args(parser.parse_args(["--config", str(bad)]))
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match=r"--config .*bad.json: Expecting property name"):
        run_config_from_args(parser.parse_args(["--config", str(bad)]))
