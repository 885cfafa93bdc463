"""What a delta header and payload may claim, checked against what the run makes possible.

Every number a learner sends decides real work or real weight on the server: ``tokens``
weights the merge and advances every other learner's staleness clock, ``inner_steps`` sets
the H rescaling, ``compute_seconds`` feeds the grace window, the values move the model. Each
is validated for its *meaning* here, before the delta is journaled or queued, so a buggy or
hostile caller gets a precise refusal (``common/errors.py``; INVALID_ARGUMENT on the wire,
FAILED_PRECONDITION for a delta of another run or too stale) and the state does not change.

Bounds and why
--------------
* ``inner_steps``: at least 1, at most ``max_coalesce_windows x H`` (or one window as long
  as phase alignment makes it, H + H/2, if that is more: ``LearnerConfig.max_delta_steps``):
  the learner's uploader never sums more than that into one delta (it waits instead, see
  ``learner/uploader.py``).
* ``tokens``: the summed ``batch_weight`` of the delta's batches, at least 1 per step and at
  most ``MAX_BATCH_FACTOR x`` the run's step weight per step (the workload's
  ``step_weight``: R ranks x ``batch x context`` for the built-in model). Batches of a workload
  may weigh differently (sequences of several lengths), so the sum is not checked against
  one batch size. Learners may run another batch size than the run's (a bigger site, or an
  emulated one), but a batch 16x the run's is no longer the same recipe; more would let one
  learner claim the merge's weight and everyone's staleness.
* ``seq``: above the last accepted one (else ALREADY_EXISTS), by at most ``MAX_SEQ_JUMP``.
* ``compute_seconds``: finite, non-negative, at most a lease per step: a step slower than a
  lease would get the learner declared dead before it finished.
* ``loss``: finite. A learner stops before a non-finite loss reaches its parameters, so no
  window it sends has one; the value goes into the outer optimizer's record of the delta.
* values: finite (the codec checks) and, per coordinate, within what that many AdamW steps
  at the run's peak learning rate can move a parameter (``merge.delta_linf_bound``).
* tensors: the fragment's, by name, shape and dtype (float32), in order.
* staleness: the base version is the fragment's or an older one still on its staleness
  clock, at most ``max_staleness_rounds`` of other learners' work behind
  (``merge.staleness_discount``).

The same checks run again on a journaled delta after a restart (``recovery.py``), since its
header is not covered by the entry's digest: all but the magnitude (which depends on the
parameters of the time) and the compute time's upper bound (a lease per step: a resumed run
may shorten the lease).
"""

from __future__ import annotations

import math

from typing import Sequence

import torch

from ddiloco.common import codec, merge
from ddiloco.common.config import MAX_BLOCK_SIZE, RunConfig, block_size_ok
from ddiloco.common.config_rules import MAX_BATCH_FACTOR
from ddiloco.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Stale
from ddiloco.common.wire import PB_TO_CODEC
from ddiloco.outer.records import Fragment

# A learner's sequence numbers go up by one per upload (a refused upload uses one up too).
# A jump beyond this cannot come from an uploader, and would make the learner's own later
# deltas look like repeats (ALREADY_EXISTS).
MAX_SEQ_JUMP = 1024


def check_work(
    config: RunConfig, tokens: int, inner_steps: int, compute_seconds: float, step_weight: int, loss: float = 0.0
) -> None:
    """Refuse a header whose work figures no learner of this run could produce;
    ``step_weight``: the run's workload's ``step_weight()``; ``loss``: the window's mean
    training loss."""
    check_steps_and_tokens(config, tokens, inner_steps, step_weight)
    if not (math.isfinite(compute_seconds) and 0 <= compute_seconds <= inner_steps * config.lease_timeout_s):
        raise InvalidArgument(
            f"compute_seconds={compute_seconds} is not a time {inner_steps} steps can take "
            f"(0 to {config.lease_timeout_s} s per step)",
        )
    if not math.isfinite(loss):
        raise InvalidArgument(f"loss={loss} is not finite: a learner stops before a non-finite loss reaches its parameters")


