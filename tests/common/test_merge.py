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


def test_staleness_discount_is_free_for_one_round_then_one_over_rounds_then_refused():
    assert merge.staleness_discount(0.0, 4) == 1.0
    assert merge.staleness_discount(1.0, 4) == 1.0
    assert merge.staleness_discount(2.0, 4) == pytest.approx(0.5)
    assert merge.staleness_discount(4.0, 4) == pytest.approx(0.25)
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


def test_a_round_split_into_m_merges_moves_as_far_as_one_synchronous_step_in_steady_state():
    """Constant pseudo-gradient g: after many rounds, the per-round update of M partial
    merges (f = 1/M each) matches the synchronous step within a few percent, whatever M."""
    g = torch.ones(1)
    sync = merge.WorkClockNesterov(0.7, 0.9)
    p_sync = torch.zeros(1)
    for _ in range(200):
        sync.step([p_sync], [g], 1.0)
    before = p_sync.clone()
    sync.step([p_sync], [g], 1.0)
    sync_step = (before - p_sync).item()
    for m in (2, 4, 8):
        opt = merge.WorkClockNesterov(0.7, 0.9)
        p = torch.zeros(1)
        for _ in range(200 * m):
            opt.step([p], [g], 1.0 / m)
        before = p.clone()
        for _ in range(m):
            opt.step([p], [g], 1.0 / m)
        assert (before - p).item() == pytest.approx(sync_step, rel=0.06)


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
    # second step: the buffer decayed by 0.9 ** (0.25 * 2) instead of 0.9 ** 0.25
    fresh.step([pf], [g], 0.25, staleness=0.0)
    stale.step([ps], [g], 0.25, staleness=1.0)
    assert stale.buffers[0].item() == pytest.approx(0.25 * 0.9**0.5 + 0.25)
    assert fresh.buffers[0].item() == pytest.approx(0.25 * 0.9**0.25 + 0.25)
    with pytest.raises(ValueError):
        stale.step([ps], [g], 0.25, staleness=-1.0)
