"""The merge math of the outer optimizer: pure functions on tensors, no I/O, no gRPC.

The problem this solves
-----------------------
Synchronous DiLoCo averages the pseudo-gradients of M learners, each worth H inner steps,
and takes one Nesterov step (lr 0.7, momentum 0.9) per round. Applying that same step to
every delta as it arrives moves the model M times as far per unit of work, and compounds
momentum M times as often: it diverges. ddiloco instead measures everything on a *work
clock*:

* A merge of deltas worth ``T`` tokens is a fraction ``f = T / T_round`` of a synchronous
  round, where ``T_round = M * H * batch * context``.
* The momentum buffer is an exponential average of the pseudo-gradient *rate*: it decays by
  ``d = momentum ** f`` and gains ``(1 - d) / (1 - momentum) * g``; the step is
  ``lr * f * (g + momentum * buffer)``. With ``f = 1`` this is exactly
  ``torch.optim.SGD(nesterov=True)``. For a constant pseudo-gradient the buffer's fixed point
  is ``g / (1 - momentum)`` whatever the fractions, so the update per round of work is
  ``lr * g / (1 - momentum)`` (7 g at 0.7 / 0.9), exactly the synchronous one, for any
  arrival pattern and quorum. (Adding ``f * g`` instead, the obvious choice, falls 3-4%
  short at M = 4..8: ``f / (1 - momentum ** f) < 1 / (1 - momentum)``.)
* A merge worth more than one round (a backlog: learners that trained several windows from
  one base while the outer optimizer was down or cut off) is not several rounds: the learners
  never re-based, so their displacement already integrates that work along one trajectory.
  Its first ``full_gain_rounds`` (default 1) are an ordinary work-clock step; the rest is
  applied at unit gain (the learners' own average displacement, no extrapolation). Applying
  the Nesterov gain to every round of a backlog extrapolates the same work k-fold: one
  restart after a 10 s outage took the eval loss from 2.5 to 5.7 that way. The momentum
  buffer, an average of the pseudo-gradient rate per round of work, takes the backlog's
  rounds in at the backlog's rate (decay ``m ** e``, gain ``(1 - m ** e) / (1 - m)`` for the
  ``e`` rounds beyond the full-gain part): in steady state it is unchanged, as a synchronous
  run's buffer is across the same outage. Decaying it for those rounds without the gain, an
  earlier rule, erased a quarter of it per outer restart in the chaos bench (norm 2.79 to
  2.10 after a 3.5-round backlog), and the merges after the restart stepped 25-45% short for
  about ten rounds while it grew back.
* Phase alignment also makes merges of a little more than one round in steady state (a
  window ends up to H/2 steps late), whose excess the default applies at unit gain too:
  ``(7 + e) / (1 + e)`` per round instead of the synchronous 7. ``full_gain_rounds = 1.5``
  makes those exact, and measured side by side it is not better (docs/quality.md, "Merge
  rules side by side"): exactness per round in steady state is not what decides quality
  here, so the default stays 1.

Weights and staleness
---------------------
* Token weighting ("quantity x quality"): ``w_i = tokens_i * (tokens_i / steps_i)``,
  normalised. Learners with bigger batches carry more weight both for the work done and for
  the lower noise of each step.
* Staleness is measured in rounds of *other* work merged since the delta's base version:
  ``s = (tokens merged since base) / T_round``. The delta is discounted by ``1 / (1 + s)``
  (the staleness-aware step of asynchronous SGD: a pseudo-gradient computed at a point the
  model has since left moves it less); beyond ``max_staleness_rounds`` it is refused *at
  acceptance*. With phase alignment learners of equal speed merge together at ``s`` near 0
  (0.003-0.02 rounds in the laboratory), so the steady state keeps the synchronous update
  per round; what the discount acts on is disorder: a learner that stalled, missed its
  merge and trains on out of phase. In the laboratory with such stalls the former rule
  (free up to one round, then ``1/s``) ended 0.8% above synchronous DiLoCo at M = 4, this
  one 0.4% below it (docs/algorithm.md). A delta already acknowledged is never dropped: one
  that grew staler while it waited for the quorum is merged with the bound's discount
  (``staleness_discount(..., clamp=True)``). The discount scales both the delta's share of
  the direction and its share of ``f``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ddiloco.common.config import MERGE_RULES

# Rounds of a merge at the full gain (OuterConfig.full_gain_rounds; the module docstring)
DEFAULT_FULL_GAIN_ROUNDS = 1.0


@dataclass(frozen=True)
class DeltaInfo:
    tokens: int
    inner_steps: int
    discount: float = 1.0


def token_weights(infos: Sequence[DeltaInfo]) -> list[float]:
    """Quantity x quality weights, with staleness discounts, normalised to sum to 1."""
    raw = [
        d.discount * d.tokens * (d.tokens / max(d.inner_steps, 1)) if d.tokens > 0 else 0.0
        for d in infos
    ]
    total = sum(raw)
    if total <= 0:
        raise ValueError("no delta carries any tokens")
    return [r / total for r in raw]


def staleness_rounds(tokens_merged_now: int, tokens_merged_at_base: int, round_tokens: int) -> float:
    return max(0, tokens_merged_now - tokens_merged_at_base) / max(round_tokens, 1)


def rounds_behind(merged_now: int, merged_at_base: int, own_now: int, own_at_base: int, round_tokens: int) -> float:
    """Rounds of *other* learners' work merged since a delta's base version: the work merged
    since the base minus the learner's own share of it, which is already in its local state."""
    others = (merged_now - merged_at_base) - (own_now - own_at_base)
    return staleness_rounds(others, 0, round_tokens)


