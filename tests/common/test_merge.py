"""Merge math against closed forms: weights, staleness, RDA, and the work-clock optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.common import merge


def test_token_weights_are_quantity_times_quality_normalised():
    infos = [merge.DeltaInfo(tokens=1000, inner_steps=10), merge.DeltaInfo(tokens=500, inner_steps=10)]
    # raw: 1000 * 100 = 1e5 and 500 * 50 = 2.5e4
    w = merge.token_weights(infos)
    assert w == pytest.approx([0.8, 0.2])
    assert sum(w) == pytest.approx(1.0)


def test_equal_work_gets_equal_weight():
    w = merge.token_weights([merge.DeltaInfo(640, 5)] * 4)
    assert w == pytest.approx([0.25] * 4)


def test_staleness_discount_is_one_over_one_plus_rounds_then_refused():
    assert merge.staleness_discount(0.0, 4) == 1.0
    assert merge.staleness_discount(0.25, 4) == pytest.approx(0.8)  # a late quarter round already costs
    assert merge.staleness_discount(1.0, 4) == pytest.approx(0.5)
    assert merge.staleness_discount(2.0, 4) == pytest.approx(1 / 3)
    assert merge.staleness_discount(4.0, 4) == pytest.approx(0.2)
    assert merge.staleness_discount(4.01, 4) is None


def test_work_fraction_counts_rounds_of_learner_work():
    infos = [merge.DeltaInfo(100, 1), merge.DeltaInfo(100, 1, discount=0.5)]
    assert merge.work_fraction(infos, round_tokens=300) == pytest.approx(0.5)


def test_rda_keeps_the_norm_of_equal_norm_orthogonal_deltas_while_the_mean_shrinks_it():
    for m in (2, 4, 8, 16):
        deltas = [[torch.eye(m)[i] * 3.0] for i in range(m)]
        w = [1.0 / m] * m
        rda = merge.combine(deltas, w, "rda")[0]
        mean = merge.combine(deltas, w, "mean")[0]
        assert rda.norm().item() == pytest.approx(3.0, rel=1e-5)
        assert mean.norm().item() == pytest.approx(3.0 / math.sqrt(m), rel=1e-5)


def test_rda_leaves_embeddings_to_the_plain_weighted_mean():
    deltas = [[torch.tensor([1.0, 0.0])], [torch.tensor([0.0, 1.0])]]
    out = merge.combine(deltas, [0.5, 0.5], "rda", plain_average=[True])[0]
    assert torch.allclose(out, torch.tensor([0.5, 0.5]))


def test_one_full_round_is_exactly_torch_sgd_with_nesterov():
    torch.manual_seed(0)
    p_ref = torch.randn(10)
    p_ours = p_ref.clone()
    ref_param = torch.nn.Parameter(p_ref.clone())
    sgd = torch.optim.SGD([ref_param], lr=0.7, momentum=0.9, nesterov=True)
    ours = merge.WorkClockNesterov(0.7, 0.9, True)
    for _ in range(5):
        g = torch.randn(10)
        ref_param.grad = g.clone()
        sgd.step()
        ours.step([p_ours], [g], fraction=1.0)
    assert torch.allclose(p_ours, ref_param.detach(), atol=1e-6)


def _steady_round_update(fractions_per_round, rounds=300, staleness=0.0):
    """Per-round update after ``rounds`` rounds of a constant pseudo-gradient g = 1."""
    opt = merge.WorkClockNesterov(0.7, 0.9)
    p = torch.zeros(1, dtype=torch.float64)  # float64: the position grows to thousands of g
    g = torch.ones(1, dtype=torch.float64)
    for _ in range(rounds):
        for f in fractions_per_round:
            opt.step([p], [g], f, staleness)
    before = p.clone()
    for f in fractions_per_round:
        opt.step([p], [g], f, staleness)
    return (before - p).item()


def test_the_synchronous_step_moves_lr_over_one_minus_momentum_per_round():
    assert _steady_round_update([1.0]) == pytest.approx(0.7 / (1 - 0.9), rel=1e-9)


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_a_round_split_into_m_equal_merges_moves_exactly_as_far_as_the_synchronous_step(m):
    assert _steady_round_update([1.0 / m] * m) == pytest.approx(7.0, rel=1e-3)


def test_any_arrival_pattern_moves_exactly_as_far_per_round_in_steady_state():
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        parts = torch.rand(int(torch.randint(1, 9, (1,), generator=gen)), generator=gen)
        fractions = (parts / parts.sum()).tolist()
        assert _steady_round_update(fractions) == pytest.approx(7.0, rel=1e-3)


def test_staleness_shortens_the_momentum_memory_but_never_the_steady_state_update():
    for staleness in (0.5, 1.0, 3.0):
        assert _steady_round_update([0.25] * 4, staleness=staleness) == pytest.approx(7.0, rel=1e-3)


def test_a_backlog_of_k_rounds_moves_one_full_gain_step_plus_the_rest_at_unit_gain():
    """From rest, with the full-gain part F: the step of f = min(k, F) moves
    lr * f * (1 + momentum * (1 - 0.9^f) / 0.1) * g; each further round moves g once."""
    for full in (1.0, 1.5):
        for k in (1.0, 1.5, 2.0, 5.5, 100.0):
            opt = merge.WorkClockNesterov(0.7, 0.9, full_gain_rounds=full)
            p = torch.zeros(1)
            opt.step([p], [torch.ones(1)], k)
            f = min(k, full)
            assert -p.item() == pytest.approx(0.7 * f * (1 + 0.9 * (1 - 0.9**f) / 0.1) + (k - f), rel=1e-6)


def test_a_backlog_averages_its_rate_into_the_momentum_for_the_rounds_it_stands_for():
    """From rest: the full-gain part F adds (1 - 0.9^F) / 0.1 g; the 3 - F rounds beyond it
    decay by 0.9^(3 - F) and add (1 - 0.9^(3 - F)) / 0.1 g, as ordinary rounds of the same
    rate would: the buffer is that of three ordinary rounds, (1 - 0.9^3) / 0.1 g."""
    for full in (1.0, 1.5):
        opt = merge.WorkClockNesterov(0.7, 0.9, full_gain_rounds=full)
        opt.step([torch.zeros(1)], [torch.ones(1)], 3.0)
        assert opt.buffers[0].item() == pytest.approx((1 - 0.9**3) / 0.1, rel=1e-6)


@pytest.mark.parametrize("rounds", [1.05, 1.2, 1.5])
def test_full_gain_rounds_one_and_a_half_moves_merges_of_lengthened_windows_the_synchronous_step(rounds):
    """Phase alignment lengthens windows by up to H/2, so merges of M aligned windows hold up to
    1.5 rounds: with them all at the full gain, 7 g per round in steady state."""
    opt = merge.WorkClockNesterov(0.7, 0.9, full_gain_rounds=1.5)
    p = torch.zeros(1, dtype=torch.float64)
    g = torch.ones(1, dtype=torch.float64)
    for _ in range(300):
        opt.step([p], [g], rounds)
    before = p.clone()
    opt.step([p], [g], rounds)
    assert (before - p).item() / rounds == pytest.approx(7.0, rel=1e-6)


def test_by_default_the_excess_of_a_lengthened_window_moves_at_unit_gain():
    """With only the first round at full gain (the default), a merge of 1 + e rounds moves
    (7 + e) / (1 + e) per round: 6.0 instead of 7 at e = 0.2."""
    opt = merge.WorkClockNesterov(0.7, 0.9)
    p = torch.zeros(1, dtype=torch.float64)
    g = torch.ones(1, dtype=torch.float64)
    for _ in range(300):
        opt.step([p], [g], 1.2)
    before = p.clone()
    opt.step([p], [g], 1.2)
    assert (before - p).item() / 1.2 == pytest.approx((7 + 0.2) / 1.2, rel=1e-6)


def test_full_gain_rounds_below_one_round_is_refused():
    with pytest.raises(ValueError, match="full_gain_rounds"):
        merge.WorkClockNesterov(0.7, 0.9, full_gain_rounds=0.5)


def test_an_outage_leaves_the_steady_state_momentum_and_the_next_rounds_update_unchanged():
    """A synchronous run's buffer survives an outer-optimizer outage as it was; so does the
    work clock's, whatever the backlog merged at the restart: the round after it moves the
    steady-state 7 g again."""
    for backlog in (1.5, 3.5, 10.0):
        opt = merge.WorkClockNesterov(0.7, 0.9)
        p = torch.zeros(1)
        for _ in range(300):
            opt.step([p], [torch.ones(1)], 1.0)
        steady = opt.buffers[0].item()
        assert steady == pytest.approx(10.0, rel=1e-6)
        opt.step([p], [torch.ones(1)], backlog)
        assert opt.buffers[0].item() == pytest.approx(steady, rel=1e-6)
        before = p.item()
        opt.step([p], [torch.ones(1)], 1.0)
        assert before - p.item() == pytest.approx(7.0, rel=1e-6)


def test_a_backlog_costs_one_step_whatever_the_work_it_claims():
    """The server never does work proportional to a caller's number: 1e12 rounds is one step."""
    opt = merge.WorkClockNesterov(0.7, 0.9)
    p = torch.zeros(1)
    opt.step([p], [torch.full((1,), 1e-12)], 1e12)
    assert math.isfinite(p.item())


