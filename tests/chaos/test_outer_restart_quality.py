"""An outer-optimizer restart after a backlog leaves the model no worse than it was at the kill,
checked deterministically: two learners really train the tiny GPT (AdamW, the learners' own
inner loop settings, fixed seeds), the outer optimizer runs in-process on a real folder, and the
crash is the ``OuterState`` being dropped without a clean shutdown (what SIGKILL leaves on disk).

While the outer optimizer is down each learner trains several windows from the same base and
coalesces them into one delta (k x H steps, k x the tokens). After the restart both backlogs
merge; the eval loss of the merged model must not exceed the eval loss at the kill by more than
1% (the restart target). The process-level test beside this one SIGKILLs a real outer service
and checks the mechanics (backlog coalesced, replay, merging resumes, nothing lost); its eval
losses, a second of training on the unigram plateau, move by several per cent between two
evaluations of a fault-free run, so the 1% target is checked here, where nothing is noise.

This fails under the rule that preceded merge.WorkClockNesterov's backlog rule (ceil(f)
ordinary Nesterov steps for a backlog of f rounds)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from ddiloco.common import codec
from ddiloco.common.config import MODEL_PRESETS, RunConfig
from ddiloco.common.data import ShardSampler, eval_windows, load_corpus
from ddiloco.common.model import build_model, evaluate
from ddiloco.common.wire import payload_info
from ddiloco.outer.state import OuterState
from ddiloco.v1 import outer_pb2

H, BATCH = 5, 4
WINDOWS = (7, 8)  # each learner's backlog


def _config() -> RunConfig:
    cfg = RunConfig(run_id="restart-quality", learners=2)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.learner.inner_steps, cfg.learner.batch_size = H, BATCH
    cfg.learner.max_coalesce_windows = 8
    cfg.data.max_bytes = 600_000
    cfg.fragments = 1
    cfg.outer.checkpoint_every = 5
    return cfg


class _Learner:
    """The learner's inner loop (worker.py), one window at a time, without its threads."""

    def __init__(self, cfg: RunConfig, shard: np.ndarray, index: int) -> None:
        torch.manual_seed(cfg.seed + index)
        self.model = build_model(cfg.model, cfg.seed)
        self.params = list(self.model.parameters())
        lcfg = cfg.learner
        self.optimizer = torch.optim.AdamW(self.params, lr=lcfg.lr, weight_decay=lcfg.weight_decay, betas=(0.9, 0.95))
        self.sampler = ShardSampler(shard, cfg.model.context, BATCH, seed=cfg.data.seed + index)
        self.cfg, self.id, self.step, self.seq = cfg, index, 0, 0

    @torch.no_grad()
    def load(self, state: OuterState) -> int:
        for p, g in zip(self.params, state.params):
            p.copy_(g)
        return state.version

    def train(self, windows: int) -> list[tuple[str, np.ndarray]]:
        """k windows from the loaded base: the delta base - local, as the learner sends it."""
        lcfg = self.cfg.learner
        anchor = [p.detach().clone() for p in self.params]
        for _ in range(windows * H):
            x, y = self.sampler.batch(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lcfg.lr * min(1.0, (self.step + 1) / max(lcfg.warmup_steps, 1))
            _, loss = self.model(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, lcfg.grad_clip)
            self.optimizer.step()
            self.step += 1
        names = [n for n, _ in self.model.named_parameters()]
        return [(n, (a - p.detach()).numpy()) for n, a, p in zip(names, anchor, self.params)]

    def push(self, state: OuterState, arrays, base: int, windows: int) -> None:
        self.seq += 1
        enc = codec.encode(arrays, "int8", 64)
        header = outer_pb2.DeltaHeader(
            run_id=self.cfg.run_id, learner_id=self.id, base_version=base, seq=self.seq, inner_steps=windows * H,
            tokens=windows * H * BATCH * self.cfg.model.context, payload=payload_info(enc),
        )
        state.accept(header, enc.payload)


def _loss(cfg: RunConfig, state: OuterState, windows: torch.Tensor) -> float:
    model = build_model(cfg.model, cfg.seed)
    with torch.no_grad():
        for p, g in zip(model.parameters(), state.params):
            p.copy_(g)
    return evaluate(model, windows)[0]


@pytest.fixture
def one_thread():
    """The same floating-point sums whatever other tests set (limit_threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ceil_substeps(optimizer) -> None:
    """The former backlog rule, ceil(f) ordinary Nesterov steps, to show this check can fail."""
    step = optimizer.step
    optimizer.step = lambda params, grads, fraction, staleness=0.0: sum(
        step(params, grads, 1.0, staleness) for _ in range(math.ceil(fraction))
    )


# early (on the unigram plateau) and later (past it); the backlogs are 7 and 8 windows, up
# to the coalescing bound: a long outage. Measured margins (1 and 2 threads, two hosts): the
# current rule -0.9% to -3.3%; the former +5.2% to +10.9% at 20 rounds, and at 150 rounds
# +2.9% on one host but -0.7% on another (the same seeds: 150 rounds of training carry the
# CPU's floating-point kernels into the trajectory), so the former rule is shown to fail
# at 20 rounds only.
@pytest.mark.parametrize(("rounds", "show_the_former_rule_fails"), [(20, True), (150, False)])
def test_a_backlog_merged_after_a_restart_leaves_the_model_no_worse(tmp_path, rounds, show_the_former_rule_fails, one_thread):
    cfg = _config()
    corpus = load_corpus(cfg.data, cfg.learners)
    held_out = eval_windows(corpus.eval_bytes, cfg.model.context, cfg.data.eval_windows)
    state = OuterState(cfg, tmp_path / "run")
    learners = [_Learner(cfg, corpus.shards[i], i) for i in range(2)]
    for _ in range(rounds):  # ordinary rounds: both windows from the same version, merged together
        for lr in learners:
            base = lr.load(state)
            lr.push(state, lr.train(1), base, 1)
        assert state.merge(0)
    # the outage: each learner trains a backlog from the last version it holds; learner 0's
    # reaches the outer optimizer (acknowledged, journaled, not merged) just before the kill
    backlog = {lr.id: (lr.load(state), lr.train(WINDOWS[lr.id])) for lr in learners}
    learners[0].push(state, backlog[0][1], backlog[0][0], WINDOWS[0])
    killed_at, at_kill = state.version, [p.clone() for p in state.params]
    del state  # the crash
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # the same disk, for the former rule

    restarted = OuterState(cfg, tmp_path / "run")
    assert restarted.version == killed_at
    assert all(torch.equal(a, b) for a, b in zip(at_kill, restarted.params)), "the model at the kill, bit for bit"
    before = _loss(cfg, restarted, held_out)
    learners[1].push(restarted, backlog[1][1], backlog[1][0], WINDOWS[1])
    assert restarted.merge(0)
    merged = restarted.version
    after = _loss(cfg, restarted, held_out)
    assert merged == killed_at + 1
    assert after <= before * 1.01, f"eval loss {before:.4f} at the kill, {after:.4f} after the backlog merged"

    if show_the_former_rule_fails:
        former = OuterState(cfg, tmp_path / "copy")
        _ceil_substeps(former.fragments[0].optimizer)
        learners[1].seq -= 1  # the same delta again, to the other copy of the outer optimizer
        learners[1].push(former, backlog[1][1], backlog[1][0], WINDOWS[1])
        assert former.merge(0)
        worse = _loss(cfg, former, held_out)
        assert worse > before * 1.01, f"the former rule: {before:.4f} at the kill, {worse:.4f} after; this check has no teeth"