def staleness_discount(rounds: float, max_rounds: float, clamp: bool = False) -> float | None:
    """``1 / (1 + rounds)``; beyond the bound None (refuse), or with ``clamp`` (an
    acknowledged delta, which must not be lost) the bound's discount."""
    if rounds > max_rounds:
        if not clamp:
            return None
        rounds = max_rounds
    return 1.0 / (1.0 + max(rounds, 0.0))


def quorum_size(quorum: int, live_learners: int) -> int:
    """Distinct learners a merge needs: K, but never more than are alive (a run whose
    learners died keeps merging), and at least one."""
    return max(1, min(quorum, live_learners))


def quorum_met(distinct_learners: int, quorum: int, live_learners: int) -> bool:
    """The one quorum rule: enough distinct learners have a delta waiting (``quorum_size``)."""
    return distinct_learners >= quorum_size(quorum, live_learners)


def work_fraction(infos: Sequence[DeltaInfo], round_tokens: int) -> float:
    """How much of one synchronous round the merged deltas stand for."""
    return sum(d.discount * d.tokens for d in infos) / max(round_tokens, 1)


def rescale_to_window(tensors: Sequence[torch.Tensor], inner_steps: int, window_steps: int) -> list[torch.Tensor]:
    """A delta of ``inner_steps`` brought to the size of one ``window_steps`` (H) window.

    Every delta is brought to one window's size before it is combined: the work fraction
    already counts how many steps it holds. Without this, a delta the uploader coalesced from
    k windows (e.g. everything trained while the outer optimizer was down) would step k^2 too
    far (a 34-window delta after an 8 s outage took the loss to 5e4), and short windows (a
    fragment's first, a slow learner's under dynamic local updates, the last one at drain)
    would count for less than their work.
    """
    if inner_steps == window_steps:
        return list(tensors)
    return [x * (window_steps / inner_steps) for x in tensors]


@dataclass(frozen=True)
class Waiting:
    """A pending delta as the merge sees it: its work and how far behind its base is."""

    tokens: int
    inner_steps: int
    rounds_behind: float  # math.inf when its base version is no longer tracked


@dataclass(frozen=True)
class MergePlan:
    weights: list[float]  # per delta, summing to 1
    fraction: float  # of one synchronous round (1.0 without the work clock)
    staleness: list[float]  # per delta, rounds behind, capped at the bound
    mean_staleness: float  # weighted staleness x gain: what shortens the momentum's memory


def plan_merge(
    deltas: Sequence[Waiting],
    round_tokens: int,
    max_staleness_rounds: float,
    work_clock: bool = True,
    staleness_gain: float = 1.0,
) -> MergePlan:
    """Weights, work fraction and staleness of one merge of ``deltas``.

    An acknowledged delta is never dropped: one that grew staler than the bound while it
    waited (or whose base fell out of tracking across a restart) gets the bound's discount.
    """
    infos, staleness = [], []
    for d in deltas:
        discount = staleness_discount(d.rounds_behind, max_staleness_rounds, clamp=True)
        staleness.append(min(d.rounds_behind, max_staleness_rounds))
        infos.append(DeltaInfo(d.tokens, d.inner_steps, discount))
    weights = token_weights(infos)
    fraction = work_fraction(infos, round_tokens) if work_clock else 1.0
    mean_staleness = staleness_gain * sum(w * s for w, s in zip(weights, staleness))
    return MergePlan(weights, fraction, staleness, mean_staleness)