def test_the_adam_step_bound_is_the_cauchy_schwarz_closed_form():
    assert merge.adam_step_bound(0.9, 0.95) == pytest.approx(0.1 / math.sqrt(0.05 * (1 - 0.81 / 0.95)))
    assert merge.adam_step_bound(0.9, 0.999) == pytest.approx(0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999)))
    # never below 1 (the first bias-corrected step is exactly lr * sign(g)); equal at b2 = b1
    assert merge.adam_step_bound(0.5, 0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        merge.adam_step_bound(0.99, 0.95)  # beta1^2 >= beta2: unbounded


def test_no_gradient_sequence_makes_adamw_exceed_the_delta_bound():
    """Adversarial gradients (tiny then huge, sign flips, constant) against torch's AdamW."""
    steps, lr, wd = 20, 1e-3, 0.1
    sequences = {
        "constant": [1.0] * steps,
        "tiny-then-huge": [1e-8] * (steps - 1) + [1e8],
        "huge-then-tiny": [1e8] + [1e-8] * (steps - 1),
        "alternating": [(-1.0) ** i * 10.0 ** (i % 7) for i in range(steps)],
        "growing": [2.0**i for i in range(steps)],
    }
    for name, grads in sequences.items():
        p = torch.nn.Parameter(torch.full((1,), 3.0))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, betas=(0.9, 0.95))
        start = p.detach().clone()
        for g in grads:
            p.grad = torch.full((1,), g)
            opt.step()
        moved = (p.detach() - start).abs().item()
        bound = merge.delta_linf_bound(steps, lr, wd, param_linf=3.0)
        assert moved <= bound / 2, f"{name}: moved {moved} > {bound / 2}"


