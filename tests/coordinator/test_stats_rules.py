"""The token budget's confirmation (``coordinator/stats_rules.py``): learners' claims count
toward ``--max-tokens`` only as far as the outer optimizer's answered work bears them out.
Pure arithmetic, against values worked out by hand."""

from __future__ import annotations

from ddiloco.common.config import RunConfig
from ddiloco.common.config_rules import MAX_BATCH_FACTOR
from ddiloco.coordinator.stats_rules import INT64_MAX, Bounds, confirmed_tokens, unanswered_allowance


def test_what_one_learner_may_hold_unanswered_is_its_uploader_queue_and_two_windows_at_the_largest_batch():
    cfg = RunConfig()
    cfg.learner.inner_steps = 20
    cfg.learner.max_coalesce_windows = 4  # a delta of at most 4 windows: 80 steps
    # 2 x 20 (the window in training, fragments staggered) + 3 x 80 (one sent, one queued,
    # one more while leaving) = 280 steps, at 16 x the run's 512 tokens a step
    assert unanswered_allowance(cfg, step_weight=512) == 280 * MAX_BATCH_FACTOR * 512
    assert Bounds.for_run(cfg, step_weight=512).unanswered == 280 * 16 * 512


def test_a_claim_counts_up_to_the_answered_work_plus_the_allowance():
    claimed = {0: 1_000, 1: 5_000, 2: 900}
    answered = {0: 800, 1: 2_000, 2: 900}
    # 0: within its answered work and allowance, counted whole; 1: 2,000 answered + 500;
    # 2: all of it answered
    assert confirmed_tokens(claimed, answered, allowance=500) == 1_000 + 2_500 + 900


def test_an_id_whose_work_the_outer_optimizer_never_answered_counts_nothing():
    """A caller that registered an id and claims work it never uploaded: however large."""
    claimed = {0: 10_000, 7: INT64_MAX}
    assert confirmed_tokens(claimed, {0: 10_000}, allowance=500) == 10_000
    assert confirmed_tokens(claimed, {0: 10_000, 7: 0}, allowance=500) == 10_000
    assert confirmed_tokens(claimed, {}, allowance=500) == 0


def test_the_sum_saturates_instead_of_overflowing():
    claimed = {i: INT64_MAX for i in range(3)}
    answered = {i: INT64_MAX - 10 for i in range(3)}
    assert confirmed_tokens(claimed, answered, allowance=500) == INT64_MAX