def combine(
    deltas: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    rule: str = "weighted",
    plain_average: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Combine several deltas (each a list of tensors in the same order) into one.

    ``weighted``: sum of w_i * delta_i. ``mean``: unweighted mean. ``rda``: radial-
    directional averaging per tensor: the weighted mean of the norms times the unit vector
    of the weighted mean of unit directions, so that averaging nearly orthogonal deltas
    does not shrink the step by ~sqrt(M). Tensors flagged in ``plain_average`` (embeddings)
    always use the weighted mean.
    """
    if rule not in MERGE_RULES:
        raise ValueError(f"unknown merge rule {rule!r}; expected one of {MERGE_RULES}")
    if not deltas:
        raise ValueError("nothing to combine")
    m = len(deltas)
    w = [1.0 / m] * m if rule == "mean" else list(weights)
    out = []
    for t in range(len(deltas[0])):
        parts = [d[t] for d in deltas]
        mean = sum(wi * p for wi, p in zip(w, parts))
        if rule != "rda" or m == 1 or (plain_average is not None and plain_average[t]):
            out.append(mean)
            continue
        norms = [p.norm() for p in parts]
        radius = sum(wi * n for wi, n in zip(w, norms))
        direction = sum(wi * (p / n) for wi, p, n in zip(w, parts, norms) if n > 0)
        if isinstance(direction, int):  # every delta was zero
            out.append(torch.zeros_like(parts[0]))
            continue
        dnorm = direction.norm()
        out.append(direction * (radius / dnorm) if dnorm > 0 else torch.zeros_like(parts[0]))
    return out


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam can produce, for any gradient sequence.

    By Cauchy-Schwarz on ``m_t = (1-b1) sum b1^k g_{t-k}`` and ``v_t = (1-b2) sum b2^k
    g_{t-k}^2``: ``|m_t| / sqrt(v_t) <= (1-b1) / sqrt((1-b2) (1 - b1^2/b2))`` when
    ``b1^2 < b2``; the bias corrections ``sqrt(1-b2^t) / (1-b1^t)`` only shrink it after the
    first steps, where the exact ratio is at most 1. (0.9, 0.95) gives 1.165.
    """
    if not (0 <= beta1 < 1 and 0 < beta2 < 1) or beta1 * beta1 >= beta2:
        raise ValueError(f"no finite Adam step bound for betas ({beta1}, {beta2})")
    return max(1.0, (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2)))


def adamw_linf_move(steps: int, lr: float, weight_decay: float, param_linf: float,
                    beta1: float = 0.9, beta2: float = 0.95) -> float:
    """The largest per-coordinate change ``steps`` AdamW steps can make: each moves a
    coordinate by at most ``lr * (c + weight_decay * |p|)`` with ``c`` the Adam step bound,
    and ``|p|`` is at most the global parameters' max plus what the steps themselves add."""
    move = steps * lr * adam_step_bound(beta1, beta2)
    return move + steps * lr * weight_decay * (param_linf + move)


def delta_linf_bound(
    steps: int, lr: float, weight_decay: float, param_linf: float, beta1: float = 0.9, beta2: float = 0.95,
    qmax: int | None = None, max_steps: int = 0,
) -> float:
    """The largest per-coordinate change a delta of ``steps`` AdamW steps can carry.

    What the steps move (``adamw_linf_move``), plus the quantization residual that error
    feedback carries from the learner's previous upload. That residual is at most half a
    quantization step of the previous upload, which held at most ``max_steps`` steps plus
    its own residual: ``r <= (B + r) / (2 qmax)``, so ``r <= B(max_steps) / (2 qmax - 1)``
    (1% more for the float rounding of the scales). It does not shrink with this window: a
    one-step window after a full one (the last partial window at drain) carries the full
    window's rounding, which once took an honest int4 delta past a bound that assumed it
    did. The bound is never below twice the move itself, the slack it always had.
    ``qmax`` None: a lossless codec, no residual.

    A pseudo-gradient beyond this bound cannot come from the run's inner optimizer: it is
    refused, so one hostile or corrupted learner can move the model no further than an
    honest one could.
    """
    move = adamw_linf_move(steps, lr, weight_decay, param_linf, beta1, beta2)
    residual = 0.0
    if qmax is not None:
        previous = adamw_linf_move(max(max_steps, steps), lr, weight_decay, param_linf, beta1, beta2)
        residual = 1.01 * previous / (2 * qmax - 1)
    return max(2.0 * move, move + residual)


