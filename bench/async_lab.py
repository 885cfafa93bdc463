#!/usr/bin/env python3
"""A deterministic laboratory for the asynchronous merge: M learners, one outer optimizer,
virtual time, real torch training, in one process.

Why it exists: on a 2-core machine a real run of 8 or 16 learner processes is dominated by
CPU contention, so arrival order, grace windows and staleness change with the machine's
load and two runs of the same code differ by more than the effects being studied. Here the
clock is virtual: each learner's step takes a configured time (seeded jitter, optional slow
learners), uploads, merges and downloads take configured latencies, and the training itself
is real (the project's model, data shards, AdamW inner loop, codec with error feedback,
fold rule, and the outer optimizer's own merge functions from ``ddiloco.common.merge``).
The same configuration gives the same losses to the last bit, whatever else the machine
does, so candidate rules can be compared one at a time.

What it leaves out, on purpose: gRPC, the journal and checkpoints, fragments (P = 1), the
uploader's coalescing (uploads here are faster than a window), leases and failures.
Its grace window is the rule of the time of its findings, ``grace_gamma`` x (overlap x
step - (upload + merge)), not the outer optimizer's current one (``ddiloco.outer.timing``):
with one fixed step time and jitter the two differ only in how long a late learner is
waited for, and the findings table stays reproducible. Likewise its staleness discount is
by default the former rule (``discount_rule="one-round"``: free up to one round, then
1/s); ``inverse`` is the outer optimizer's rule (``merge.plan_merge``: 1/(1+s));
``relative`` is 1/(1+s) relative to the run's typical discount, a rule tried and rejected.

Disorder: ``stall_rate`` > 0 makes learners stall now and then (a descheduled process, a
loaded host): bursts of disorder, which real runs on a shared machine have and a fixed
jitter does not. ``upload_spread`` > 0 makes every upload take a random extra time (an
exponential, mean in windows): disorder as the steady state, as 16 learner processes on
2 cores have.

    python bench/async_lab.py --discount-findings --jobs 2   # the staleness-discount table -> bench/results/async_lab_discount.json
    python bench/async_lab.py --disorder-findings --jobs 2     # the steady-disorder table -> bench/results/async_lab_disorder.json
    python bench/async_lab.py --quorum-findings --jobs 2       # the quorum table -> bench/results/async_lab_quorum.json
    python bench/async_lab.py --overlap-findings --jobs 2      # the overlap table -> bench/results/async_lab_overlap.json

    python bench/async_lab.py --learners 8 --tokens 12000000 --variant sync --variant ddiloco
    python bench/async_lab.py --list-variants
    python bench/async_lab.py --findings --jobs 2    # docs/algorithm.md's table -> bench/results/async_lab.json

Writes one JSON object per variant to stdout (or ``--out FILE``): final eval loss, the curve,
deltas per merge, staleness, effective step per round of work, momentum norm, and the cosine
between each merged direction and the synchronous direction of the same round of work.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "services"))
sys.path.insert(0, str(ROOT / "bench"))

from ddiloco.common import codec as codec_mod  # noqa: E402
from ddiloco.common import merge  # noqa: E402
from ddiloco.common.config import MODEL_PRESETS, RunConfig  # noqa: E402
from ddiloco.common.data import ShardSampler, eval_windows, load_corpus  # noqa: E402
from ddiloco.common.model import build_model, evaluate, is_embedding  # noqa: E402


@dataclass
class LabConfig:
    learners: int = 8
    inner_steps: int = 20
    batch_size: int = 8
    tokens: int = 2_000_000  # total learner work, all learners together
    codec: str = "int8"
    seed: int = 0
    # the algorithm
    sync: bool = False  # synchronous DiLoCo: every learner waits for the merge of its window
    quorum: int = 1  # 0: half the learners, rounded up (the outer optimizer's default now)
    grace_gamma: float = 0.5
    overlap_steps: int = 0  # 0: H
    staleness_gain: float = 0.0
    max_staleness_rounds: float = 4.0
    align: bool = True  # phase alignment: a learner whose delta waited for peers ends its next window later
    pull_rule: str = "own"  # own: pull when own delta merged (or 2 rounds behind); every: after every merge
    # virtual timing (seconds)
    step_s: float = 0.02
    jitter: float = 0.1  # relative standard deviation of a step's time
    # learners start this many windows apart at most (uniform): processes and sites do not
    # start in lockstep, so windows end at different phases
    start_spread: float = 1.0
    slow: dict[int, float] = field(default_factory=dict)  # learner -> slowdown factor
    # disorder: a learner stalls now and then (a descheduled process, a GC pause, a loaded
    # host), on average ``stall_rate`` times per window, each stall lasting ``stall_steps``
    # steps' time. Drawn from a stream of its own, so 0 leaves every other draw unchanged.
    stall_rate: float = 0.0
    stall_steps: float = 10.0
    # steady disorder: each upload takes an extra time drawn from an exponential of mean
    # ``upload_spread`` windows (a link or a host whose speed varies from window to window:
    # 16 learner processes on 2 cores, uploads over TLS), so deltas arrive out of phase all
    # run long, which phase alignment cannot undo. A learner's uploads stay in order.
    upload_spread: float = 0.0
    # how a delta's weight falls with staleness s (rounds of others' work since its base):
    # "one-round" (the former rule: 1 up to one round, then 1/s), "inverse" (1/(1+s), the
    # outer optimizer's merge.plan_merge), "relative" (1/(1+s) relative to the run's typical
    # discount over ``memory_rounds``: typical_discount_after; rejected)
    discount_rule: str = "one-round"
    memory_rounds: float = 10.0
    # the outer optimizer: "nesterov" (merge.WorkClockNesterov, the outer optimizer's) or
    # "delayed" (DelayedWorkClockNesterov: momentum once per round of work, a candidate)
    outer_rule: str = "nesterov"
    # eager: at a window's end the learner moves on by the global model's last move per round of
    # work (from its own last two copies), so the steps it trains while its merge is in flight
    # start near where the merge will put the model, instead of one outer step behind
    eager: bool = False
    # the share of the steps trained on the old base that a fold keeps; -1: 1 / (1 + s), s the
    # rounds of other learners' work the new copy holds beyond the old one
    fold_keep: float = 1.0
    upload_s: float = 0.02
    merge_s: float = 0.005
    download_s: float = 0.02  # long-polled status + transfer (0.07 with a 0.1 s status poll)
    eval_every_tokens: int = 500_000
    eval_windows: int = 256


# Each variant changes one thing from ddiloco's defaults (``ddiloco``).
VARIANTS: dict[str, dict] = {
    "sync": {"sync": True, "codec": "fp32", "align": False},
    "ddiloco": {},
    "no-align": {"align": False},
    "no-align-poll": {"align": False, "download_s": 0.07},
    "no-align-poll-gain-2": {"align": False, "download_s": 0.07, "staleness_gain": 2.0},
    "staleness-gain-2": {"staleness_gain": 2.0},
    "grace-0": {"grace_gamma": 0.0},
    "no-align-grace-0": {"align": False, "grace_gamma": 0.0},
    "quorum-all": {"quorum": 10**6},
    "fp32": {"codec": "fp32"},
    "instant-wire": {"upload_s": 0.0, "merge_s": 0.0, "download_s": 0.0},
    "sync-stalls": {"sync": True, "codec": "fp32", "align": False, "stall_rate": 0.1},
    "stalls": {"stall_rate": 0.1},
    "stalls-inverse": {"stall_rate": 0.1, "discount_rule": "inverse"},
    "inverse": {"discount_rule": "inverse"},
    "no-align-inverse": {"align": False, "discount_rule": "inverse"},
    "grace-0-inverse": {"grace_gamma": 0.0, "discount_rule": "inverse"},
    "relative": {"discount_rule": "relative"},
    "stalls-relative": {"stall_rate": 0.1, "discount_rule": "relative"},
    "spread": {"upload_spread": 0.5},
    "spread-inverse": {"upload_spread": 0.5, "discount_rule": "inverse"},
    "spread-relative": {"upload_spread": 0.5, "discount_rule": "relative"},
    "delayed": {"discount_rule": "inverse", "outer_rule": "delayed"},
    "spread-delayed": {"upload_spread": 0.5, "discount_rule": "inverse", "outer_rule": "delayed"},
    # the quorum under steady disorder (upload_spread 0.25: as much staleness as the real M = 16
    # runs had), all with the discount 1/(1+s); "half" is the outer optimizer's default now
    "spread25-inverse": {"upload_spread": 0.25, "discount_rule": "inverse"},
    "spread25-grace-1": {"upload_spread": 0.25, "discount_rule": "inverse", "grace_gamma": 1.0},
    "spread25-quorum-4": {"upload_spread": 0.25, "discount_rule": "inverse", "quorum": 4},
    "spread25-half": {"upload_spread": 0.25, "discount_rule": "inverse", "quorum": 0},
    "spread25-quorum-all": {"upload_spread": 0.25, "discount_rule": "inverse", "quorum": 10**6},
    "half": {"discount_rule": "inverse", "quorum": 0},
    # the overlap candidates: what a learner does with the steps it trains on the old base while
    # its merge is in flight, at the lab's latencies and with slower uploads and downloads
    # ("slowwire": about three steps more overlap)
    "half-eager": {"discount_rule": "inverse", "quorum": 0, "eager": True},
    "half-keep-half": {"discount_rule": "inverse", "quorum": 0, "fold_keep": 0.5},
    "half-keep-stale": {"discount_rule": "inverse", "quorum": 0, "fold_keep": -1},
    "half-slowwire": {"discount_rule": "inverse", "quorum": 0, "upload_s": 0.05, "download_s": 0.05},
    "half-slowwire-eager": {"discount_rule": "inverse", "quorum": 0, "upload_s": 0.05, "download_s": 0.05,
                            "eager": True},
    "half-slowwire-keep-half": {"discount_rule": "inverse", "quorum": 0, "upload_s": 0.05, "download_s": 0.05,
                                "fold_keep": 0.5},
    "half-slowwire-keep-stale": {"discount_rule": "inverse", "quorum": 0, "upload_s": 0.05, "download_s": 0.05,
                                 "fold_keep": -1},
    "stalls-half": {"stall_rate": 0.1, "discount_rule": "inverse", "quorum": 0},
}

# The staleness-discount findings of docs/algorithm.md: each variant with the former rule
# and with 1/(1+s), at M = 4 and 8 (3M tokens).
DISCOUNT_FINDINGS = [
    (4, 3_000_000, ["sync", "ddiloco", "inverse", "stalls", "stalls-inverse", "no-align", "no-align-inverse",
                    "grace-0", "grace-0-inverse"]),
    (8, 3_000_000, ["sync", "ddiloco", "inverse", "stalls", "stalls-inverse"]),
]

# The steady-disorder findings of docs/algorithm.md: the discount 1/(1+s) against the
# former rule and against the same discount relative to the run's typical one
# (``relative``), calm, with bursts of disorder (stalls, M = 4) and with steady disorder
# (upload spread, M = 16), early (3M tokens) and over long training (12M). The long runs
# come first so that two jobs finish together.
DISORDER_FINDINGS = [
    (16, 12_000_000, ["sync", "spread", "spread-inverse", "spread-relative"]),
    (16, 3_000_000, ["sync", "inverse", "relative", "spread-inverse", "spread-relative"]),
    (4, 3_000_000, ["sync", "inverse", "relative", "stalls-inverse", "stalls-relative"]),
]

# The quorum findings of docs/algorithm.md ("Quorum under steady disorder"): K = 1, a longer
# grace window, K = 4, K = M/2 and K = M with steady disorder at M = 16, two seeds (seed 1 is
# the one where synchronous DiLoCo runs far ahead, in the real system too); and K = M/2
# against K = 1 calm at M = 16 and 8 and with stalls at M = 4. (learners, tokens, variants, seeds)
QUORUM_FINDINGS = [
    (16, 12_000_000, ["sync", "spread25-inverse", "spread25-grace-1", "spread25-quorum-4", "spread25-half",
                      "spread25-quorum-all"], (0, 1)),
    (16, 12_000_000, ["inverse", "half"], (1,)),
    (8, 12_000_000, ["sync", "inverse", "half"], (0,)),
    (4, 12_000_000, ["sync", "stalls-inverse", "stalls-half"], (0,)),
]

# The overlap findings of docs/algorithm.md ("The overlap: two candidates rejected"): the
# default rule against moving on eagerly and against keeping only part of the overlap's steps,
# at the lab's latencies and with about three steps more overlap, M = 4, 12M tokens, seed 0.
OVERLAP_FINDINGS = [
    (4, 12_000_000, ["sync", "half", "half-eager", "half-keep-half", "half-keep-stale", "half-slowwire",
                     "half-slowwire-eager", "half-slowwire-keep-half", "half-slowwire-keep-stale"]),
]

# The findings of docs/algorithm.md: (learners, tokens, variants).
FINDINGS = [
    (8, 3_000_000, ["sync", "ddiloco", "no-align", "no-align-poll", "no-align-poll-gain-2", "staleness-gain-2",
                    "no-align-grace-0", "quorum-all", "fp32", "instant-wire"]),
    (16, 3_000_000, ["sync", "ddiloco", "no-align"]),
    (8, 12_000_000, ["sync", "ddiloco"]),
]


class Learner:
    def __init__(self, i: int, cfg: RunConfig, lab: LabConfig, shard: np.ndarray, rng: np.random.Generator) -> None:
        self.id = i
        self.model = build_model(cfg.model, cfg.seed)
        self.params = list(self.model.parameters())
        self.names = [n for n, _ in self.model.named_parameters()]
        lcfg = cfg.learner
        self.opt = torch.optim.AdamW(self.params, lr=lcfg.lr, weight_decay=lcfg.weight_decay, betas=(0.9, 0.95))
        self.sampler = ShardSampler(shard, cfg.model.context, lab.batch_size, seed=cfg.data.seed + i)
        self.anchor = [p.detach().clone() for p in self.params]
        self.version = 0
        self.tokens_at_copy = 0
        self.merged_mine = 0
        self.step = 0
        self.window_steps = 0
        self.incoming: tuple[int, int, list[torch.Tensor]] | None = None
        self.ef = codec_mod.ErrorFeedback()
        self.rng = rng
        self.stall_rng = np.random.default_rng([cfg.seed, i, 7])
        self.upload_rng = np.random.default_rng([cfg.seed, i, 11])
        self.last_arrival = 0.0
        self.slow = lab.slow.get(i, 1.0)
        self.waiting = False
        self.extra = 0  # steps added to the current window (phase alignment)
        self.lcfg = lcfg
        # the overlap candidates (``eager``, ``fold_keep``)
        self.eager, self.fold_keep, self.round_tokens = lab.eager, lab.fold_keep, cfg.round_tokens()
        self.own_at: dict[int, dict[int, int]] = {0: {}}  # set by run(): own merged tokens per version
        # eager only: the latest global copy, and the global move per round of work last seen
        self.copy = [p.detach().clone() for p in self.params] if lab.eager else []
        self.est_move: list[torch.Tensor] | None = None

    def step_time(self, lab: LabConfig) -> float:
        t = lab.step_s * self.slow * max(0.2, 1.0 + lab.jitter * float(self.rng.standard_normal()))
        if lab.stall_rate > 0 and self.stall_rng.random() < lab.stall_rate / lab.inner_steps:
            t += lab.stall_steps * lab.step_s
        return t

    def upload_time(self, lab: LabConfig, now: float) -> float:
        """When this learner's upload started ``now`` arrives: after its previous one."""
        t = now + lab.upload_s
        if lab.upload_spread > 0:
            t += float(self.upload_rng.exponential(lab.upload_spread * lab.inner_steps * lab.step_s))
        self.last_arrival = max(t, self.last_arrival + 1e-6)
        return self.last_arrival

    @torch.no_grad()
    def fold(self) -> None:
        if self.incoming is None:
            return
        version, tokens, g = self.incoming
        self.incoming = None
        if version <= self.version:
            return
        keep = self.fold_keep
        if keep < 0:
            own = self.own_at[version].get(self.id, 0) - self.own_at[self.version].get(self.id, 0)
            keep = 1.0 / (1.0 + max(0.0, (tokens - self.tokens_at_copy - own) / self.round_tokens))
        for p, a, gt in zip(self.params, self.anchor, g):
            if keep != 1.0:
                p.sub_(a).mul_(keep).add_(a)
            p.add_(gt - a)
            a.copy_(gt)
        if self.eager:
            between = tokens - self.tokens_at_copy
            if between > 0 and self.tokens_at_copy > 0:
                self.est_move = [(gt - c) * (self.round_tokens / between) for gt, c in zip(g, self.copy)]
            for c, gt in zip(self.copy, g):
                c.copy_(gt)
        self.version, self.tokens_at_copy = version, tokens

    def train_step(self) -> None:
        x, y = self.sampler.batch(self.step)
        lr = self.lcfg.lr * min(1.0, (self.step + 1) / max(self.lcfg.warmup_steps, 1))
        for group in self.opt.param_groups:
            group["lr"] = lr
        _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.lcfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.window_steps += 1

    @torch.no_grad()
    def end_window(self, codec: str, block: int) -> list[torch.Tensor]:
        arrays = [(n, (a - p).numpy().copy()) for n, a, p in zip(self.names, self.anchor, self.params)]
        for a, p in zip(self.anchor, self.params):
            a.copy_(p)
        if self.est_move is not None:
            for a, p, e in zip(self.anchor, self.params, self.est_move):
                p.add_(e)
                a.add_(e)
        if codec == "fp32":
            return [torch.from_numpy(x) for _, x in arrays]
        enc = self.ef.encode(arrays, codec, block)
        dec = codec_mod.decode_encoded(enc)
        return [torch.from_numpy(np.ascontiguousarray(x)) for _, x in dec]