@pytest.mark.parametrize("codec_name", ["int8", "int4"])
def test_a_short_window_after_a_full_one_stays_within_the_bound_with_the_rounding_it_carries(codec_name):
    """What the CI run saw at drain: a 1-step window after full ones, int4 with error
    feedback, whose decoded delta carried the previous window's rounding past a bound of
    twice one step's move. Built through the real codec: the previous upload (the most
    ``max_steps`` steps can move) leaves a coordinate just under half a quantization step,
    and the one-step window then adds a whole step's move on top of it."""
    import numpy as np

    from ddiloco.common import codec

    lr, wd, p_linf, h, windows = 1e-3, 0.1, 3.0, 5, 4
    q = codec.QMAX[codec_name]
    big = merge.adamw_linf_move(h * windows, lr, wd, p_linf)
    one = merge.adamw_linf_move(1, lr, wd, p_linf)
    before = np.zeros(64, dtype=np.float32)
    before[0] = big  # the block's absmax: scale = big / q
    before[1] = 0.4999 * big / q  # rounds to 0: its whole value stays as the residual
    ef = codec.ErrorFeedback()
    codec.decode_encoded(ef.encode([("w", before)], codec_name, 64))
    now = np.zeros(64, dtype=np.float32)
    now[1] = one
    (_, sent), = codec.decode_encoded(ef.encode([("w", now)], codec_name, 64))
    peak = float(np.abs(sent).max())
    bound = merge.delta_linf_bound(1, lr, wd, p_linf, qmax=q, max_steps=h * windows)
    assert peak <= bound
    if codec_name == "int4":  # what the former bound, twice one step's move, refused
        assert peak > 2 * one
    # lossless: no residual, the bound is what it always was
    assert merge.delta_linf_bound(1, lr, wd, p_linf) == 2 * one