def split_fraction(fraction: float, full_gain_rounds: float = DEFAULT_FULL_GAIN_ROUNDS) -> tuple[float, float]:
    """The work-clock substeps of a merge worth ``fraction`` rounds: (the part up to
    ``full_gain_rounds``, taken as one ordinary work-clock step; the backlog beyond it,
    applied at unit gain)."""
    first = min(fraction, full_gain_rounds)
    return first, fraction - first


def buffer_decay_and_gain(momentum: float, fraction: float, staleness: float = 0.0) -> tuple[float, float]:
    """(d, gain) of the momentum buffer for a step of ``fraction`` rounds:
    ``buf <- d * buf + gain * g`` with ``d = momentum ** (f * (1 + staleness))`` and
    ``gain = (1 - d) / (1 - momentum)``, so the buffer's steady state is ``g / (1 - momentum)``
    whatever the fractions (``WorkClockNesterov.step``)."""
    decay = momentum ** (fraction * (1.0 + staleness))
    return decay, (1.0 - decay) / (1.0 - momentum)


class WorkClockNesterov:
    """SGD with (Nesterov) momentum whose clock is learner work, not merge count.

    ``step(params, g, f)`` with ``f = 1`` is exactly ``torch.optim.SGD(lr, momentum,
    nesterov=True)`` applied to the pseudo-gradient ``g``. A fraction ``f < 1`` decays the
    buffer by ``d = momentum ** f`` and adds ``(1 - d) / (1 - momentum) * g``, so the buffer's
    steady state, and with it the update per round of work, is the synchronous one exactly,
    whatever the fractions. Up to ``full_gain_rounds`` (default 1) the whole fraction is that
    one step; beyond it (a backlog) the rest is applied at unit gain, the buffer averaging in
    the backlog's rate for those rounds (see the module docstring).
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                 full_gain_rounds: float = DEFAULT_FULL_GAIN_ROUNDS) -> None:
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (math.isfinite(full_gain_rounds) and full_gain_rounds >= 1.0):
            raise ValueError(f"full_gain_rounds must be at least 1, got {full_gain_rounds}")
        self.full_gain_rounds = full_gain_rounds
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], fraction: float, staleness: float = 0.0
    ) -> float:
        """Apply one merge; returns the L2 norm of the change it made to ``params``.

        ``staleness``: mean rounds of other work merged since the deltas' base versions.

        Asynchrony begets momentum (Mitliagkas et al., 2016): stale pseudo-gradients already
        carry the model's recent motion, acting as implicit momentum on top of the explicit
        one. The buffer's memory therefore shortens, ``d = momentum ** (f * (1 + staleness))``;
        since what is added is ``(1 - d) / (1 - momentum) * g``, this changes how fast the
        buffer forgets, never its steady state: staleness cannot shrink the update per round.
        """
        if not math.isfinite(fraction) or fraction <= 0:
            raise ValueError(f"work fraction must be positive and finite, got {fraction}")
        if not math.isfinite(staleness) or staleness < 0:
            raise ValueError(f"staleness must be non-negative and finite, got {staleness}")
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p) for p in params]
        f, excess = split_fraction(fraction, self.full_gain_rounds)
        m = self.momentum
        decay, gain = buffer_decay_and_gain(m, f, staleness)
        backlog_decay, backlog_gain = buffer_decay_and_gain(m, excess) if excess > 0 else (1.0, 0.0)
        squared = 0.0
        for p, g, buf in zip(params, grads, self.buffers):
            buf.mul_(decay).add_(g, alpha=gain)
            if self.nesterov:
                change = g * (f * self.lr) + buf * (m * f * self.lr)
            else:
                change = buf * (f * self.lr)
            if excess > 0:
                # the backlog beyond the full-gain part: the learners' own displacement, no
                # extrapolation; the buffer averages in its rate for those rounds
                change.add_(g, alpha=excess)
                buf.mul_(backlog_decay).add_(g, alpha=backlog_gain)
            p.sub_(change)
            squared += float(change.pow(2).sum())
        return math.sqrt(squared)