def staleness_discount(rule: str, rounds: float) -> float:
    """A delta's weight at ``rounds`` of others' work behind (already capped at the bound)."""
    if rule == "one-round":  # the former rule: free for one round, then 1/rounds
        return 1.0 if rounds <= 1.0 else 1.0 / rounds
    if rule == "inverse":
        return 1.0 / (1.0 + rounds)
    raise ValueError(f"unknown discount rule {rule!r}")


def typical_discount_after(typical: float, tokens: list[int], discounts: list[float], round_tokens: int,
                           memory_rounds: float) -> float:
    """The ``relative`` rule's typical discount once a merge is in: an exponential average,
    over merged work with a horizon of ``memory_rounds`` rounds, of the merge's
    token-weighted discount. The rule counts each delta's work at its discount divided by
    the typical one, so that in any steady state of disorder the outer step per round of
    work is the synchronous one. Tried as the outer optimizer's rule and rejected: it
    lost quality wherever disorder was the steady state (docs/algorithm.md)."""
    total = sum(tokens)
    if memory_rounds <= 0 or total <= 0:
        return typical
    mean = sum(t * d for t, d in zip(tokens, discounts)) / total
    alpha = 1.0 - math.exp(-total / max(round_tokens, 1) / memory_rounds)
    return (1.0 - alpha) * typical + alpha * mean


