"""The built-in workload trains exactly what ddiloco trained before workloads existed.

The committed quality benchmarks (docs/quality.md) stay valid only if the default run's
numerics did not move: the same initial weights, the same batches in the same order, the
same loss, the same evaluation. ``old_*`` below is the former recipe, copied from the
learner, the outer optimizer and ``common.model.evaluate`` as they were; the new path is the
one the services take now (``ddiloco.workloads``). Every comparison is bit for bit."""

from __future__ import annotations

import copy

import torch

from ddiloco.common.config import MODEL_PRESETS, RunConfig
from ddiloco.common.data import ShardSampler, eval_windows, load_corpus
from ddiloco.common.model import build_model, evaluate as old_evaluate, is_embedding
from ddiloco.coordinator.signature import values_digest
from ddiloco.workloads import load
from ddiloco.workloads.evaluate import evaluate

STEPS = 12


def config() -> RunConfig:
    cfg = RunConfig(learners=2, seed=3)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.data.max_bytes = 300_000
    cfg.learner.batch_size = 4
    return cfg


def old_sampler(cfg: RunConfig, shard: int) -> ShardSampler:
    corpus = load_corpus(cfg.data, cfg.learners)
    return ShardSampler(corpus.shards[shard], cfg.model.context, cfg.learner.batch_size, seed=cfg.data.seed + shard)


def train(model, next_loss, cfg: RunConfig) -> list[float]:
    """The learner's inner loop (AdamW, warmup, clipping) over ``next_loss(model)``."""
    lc = cfg.learner
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.95))
    losses = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lc.lr * min(1.0, (step + 1) / max(lc.warmup_steps, 1))
        loss = next_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_initial_weights_are_the_former_build_model():
    cfg = config()
    old = build_model(cfg.model, cfg.seed)
    new = load(cfg).build_model()
    assert [n for n, _ in old.named_parameters()] == [n for n, _ in new.named_parameters()]
    assert values_digest(old) == values_digest(new)


def test_batches_are_the_former_samplers_batches_in_order_from_any_start():
    cfg = config()
    wl = load(cfg)
    for shard in range(cfg.learners):
        sampler = old_sampler(cfg, shard)
        for start in (0, 7):
            it = wl.train_batches(shard, cfg.learners, cfg.data.seed, start)
            for k in range(start, start + 5):
                x, y = next(it)
                ox, oy = sampler.batch(k)
                assert torch.equal(x, ox) and torch.equal(y, oy)


def test_a_few_training_steps_give_the_same_losses_and_parameters_bit_for_bit():
    cfg = config()
    sampler = old_sampler(cfg, 1)
    old_model = build_model(cfg.model, cfg.seed)
    index = iter(range(STEPS))
    old_losses = train(old_model, lambda m: m(*sampler.batch(next(index)))[1], cfg)

    wl = load(cfg)
    new_model = wl.build_model()
    batches = wl.train_batches(1, cfg.learners, cfg.data.seed, 0)
    new_losses = train(new_model, lambda m: wl.loss(m, next(batches)), cfg)

    assert new_losses == old_losses
    for (name, a), (_, b) in zip(old_model.named_parameters(), new_model.named_parameters()):
        assert torch.equal(a, b), name


def test_evaluation_is_the_former_mean_loss_over_the_same_windows():
    cfg = config()
    model = build_model(cfg.model, cfg.seed)
    batches = load(cfg).train_batches(0, cfg.learners, cfg.data.seed, 0)
    train(model, lambda m: load(cfg).loss(m, next(batches)), cfg)  # a model that is not the initial one
    corpus = load_corpus(cfg.data, cfg.learners)
    old_loss, old_acc = old_evaluate(model, eval_windows(corpus.eval_bytes, cfg.model.context, cfg.data.eval_windows))
    new_loss, new_acc = evaluate(load(cfg), model)
    assert new_loss == old_loss
    assert abs(new_acc - old_acc) < 1e-12  # a mean of per-batch accuracies re-weighted: equal up to rounding


def test_step_weight_round_resumption_and_plain_averaged_tensors_are_the_former_ones():
    cfg = config()
    wl = load(cfg)
    per_step = cfg.learner.batch_size * cfg.model.context
    assert wl.reference_weight() == wl.step_weight() == per_step
    assert wl.round_tokens() == cfg.round_tokens()
    # a learner of 2 ranks: a batch weighs the same, a step and a round twice as much
    groups = copy.deepcopy(cfg)
    groups.learner.ranks = 2
    wl2 = load(groups)
    assert (wl2.reference_weight(), wl2.step_weight()) == (per_step, 2 * per_step)
    assert wl2.round_tokens() == groups.round_tokens() == 2 * cfg.learners * cfg.learner.inner_steps * per_step
    # the former resumption: batch = tokens accepted // tokens per step
    for tokens in (0, per_step, 5 * per_step, 5 * per_step + per_step // 2):
        assert wl.batches_before(0, cfg.learners, cfg.data.seed, tokens) == tokens // per_step
    model = wl.build_model()
    assert wl.embedding_names(model) == {n for n, _ in model.named_parameters() if is_embedding(n)}