def check_steps_and_tokens(config: RunConfig, tokens: int, inner_steps: int, step_weight: int) -> None:
    """The part of ``check_work`` that only settings a resumed run keeps decide (H, the
    coalescing bound, the workload's step weight), so that a delta journaled before a
    restart or a resume is held to it too (``recovery.py``): ``tokens`` weighs its merge."""
    h = config.learner.inner_steps
    max_steps = config.learner.max_delta_steps()
    if not 1 <= inner_steps <= max_steps:
        raise InvalidArgument(
            f"inner_steps={inner_steps} is outside [1, {max_steps}] "
            f"(H={h} x at most {config.learner.max_coalesce_windows} coalesced windows, "
            f"or one window of at most {config.learner.longest_window()} steps)",
        )
    max_per_step = MAX_BATCH_FACTOR * step_weight
    if not inner_steps <= tokens <= inner_steps * max_per_step:
        raise InvalidArgument(
            f"tokens={tokens} is not inner_steps ({inner_steps}) x a batch weight in [1, {max_per_step}] "
            f"({MAX_BATCH_FACTOR} x the run's step weight {step_weight})",
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
    # error feedback carries the previous upload's rounding, of a delta of up to this many steps
    qmax = codec.QMAX.get(lcfg.codec) if lcfg.error_feedback else None
    max_steps = lcfg.max_delta_steps()
    for name, t, p_linf in zip(names, tensors, param_linf):
        bound = merge.delta_linf_bound(inner_steps, lcfg.lr, lcfg.weight_decay, p_linf, qmax=qmax, max_steps=max_steps)
        peak = linf(t)
        if peak > bound:
            raise InvalidArgument(
                f"tensor {name!r} changes a coordinate by {peak:.4g}; {inner_steps} AdamW steps at lr {lcfg.lr} "
                f"can move it at most {bound:.4g}",
            )


def check_address(config: RunConfig, run_id: str, seq: int, fragment: int, fragments: int) -> None:
    """Refuse a delta of another run, a sequence below 1 or a fragment the run does not have."""
    if run_id != config.run_id:
        raise FailedPrecondition(f"delta is for run {run_id!r}, this is run {config.run_id!r}")
    if seq < 1:
        raise InvalidArgument(f"sequence numbers start at 1, got {seq}")
    if not 0 <= fragment < fragments:
        raise InvalidArgument(f"fragment {fragment} does not exist; this run has {fragments}")


def check_payload_size(fragment: int, info, shapes: Sequence[tuple[int, ...]]) -> None:
    """Refuse a header (``PayloadInfo`` ``info``) whose codec or block size is unknown, or
    whose declared payload is larger than the fragment's tensors of ``shapes`` can encode
    to. Checked on the header, before the payload is received: the declared size is what
    the receiver allocates and waits for."""
    name = PB_TO_CODEC.get(info.codec)
    if name is None:
        raise InvalidArgument(f"unknown codec {info.codec}")
    if name != "fp32" and not block_size_ok(info.block_size):
        raise InvalidArgument(
            f"block size {info.block_size} is not an even number from 2 to {MAX_BLOCK_SIZE}"
        )
    most = codec.payload_bound(codec.float32_raw_size(name, info.block_size, shapes))
    if info.payload_bytes > most:
        raise InvalidArgument(
            f"header declares {info.payload_bytes} payload bytes; fragment {fragment} in {name} "
            f"(block {info.block_size}) takes at most {most}"
        )


def check_tensors(fragment: int, specs, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> None:
    """Refuse a payload whose tensor specs (``PayloadInfo.tensors``) are not the fragment's
    tensors ``names`` with ``shapes``, in order, as float32."""
    if len(specs) != len(names):
        raise InvalidArgument(f"delta has {len(specs)} tensors, fragment {fragment} has {len(names)}")
    for spec, name, shape in zip(specs, names, shapes):
        if spec.name != name:
            raise InvalidArgument(f"tensor {spec.name!r} where {name!r} was expected")
        if tuple(spec.shape) != tuple(shape):
            raise InvalidArgument(f"tensor {name!r} has shape {tuple(spec.shape)}, expected {tuple(shape)}")
        if spec.dtype != "float32":
            raise InvalidArgument(f"tensor {name!r} has dtype {spec.dtype!r}, expected 'float32'")


def check_staleness(
    frag: Fragment, base_version: int, learner_id: int, own_now: int, round_tokens: int, max_rounds: float
) -> float:
    """Refuse a delta whose base is newer than the fragment (FailedPrecondition: no learner
    can hold it), or too old (``Stale``); returns its staleness discount. ``own_now``: the
    learner's tokens merged into ``frag`` so far."""
    if base_version > frag.version:
        raise FailedPrecondition(f"base version {base_version} is newer than fragment {frag.index}'s version {frag.version}")
    if not frag.tracks(base_version):
        raise Stale(
            f"delta is stale: base version {base_version} of fragment {frag.index} is no longer tracked "
            f"(oldest {min(frag.tokens_at_version)})"
        )
    rounds = frag.rounds_behind(base_version, learner_id, own_now, round_tokens)
    discount = merge.staleness_discount(rounds, max_rounds)
    if discount is None:
        raise Stale(
            f"delta is stale: {rounds:.2f} rounds of other learners' work merged into fragment {frag.index} "
            f"since base version {base_version}, bound {max_rounds}"
        )
    return discount


def check_sequence(learner_id: int, seq: int, last_accepted: int) -> None:
    """Refuse a sequence already accepted (a retry: "have it") or one that jumps too far."""
    if seq <= last_accepted:
        raise AlreadyExists(f"learner {learner_id} sequence {seq} already accepted (last {last_accepted})")
    if seq > last_accepted + MAX_SEQ_JUMP:
        raise InvalidArgument(
            f"learner {learner_id} sequence {seq} jumps more than {MAX_SEQ_JUMP} past its last accepted one ({last_accepted})"
        )