def test_the_quorum_is_k_but_never_more_than_the_live_learners_and_at_least_one():
    assert merge.quorum_size(4, 8) == 4
    assert merge.quorum_size(4, 2) == 2
    assert merge.quorum_size(4, 0) == 1


def test_an_acknowledged_delta_beyond_the_bound_gets_the_bound_discount_instead_of_being_dropped():
    assert merge.staleness_discount(9.0, 4.0) is None
    assert merge.staleness_discount(9.0, 4.0, clamp=True) == pytest.approx(0.2)


def test_naive_per_arrival_steps_move_m_times_too_far():
    """The failure mode the work clock exists for: f = 1 per arrival of M deltas."""
    g = torch.ones(1)
    m = 4
    naive = merge.WorkClockNesterov(0.7, 0.9)
    clock = merge.WorkClockNesterov(0.7, 0.9)
    p_naive, p_clock = torch.zeros(1), torch.zeros(1)
    for _ in range(50 * m):
        naive.step([p_naive], [g], 1.0)
        clock.step([p_clock], [g], 1.0 / m)
    assert abs(p_naive.item()) > 3 * abs(p_clock.item())


def test_invalid_fraction_is_refused():
    with pytest.raises(ValueError):
        merge.WorkClockNesterov().step([torch.zeros(1)], [torch.zeros(1)], 0.0)


def test_staleness_shortens_the_momentum_memory_and_zero_staleness_changes_nothing():
    g = torch.ones(1)
    fresh, stale, plain = (merge.WorkClockNesterov(0.7, 0.9) for _ in range(3))
    pf, ps, pp = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    fresh.step([pf], [g], 0.25, staleness=0.0)
    plain.step([pp], [g], 0.25)
    stale.step([ps], [g], 0.25, staleness=1.0)
    assert torch.equal(pf, pp)
    # the buffer decays by d = 0.9 ** (0.25 * (1 + s)) and gains (1 - d) / (1 - 0.9)
    fresh.step([pf], [g], 0.25, staleness=0.0)
    stale.step([ps], [g], 0.25, staleness=1.0)
    d_stale, d_fresh = 0.9**0.5, 0.9**0.25
    assert stale.buffers[0].item() == pytest.approx((1 - d_stale) / 0.1 * (d_stale + 1))
    assert fresh.buffers[0].item() == pytest.approx((1 - d_fresh) / 0.1 * (d_fresh + 1))
    with pytest.raises(ValueError):
        stale.step([ps], [g], 0.25, staleness=-1.0)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fraction", [0.25, 1.0, 3.5])
def test_step_returns_the_norm_of_the_change_it_made(nesterov, fraction):
    torch.manual_seed(0)
    opt = merge.WorkClockNesterov(lr=0.7, momentum=0.9, nesterov=nesterov)
    params = [torch.randn(5, 3), torch.randn(7)]
    for _ in range(3):  # a warm buffer, so momentum is part of the change
        before = [p.clone() for p in params]
        norm = opt.step(params, [torch.randn(5, 3), torch.randn(7)], fraction)
        actual = math.sqrt(sum(float((p - b).pow(2).sum()) for p, b in zip(params, before)))
        assert norm == pytest.approx(actual, rel=1e-5)


# ------------------------------------------------------------ merge planning (outer/state.py)
def test_the_quorum_is_met_by_that_many_distinct_learners():
    assert merge.quorum_met(2, quorum=2, live_learners=4)
    assert not merge.quorum_met(1, quorum=2, live_learners=4)
    assert merge.quorum_met(1, quorum=2, live_learners=1), "one live learner is a quorum of one"
    assert not merge.quorum_met(0, quorum=1, live_learners=0), "nothing pending never merges"


