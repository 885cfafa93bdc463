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
* The outer step uses the merged direction scaled by ``f``, and momentum decays by
  ``momentum ** f``: over any sequence of merges that add up to one round of work, the
  outer update matches one synchronous step, whatever the arrival order and quorum.
  With all M deltas merged at once (f = 1) it *is* the synchronous recipe, exactly.

Weights and staleness
---------------------
* Token weighting ("quantity x quality"): ``w_i = tokens_i * (tokens_i / steps_i)``,
  normalised. Learners with bigger batches carry more weight both for the work done and for
  the lower noise of each step.
* Staleness is measured in rounds of *other* work merged since the delta's base version:
  ``s = (tokens merged since base) / T_round``. Up to one round is the normal lag of an
  asynchronous learner and costs nothing; beyond it the delta is discounted by ``1/s``;
  beyond ``max_staleness_rounds`` it is refused. The discount scales both the delta's
  share of the direction and its share of ``f``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

MERGE_RULES = ("weighted", "mean", "rda")


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


def staleness_discount(rounds: float, max_rounds: float) -> float | None:
    """1 up to one round behind, then 1/rounds; None (refuse) beyond the bound."""
    if rounds > max_rounds:
        return None
    return 1.0 if rounds <= 1.0 else 1.0 / rounds


def work_fraction(infos: Sequence[DeltaInfo], round_tokens: int) -> float:
    """How much of one synchronous round the merged deltas stand for."""
    return sum(d.discount * d.tokens for d in infos) / max(round_tokens, 1)


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


class WorkClockNesterov:
    """SGD with (Nesterov) momentum whose clock is learner work, not merge count.

    ``step(params, g, f)`` with ``f = 1`` is exactly ``torch.optim.SGD(lr, momentum,
    nesterov=True)`` applied to the pseudo-gradient ``g``. With fractional ``f`` the momentum
    buffer decays by ``momentum ** f`` and the step is scaled by ``f``.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], fraction: float, staleness: float = 0.0
    ) -> None:
        """``staleness``: mean rounds of other work merged since the deltas' base versions.

        Asynchrony begets momentum (Mitliagkas et al., 2016): stale pseudo-gradients already
        carry the model's recent motion, acting as implicit momentum on top of the explicit
        one. The buffer therefore decays by ``momentum ** (fraction * (1 + staleness))``:
        with no staleness (synchronous merges) this is the plain work clock; under
        asynchrony the explicit momentum shrinks by as much as the delay adds.
        """
        if not math.isfinite(fraction) or fraction <= 0:
            raise ValueError(f"work fraction must be positive and finite, got {fraction}")
        if not math.isfinite(staleness) or staleness < 0:
            raise ValueError(f"staleness must be non-negative and finite, got {staleness}")
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p) for p in params]
        decay = self.momentum ** (fraction * (1.0 + staleness))
        for p, g, buf in zip(params, grads, self.buffers):
            buf.mul_(decay).add_(g, alpha=fraction)
            if self.momentum == 0:
                update = g * fraction
            elif self.nesterov:
                update = g * fraction + buf * (self.momentum * fraction)
            else:
                update = buf * fraction
            p.sub_(update, alpha=self.lr)
