"""The merge laboratory is deterministic: virtual time, seeded jitter, real training. The
same configuration gives the same losses bit for bit, whatever the machine is doing."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import async_lab  # noqa: E402


def _lab(**kw):
    return async_lab.LabConfig(learners=2, tokens=40_000, eval_every_tokens=20_000, eval_windows=32, **kw)


def test_the_same_configuration_gives_the_same_losses_twice():
    a, b = async_lab.run(_lab()), async_lab.run(_lab())
    assert a["curve"] == b["curve"] and a["final_eval_loss"] == b["final_eval_loss"]
    assert a["final_eval_loss"] < a["curve"][0][1], "the laboratory did not train"


def test_synchronous_merges_hold_every_learner_and_no_staleness():
    res = async_lab.run(_lab(**async_lab.VARIANTS["sync"]))
    assert res["deltas_per_merge_mean"] == 2.0
    assert res["staleness_mean"] == 0.0
    assert abs(res["cosine_to_sync_mean"] - 1.0) < 1e-6


def test_every_variant_names_only_laboratory_fields():
    fields = {f.name for f in async_lab.dataclasses.fields(async_lab.LabConfig)}
    for name, overrides in async_lab.VARIANTS.items():
        assert set(overrides) <= fields, name
    for grid in (async_lab.FINDINGS, async_lab.DISCOUNT_FINDINGS, async_lab.DISORDER_FINDINGS,
                 async_lab.QUORUM_FINDINGS, async_lab.OVERLAP_FINDINGS):
        assert all(v in async_lab.VARIANTS for _, _, vs, *_ in grid for v in vs)


def test_stalls_change_arrivals_but_leave_every_other_draw_alone():
    base, stalled = async_lab.run(_lab()), async_lab.run(_lab(stall_rate=2.0, stall_steps=5.0))
    assert stalled["virtual_seconds"] > base["virtual_seconds"]  # the stalls took time
    assert async_lab.run(_lab(stall_rate=0.0, stall_steps=99.0))["curve"] == base["curve"]


def test_the_discount_rules_are_their_closed_forms():
    assert async_lab.staleness_discount("one-round", 0.75) == 1.0
    assert async_lab.staleness_discount("one-round", 2.0) == 0.5
    assert async_lab.staleness_discount("inverse", 0.75) == 1 / 1.75
    # the laboratory's "inverse" is the outer optimizer's rule
    from ddiloco.common import merge

    for s in (0.0, 0.3, 1.0, 3.9):
        assert async_lab.staleness_discount("inverse", s) == merge.staleness_discount(s, 4.0)


def _four(**kw):
    """Four learners, about a round and a half of work: enough for uploads to overtake windows."""
    return async_lab.LabConfig(**{"learners": 4, "tokens": 60_000, "eval_every_tokens": 30_000, "eval_windows": 32, **kw})


def test_upload_spread_puts_deltas_out_of_phase_and_leaves_every_other_draw_alone():
    base = async_lab.run(_four())
    spread = async_lab.run(_four(upload_spread=1.0))
    assert spread["staleness_mean"] > base["staleness_mean"]  # the late uploads made stale merges
    assert async_lab.run(_four(upload_spread=0.0))["curve"] == base["curve"]


def test_the_relative_rule_without_memory_is_the_absolute_one_and_with_it_keeps_the_work():
    spread = {"upload_spread": 1.0}
    inverse = async_lab.run(_four(discount_rule="inverse", **spread))
    assert async_lab.run(_four(discount_rule="relative", memory_rounds=0.0, **spread))["curve"] == inverse["curve"]
    # a memory short enough to learn the run's disorder within this short run
    relative = async_lab.run(_four(discount_rule="relative", memory_rounds=0.5, **spread))
    assert relative["typical_discount_last"] < 1.0
    # outer steps applied per round of work merged: the absolute discount loses a quarter
    assert inverse["fraction_per_round"] + 0.05 < relative["fraction_per_round"] <= 1.05


def test_the_relative_rules_typical_discount_is_an_exponential_average_over_merged_work():
    import math

    # 400 tokens at discounts 0.5 (300) and 1.0 (100): mean 0.625, a quarter round of 1,600
    alpha = 1 - math.exp(-(400 / 1600) / 10.0)
    got = async_lab.typical_discount_after(0.9, [300, 100], [0.5, 1.0], 1600, 10.0)
    assert got == (1 - alpha) * 0.9 + alpha * 0.625
    assert async_lab.typical_discount_after(0.9, [300, 100], [0.5, 1.0], 1600, 0.0) == 0.9


def test_delayed_nesterov_with_one_merge_per_round_is_torch_nesterov():
    import torch

    torch.manual_seed(0)
    p0 = torch.randn(5)
    grads = [torch.randn(5) for _ in range(4)]
    mine, ref = [p0.clone()], p0.clone().requires_grad_(True)
    opt = async_lab.DelayedWorkClockNesterov(0.7, 0.9)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        opt.step(mine, [g], 1.0)
        ref.grad = g.clone()
        sgd.step()
    assert torch.allclose(mine[0], ref.detach(), atol=1e-6)


def _folding(keep: float, eager: bool = False):
    """A learner's fold state without a model: one tensor, its anchor, a copy that arrived."""
    import types

    import torch

    return types.SimpleNamespace(
        params=[torch.tensor([5.0, -1.0])], anchor=[torch.tensor([4.0, 1.0])], copy=[torch.zeros(2)],
        incoming=(2, 3_000, [torch.tensor([10.0, 10.0])]), version=1, tokens_at_copy=1_000,
        fold_keep=keep, eager=eager, est_move=None, id=0, round_tokens=1_600,
        own_at={1: {0: 400}, 2: {0: 800}},
    )


def test_the_fold_keeps_the_unsent_work_or_the_share_a_candidate_names():
    import torch

    # the default: params <- G + (params - anchor)
    st = _folding(1.0)
    async_lab.Learner.fold(st)
    assert torch.equal(st.params[0], torch.tensor([11.0, 8.0])) and torch.equal(st.anchor[0], torch.tensor([10.0, 10.0]))
    st = _folding(0.5)
    async_lab.Learner.fold(st)
    assert torch.equal(st.params[0], torch.tensor([10.5, 9.0]))
    # 1 / (1 + s): 2,000 tokens merged since the copy, 400 of them this learner's own, so
    # s = 1,600 / 1,600 = one round of others' work and the fold keeps half
    st = _folding(-1.0)
    async_lab.Learner.fold(st)
    assert torch.equal(st.params[0], torch.tensor([10.5, 9.0]))
    assert st.est_move is None  # kept only for the eager candidate
    # the global move per round of work, for the eager candidate: 10 over 2,000 tokens
    st = _folding(1.0, eager=True)
    async_lab.Learner.fold(st)
    assert torch.allclose(st.est_move[0], torch.tensor([8.0, 8.0]))
    assert torch.equal(st.copy[0], torch.tensor([10.0, 10.0]))


def test_the_overlap_candidates_change_training_and_their_defaults_do_not():
    base = async_lab.run(_four())
    assert async_lab.run(_four(fold_keep=1.0, eager=False))["curve"] == base["curve"]
    assert async_lab.run(_four(fold_keep=0.5))["curve"] != base["curve"]
    # moving on eagerly needs two copies of the global model first: a few rounds
    longer = {"tokens": 150_000, "eval_every_tokens": 50_000}
    eager = async_lab.run(_four(eager=True, **longer))
    assert eager["curve"] != async_lab.run(_four(**longer))["curve"]
