"""What a delta header and payload may claim, checked against what the run makes possible.

Every number a learner sends decides real work or real weight on the server: ``tokens``
weights the merge and advances every other learner's staleness clock, ``inner_steps`` sets
the H rescaling, ``compute_seconds`` feeds the grace window, the values move the model. Each
is validated for its *meaning* here, before the delta is journaled or queued, so a buggy or
hostile caller gets a precise INVALID_ARGUMENT and the state does not change.

Bounds and why
--------------
* ``inner_steps``: at least 1, at most ``max_coalesce_windows x H``: the learner's uploader
  never sums more windows than that into one delta (it waits instead, see
  ``learner/uploader.py``).
* ``tokens``: the summed ``batch_weight`` of the delta's batches, at least 1 per step and at
  most ``MAX_BATCH_FACTOR x`` the run's step weight per step (the workload's
  ``reference_weight``: ``batch x context`` for the built-in model). Batches of a workload
  may weigh differently (sequences of several lengths), so the sum is not checked against
  one batch size. Learners may run another batch size than the run's (a bigger site, or an
  emulated one), but a batch 16x the run's is no longer the same recipe; more would let one
  learner claim the merge's weight and everyone's staleness.
* ``seq``: above the last accepted one (else ALREADY_EXISTS), by at most ``MAX_SEQ_JUMP``.
* ``compute_seconds``: finite, non-negative, at most a lease per step: a step slower than a
  lease would get the learner declared dead before it finished.
* values: finite (the codec checks) and, per coordinate, within what that many AdamW steps
  at the run's peak learning rate can move a parameter (``merge.delta_linf_bound``).
"""

from __future__ import annotations

import math

import grpc
import torch

from ddiloco.common import merge
from ddiloco.common.config import RunConfig
from ddiloco.common.wire import Refused

MAX_BATCH_FACTOR = 16
# A learner's sequence numbers go up by one per upload (a refused upload uses one up too).
# A jump beyond this cannot come from an uploader, and would make the learner's own later
# deltas look like repeats (ALREADY_EXISTS).
MAX_SEQ_JUMP = 1024


def check_work(config: RunConfig, tokens: int, inner_steps: int, compute_seconds: float, step_weight: int) -> None:
    """Refuse a header whose work figures no learner of this run could produce;
    ``step_weight``: the run's workload's ``reference_weight()``."""
    h = config.learner.inner_steps
    max_steps = config.learner.max_coalesce_windows * h
    if not 1 <= inner_steps <= max_steps:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"inner_steps={inner_steps} is outside [1, {max_steps}] "
            f"(H={h} x at most {config.learner.max_coalesce_windows} coalesced windows)",
        )
    max_per_step = MAX_BATCH_FACTOR * step_weight
    if not inner_steps <= tokens <= inner_steps * max_per_step:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tokens={tokens} is not inner_steps ({inner_steps}) x a batch weight in [1, {max_per_step}] "
            f"({MAX_BATCH_FACTOR} x the run's step weight {step_weight})",
        )
    if not (math.isfinite(compute_seconds) and 0 <= compute_seconds <= inner_steps * config.lease_timeout_s):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"compute_seconds={compute_seconds} is not a time {inner_steps} steps can take "
            f"(0 to {config.lease_timeout_s} s per step)",
        )


def linf(t: torch.Tensor) -> float:
    """Largest absolute value of ``t`` (0 for an empty tensor)."""
    return float(t.abs().max()) if t.numel() else 0.0


def check_magnitude(
    config: RunConfig, names: list[str], tensors: list[torch.Tensor], param_linf: list[float], inner_steps: int
) -> None:
    """Refuse a pseudo-gradient larger, in any coordinate, than ``inner_steps`` AdamW steps
    allow from parameters whose largest absolute values are ``param_linf`` (per tensor)."""
    lcfg = config.learner
    for name, t, p_linf in zip(names, tensors, param_linf):
        bound = merge.delta_linf_bound(inner_steps, lcfg.lr, lcfg.weight_decay, p_linf)
        peak = linf(t)
        if peak > bound:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {name!r} changes a coordinate by {peak:.4g}; {inner_steps} AdamW steps at lr {lcfg.lr} "
                f"can move it at most {bound:.4g}",
            )