class DelayedWorkClockNesterov:
    """Nesterov momentum taken once per round of work, as Delayed Nesterov (Asynchronous
    Local-SGD, Liu et al. 2024) takes it once per N updates. Each merge applies its own
    direction plainly, ``lr * f * g``; once a round of work has been merged, the buffer takes
    the round's average direction, ``buf <- m * buf + mean(g)``, and the model moves by its
    extrapolation, ``lr * m * buf`` (times the rounds merged). One merge of every learner
    per round is exactly ``torch.optim.SGD(nesterov=True)``; a stale delta still moves the
    model by its own (discounted) share but is extrapolated only within its round's average.
    A candidate, measured in the laboratory only."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum
        self.buffers: list[torch.Tensor] | None = None
        self.acc: list[torch.Tensor] | None = None
        self.work = 0.0

    @torch.no_grad()
    def step(self, params, grads, fraction: float, staleness: float = 0.0) -> float:
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p) for p in params]
            self.acc = [torch.zeros_like(p) for p in params]
        before = [p.clone() for p in params]
        for p, g, a in zip(params, grads, self.acc):
            p.sub_(g, alpha=self.lr * fraction)
            a.add_(g, alpha=fraction)
        self.work += fraction
        if self.work >= 1.0 - 1e-9:
            for p, b, a in zip(params, self.buffers, self.acc):
                b.mul_(self.momentum).add_(a, alpha=1.0 / self.work)
                p.sub_(b, alpha=self.lr * self.momentum * self.work)
                a.zero_()
            self.work = 0.0
        return math.sqrt(sum(float(((p - q) ** 2).sum()) for p, q in zip(params, before)))


@dataclass
class Delta:
    learner: int
    base_version: int
    steps: int
    tokens: int
    tensors: list[torch.Tensor]
    compute_s: float
    arrived: float = 0.0


def run(lab: LabConfig, log=None) -> dict:
    torch.manual_seed(lab.seed)
    torch.set_num_threads(1)
    cfg = RunConfig(learners=lab.learners, seed=lab.seed)
    # a seed means what it means in bench/quality_scale.py: the initial model and the order the
    # shards are read in (seed 0 leaves the data seed at its default, as every committed table has it)
    cfg.data.seed += lab.seed
    cfg.outer.quorum = lab.quorum  # 0: the outer optimizer's default, RunConfig.merge_quorum
    cfg.model = dataclasses.replace(MODEL_PRESETS["tiny"])
    cfg.learner.inner_steps = lab.inner_steps
    cfg.learner.batch_size = lab.batch_size
    cfg.learner.codec = lab.codec
    h, m = lab.inner_steps, lab.learners
    round_tokens = cfg.round_tokens()
    per_step = lab.batch_size * cfg.model.context
    corpus = load_corpus(cfg.data, m)
    windows = eval_windows(corpus.eval_bytes, cfg.model.context, lab.eval_windows)
    eval_model = build_model(cfg.model, cfg.seed)
    rng = np.random.default_rng(lab.seed)
    learners = [Learner(i, cfg, lab, corpus.shards[i], np.random.default_rng([lab.seed, i])) for i in range(m)]
    glob = [p.detach().clone() for p in eval_model.parameters()]
    names = [n for n, _ in eval_model.named_parameters()]
    plain = [is_embedding(n) for n in names]
    opt = (DelayedWorkClockNesterov(cfg.outer.lr, cfg.outer.momentum) if lab.outer_rule == "delayed"
           else merge.WorkClockNesterov(cfg.outer.lr, cfg.outer.momentum, True))
    version, tokens_merged = 0, 0
    tokens_at_version = {0: 0}
    own_at_version: dict[int, dict[int, int]] = {0: {}}
    for lr_ in learners:
        lr_.own_at = own_at_version  # a fold's staleness rule reads its own merged work per version
    own_merged = [0] * m
    pending: list[Delta] = []
    quorum_since: float | None = None
    overlap = lab.overlap_steps or h

    events: list = []
    counter = itertools.count()

    def push(t, kind, data=None):
        heapq.heappush(events, (t, next(counter), kind, data))

    for lr_ in learners:
        offset = float(rng.uniform(0, lab.start_spread * h * lab.step_s)) if lr_.id else 0.0
        push(offset + lr_.step_time(lab), "step", lr_.id)

    trained = 0
    curve: list[list[float]] = []
    merges: list[dict] = []
    typical = 1.0  # the run's typical staleness discount ("relative")
    next_eval = 0
    grace_timer_at: float | None = None
    # sync reference direction of the current round of work: the mean of each learner's
    # latest window (measures how far a merge's direction is from what sync would use)
    latest_delta: dict[int, list[torch.Tensor]] = {}

    def do_eval(t):
        with torch.no_grad():
            for p, g in zip(eval_model.parameters(), glob):
                p.copy_(g)
        loss, acc = evaluate(eval_model, windows)
        curve.append([tokens_merged, loss, acc, t])
        if log:
            log(f"t={t:8.1f}s tokens={tokens_merged:>10} v={version:>5} loss={loss:.4f}")
        return loss

    do_eval(0.0)
    next_eval = lab.eval_every_tokens

    def rounds_behind(d: Delta) -> float:
        own_now = own_merged[d.learner]
        own_then = own_at_version.get(d.base_version, {}).get(d.learner, 0)
        others = (tokens_merged - tokens_at_version[d.base_version]) - (own_now - own_then)
        return merge.staleness_rounds(others, 0, round_tokens)

    def do_merge(t):
        nonlocal pending, version, tokens_merged, quorum_since, next_eval, typical
        batch, pending = pending, []
        quorum_since = None
        if lab.discount_rule == "one-round":
            infos, stale = [], []
            for d in batch:
                r = rounds_behind(d)
                disc = staleness_discount(lab.discount_rule, min(r, lab.max_staleness_rounds))
                stale.append(min(r, lab.max_staleness_rounds))
                infos.append(merge.DeltaInfo(d.tokens, d.steps, disc))
            weights = merge.token_weights(infos)
            fraction = merge.work_fraction(infos, round_tokens)
            s_mean = lab.staleness_gain * sum(w * s for w, s in zip(weights, stale))
        else:  # the outer optimizer's own plan ("inverse")
            behind = [rounds_behind(d) for d in batch]
            plan = merge.plan_merge([merge.Waiting(d.tokens, d.steps, r) for d, r in zip(batch, behind)], round_tokens,
                                    lab.max_staleness_rounds, True, lab.staleness_gain)
            weights, fraction, stale, s_mean = plan.weights, plan.fraction, plan.staleness, plan.mean_staleness
            if lab.discount_rule == "relative":
                discounts = [merge.staleness_discount(r, lab.max_staleness_rounds, clamp=True) for r in behind]
                fraction = fraction / typical
                typical = typical_discount_after(typical, [d.tokens for d in batch], discounts, round_tokens,
                                                 lab.memory_rounds)
        tensors = [d.tensors if d.steps == h else [x * (h / d.steps) for x in d.tensors] for d in batch]
        direction = merge.combine(tensors, weights, "weighted", plain)
        ref = [sum(latest_delta[i][k] for i in latest_delta) / len(latest_delta) for k in range(len(glob))]
        dot = sum(float((a * b).sum()) for a, b in zip(direction, ref))
        na = math.sqrt(sum(float((a * a).sum()) for a in direction))
        nb = math.sqrt(sum(float((b * b).sum()) for b in ref))
        before = [g.clone() for g in glob]
        opt.step(glob, direction, fraction, s_mean)
        moved = math.sqrt(sum(float(((g - b) ** 2).sum()) for g, b in zip(glob, before)))
        version += 1
        for d in batch:
            own_merged[d.learner] += d.tokens
            tokens_merged += d.tokens
        tokens_at_version[version] = tokens_merged
        own_at_version[version] = {i: own_merged[i] for i in range(m)}
        merges.append({
            "t": round(t, 4), "deltas": len(batch), "fraction": fraction, "staleness": stale, "typical": typical,
            "cosine_to_sync": dot / (na * nb) if na > 0 and nb > 0 else 0.0,
            "move_per_round": moved / fraction if fraction > 0 else 0.0,
            "momentum_norm": math.sqrt(sum(float((b * b).sum()) for b in opt.buffers)),
        })
        snap = (version, tokens_merged, [g.clone() for g in glob])
        merged_ids = {d.learner for d in batch}
        last = max(d.arrived for d in batch)
        leads = {d.learner: last - d.arrived for d in batch}
        for lr_ in learners:
            wants = lr_.id in merged_ids or lab.pull_rule == "every" or (
                tokens_merged - lr_.tokens_at_copy >= 2 * round_tokens
            )
            if wants:
                push(t + lab.merge_s + lab.download_s, "pull", (lr_.id, snap, leads.get(lr_.id)))
        if tokens_merged >= next_eval:
            do_eval(t)
            next_eval += lab.eval_every_tokens

    def maybe_merge(t):
        nonlocal quorum_since, grace_timer_at
        distinct = len({d.learner for d in pending})
        k = merge.quorum_size(m if lab.sync else cfg.merge_quorum(), m)
        if distinct < k:
            quorum_since = None
            return
        if quorum_since is None:
            quorum_since = t
        step_s = lab.step_s
        grace = 0.0 if lab.sync else max(0.0, lab.grace_gamma * (overlap * step_s - (lab.upload_s + lab.merge_s)))
        if distinct >= m or t >= quorum_since + grace - 1e-9:
            do_merge(t)
        elif grace_timer_at is None or grace_timer_at < t:
            grace_timer_at = quorum_since + grace
            push(grace_timer_at, "grace", None)

    budget = lab.tokens
    wall0 = time.monotonic()
    while events:
        t, _, kind, data = heapq.heappop(events)
        if kind == "step":
            lr_ = learners[data]
            if lr_.window_steps == 0 and lr_.step * per_step >= budget / m:
                continue  # each learner does its share of the budget, in whole windows
            lr_.fold()
            lr_.train_step()
            trained += per_step
            if lr_.window_steps >= h + lr_.extra:
                tens = lr_.end_window(lab.codec, cfg.learner.block_size)
                latest_delta[lr_.id] = tens
                d = Delta(lr_.id, lr_.version, lr_.window_steps, lr_.window_steps * per_step, tens, 0.0)
                lr_.window_steps = 0
                lr_.extra = 0
                push(lr_.upload_time(lab, t), "arrive", d)
                if lab.sync:
                    lr_.waiting = True
                    continue
            push(t + lr_.step_time(lab), "step", lr_.id)
        elif kind == "arrive":
            data.arrived = t
            pending.append(data)
            maybe_merge(t)
        elif kind == "grace":
            grace_timer_at = None
            if pending:
                maybe_merge(t)
        elif kind == "pull":
            i, snap, lead = data
            if lab.align and lead is not None:
                # end the next window later by half the time this learner's delta waited for
                # the peers it was merged with (damped), at most H/2 steps
                lr_ = learners[i]
                lr_.extra = min(h // 2, int(round(lead / 2 / lab.step_s)))
            lr_ = learners[i]
            lr_.incoming = snap if lr_.incoming is None or snap[0] > lr_.incoming[0] else lr_.incoming
            if lr_.waiting:
                lr_.waiting = False
                push(t + lr_.step_time(lab), "step", lr_.id)
        if not events and pending:
            do_merge(t)  # drain: what was trained is merged
    # every learner stops at a window boundary once it did its share, so all work is merged
    final_loss = do_eval(t) if curve[-1][0] != tokens_merged else curve[-1][1]
    stal = [s for mg in merges for s in mg["staleness"]]
    rows = {
        "config": dataclasses.asdict(lab),
        "final_eval_loss": final_loss,
        "final_eval_accuracy": curve[-1][2],
        "tokens_merged": tokens_merged,
        "merges": len(merges),
        "deltas_per_merge_mean": float(np.mean([mg["deltas"] for mg in merges])),
        "staleness_mean": float(np.mean(stal)) if stal else 0.0,
        # outer steps applied per round of work merged: 1.0 is synchronous DiLoCo's
        "fraction_per_round": sum(mg["fraction"] for mg in merges) / (tokens_merged / round_tokens),
        "typical_discount_last": typical,
        "cosine_to_sync_mean": float(np.mean([mg["cosine_to_sync"] for mg in merges])),
        "move_per_round_mean": float(np.mean([mg["move_per_round"] for mg in merges[len(merges) // 2 :]])),
        "momentum_norm_last": merges[-1]["momentum_norm"] if merges else 0.0,
        "virtual_seconds": t,
        "cpu_seconds": round(time.monotonic() - wall0, 1),
        "curve": [[c[0], round(c[1], 5)] for c in curve],
    }
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help=f"one of {sorted(VARIANTS)} (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a LabConfig field (JSON value)")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--list-variants", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--findings", action="store_true", help="run the grid of docs/algorithm.md (FINDINGS)")
    ap.add_argument("--discount-findings", action="store_true",
                    help="run the staleness-discount grid of docs/algorithm.md (DISCOUNT_FINDINGS)")
    ap.add_argument("--quorum-findings", action="store_true",
                    help="the quorum grid of docs/algorithm.md (QUORUM_FINDINGS; its own seeds)")
    ap.add_argument("--disorder-findings", action="store_true",
                    help="run the steady-disorder grid of docs/algorithm.md (DISORDER_FINDINGS)")
    ap.add_argument("--overlap-findings", action="store_true",
                    help="the overlap grid of docs/algorithm.md (OVERLAP_FINDINGS)")
    ap.add_argument("--jobs", type=int, default=1, help="variants run in parallel processes (results do not depend on it)")
    ap.add_argument("--allow-dirty", action="store_true")
    args = ap.parse_args()
    if args.list_variants:
        print(json.dumps(VARIANTS, indent=1))
        return 0
    named = {"findings": FINDINGS, "discount_findings": DISCOUNT_FINDINGS, "disorder_findings": DISORDER_FINDINGS,
             "quorum_findings": QUORUM_FINDINGS, "overlap_findings": OVERLAP_FINDINGS}
    chosen = [k for k in named if getattr(args, k)]
    if len(chosen) > 1:
        ap.error("one findings grid at a time")
    if chosen:
        # a grid row may name its seeds (a fourth element); otherwise --seed
        grid = [(m, t, v, seed) for m, t, vs, *seeds in named[chosen[0]]
                for seed in (seeds[0] if seeds else (args.seed,)) for v in vs]
    else:
        grid = [(args.learners, args.tokens, v, args.seed) for v in (args.variant or ["sync", "ddiloco"])]
    from common_bench import finish_provenance, start_provenance

    # virtual time: the losses do not depend on the machine's load, but the provenance is kept
    prov = start_provenance(args.allow_dirty or not (chosen or args.out), "async_lab")
    jobs = []
    for m, tokens, name, seed in grid:
        lab = LabConfig(learners=m, tokens=tokens, seed=seed, **VARIANTS[name])
        for kv in args.set:
            k, v = kv.split("=", 1)
            setattr(lab, k, json.loads(v))
        jobs.append((name, lab, args.quiet))
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = []
            for res in pool.imap(_job, jobs):
                results.append(res)
                _print(res)
    else:
        results = []
        for job in jobs:
            results.append(_job(job))
            _print(results[-1])
    default_out = {"findings": "async_lab.json", "discount_findings": "async_lab_discount.json",
                   "disorder_findings": "async_lab_disorder.json",
                   "quorum_findings": "async_lab_quorum.json", "overlap_findings": "async_lab_overlap.json"}.get(chosen[0]) if chosen else None
    out = args.out or (ROOT / "bench" / "results" / default_out if default_out else None)
    if out:
        def key(r):
            return r["config"]["learners"], r["config"]["tokens"], r["config"]["seed"]

        base = {key(r): r for r in results if r["variant"] == "sync"}
        for r in results:
            ref = base.get(key(r))
            r["vs_sync"] = round(r["final_eval_loss"] / ref["final_eval_loss"] - 1, 5) if ref else None
        command = (f"python bench/async_lab.py --{chosen[0].replace('_', '-')}" if chosen else " ".join(sys.argv))
        out.write_text(json.dumps({"command": command, **finish_provenance(prov), "rows": results}, indent=1))
    return 0


def _job(job) -> dict:
    name, lab, quiet = job
    return {"variant": name, **run(lab, None if quiet else (lambda s: print(f"[{name}] {s}", file=sys.stderr)))}


def _print(res: dict) -> None:
    keys = ("variant", "final_eval_loss", "deltas_per_merge_mean", "staleness_mean", "cosine_to_sync_mean", "virtual_seconds")
    cfg = res["config"]
    print(json.dumps({"learners": cfg["learners"], "tokens": cfg["tokens"], **{k: res[k] for k in keys}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