def test_a_delta_is_rescaled_to_one_window_of_h_steps():
    t = [torch.tensor([2.0, -4.0])]
    assert merge.rescale_to_window(t, 10, 10)[0] is t[0], "a whole window is used as it is"
    assert torch.equal(merge.rescale_to_window(t, 20, 10)[0], torch.tensor([1.0, -2.0])), "two coalesced windows: halved"
    assert torch.equal(merge.rescale_to_window(t, 5, 10)[0], torch.tensor([4.0, -8.0])), "half a window: doubled"


def test_rounds_behind_count_other_learners_work_only():
    # 3,000 tokens merged since the base, 1,000 of them the learner's own, rounds of 1,000
    assert merge.rounds_behind(5000, 2000, 1500, 500, 1000) == pytest.approx(2.0)
    assert merge.rounds_behind(5000, 2000, 3500, 500, 1000) == 0.0, "only its own work: not behind"


def test_a_merge_plan_weights_by_quantity_times_quality_and_counts_the_work():
    plan = merge.plan_merge(
        [merge.Waiting(1000, 10, 0.0), merge.Waiting(500, 10, 0.5)], round_tokens=3000, max_staleness_rounds=4
    )
    # the second is half a round behind: discount 1 / 1.5
    raw = [1000 * 100, (1 / 1.5) * 500 * 50]
    assert plan.weights == pytest.approx([raw[0] / sum(raw), raw[1] / sum(raw)])
    assert plan.fraction == pytest.approx((1000 + 500 / 1.5) / 3000)
    assert plan.staleness == [0.0, 0.5]
    assert plan.mean_staleness == pytest.approx(plan.weights[1] * 0.5)


def test_a_merge_plan_discounts_stale_deltas_and_clamps_those_beyond_the_bound():
    # 2 rounds behind: discount 1/3; untracked base (inf): the bound's discount 1/5, staleness 4
    plan = merge.plan_merge(
        [merge.Waiting(100, 1, 2.0), merge.Waiting(100, 1, math.inf)], round_tokens=400, max_staleness_rounds=4,
        staleness_gain=2.0,
    )
    raw = [100 * 100 / 3, 100 * 100 / 5]
    assert plan.weights == pytest.approx([raw[0] / sum(raw), raw[1] / sum(raw)])
    assert plan.fraction == pytest.approx((100 / 3 + 100 / 5) / 400)
    assert plan.staleness == [2.0, 4.0]
    assert plan.mean_staleness == pytest.approx(2.0 * (plan.weights[0] * 2.0 + plan.weights[1] * 4.0))


def test_without_the_work_clock_every_merge_is_one_round():
    plan = merge.plan_merge([merge.Waiting(100, 1, 0.0)], round_tokens=400, max_staleness_rounds=4, work_clock=False)
    assert plan.fraction == 1.0


def test_a_merge_is_split_into_its_full_gain_part_and_the_backlog():
    assert merge.split_fraction(0.25) == (0.25, 0.0)
    assert merge.split_fraction(1.0) == (1.0, 0.0)
    assert merge.split_fraction(1.4) == (1.0, pytest.approx(0.4))
    assert merge.split_fraction(3.5) == (1.0, 2.5)
    assert merge.split_fraction(1.4, full_gain_rounds=1.5) == (1.4, 0.0)  # aligned windows: all at full gain
    assert merge.split_fraction(3.5, full_gain_rounds=1.5) == (1.5, 2.0)


def test_the_buffer_decay_and_gain_keep_the_steady_state_at_g_over_one_minus_momentum():
    d, gain = merge.buffer_decay_and_gain(0.9, 0.25, staleness=1.0)
    assert d == pytest.approx(0.9**0.5)
    assert gain == pytest.approx((1 - 0.9**0.5) / 0.1)
    # the fixed point of buf = d * buf + gain * g is g / (1 - momentum), whatever f and s
    assert gain / (1 - d) == pytest.approx(1 / 0.1)
    assert merge.buffer_decay_and_gain(0.9, 1.0) == pytest.approx((0.9, 1.0))
