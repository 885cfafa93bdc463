"""The model signature: which parameter tensors a model has, in order, with their shapes.

A learner sends the signature of the model it built from the run configuration; the
coordinator refuses it at registration unless it equals the signature the run's own
configuration gives (``expected_signature``). Without this, a learner running other model
code (an older release, a patched build) joined, and then failed with a shape mismatch in
its first fold, or worse, sent deltas the outer optimizer had to refuse one by one.

Both sides build the model on the ``meta`` device: no memory is allocated and no weights
are initialised, so this costs milliseconds even for large models.
"""

from __future__ import annotations

import hashlib

from ddiloco.common.config import RunConfig
from ddiloco.coordinator.errors import FailedPrecondition, InvalidArgument
from ddiloco.v1 import common_pb2, coordinator_pb2

MAX_LISTED = 5  # differences named in a refusal; the rest are counted


def signature_of(named_shapes: list[tuple[str, tuple[int, ...]]]) -> coordinator_pb2.ModelSignature:
    tensors = [common_pb2.TensorSpec(name=n, shape=list(s), dtype="float32") for n, s in named_shapes]
    parameters = 0
    for _, shape in named_shapes:
        count = 1
        for d in shape:
            count *= d
        parameters += count
    return coordinator_pb2.ModelSignature(tensors=tensors, parameters=parameters, sha256=_digest(named_shapes))


def _digest(named_shapes) -> str:
    h = hashlib.sha256()
    for name, shape in named_shapes:
        h.update(f"{name}:{'x'.join(str(d) for d in shape)};".encode())
    return h.hexdigest()


INT64_MAX = (1 << 63) - 1


def _count(shape) -> int:
    """Elements of ``shape``, at most INT64_MAX + 1 (never a bignum of a caller's making)."""
    count = 1
    for d in shape:
        count *= d
        if count > INT64_MAX:
            return 0 if 0 in shape else INT64_MAX + 1
    return count


def _named_shapes(sig: coordinator_pb2.ModelSignature) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.name, tuple(t.shape)) for t in sig.tensors]


def model_signature(config: RunConfig) -> coordinator_pb2.ModelSignature:
    """The signature of the model this process's code builds for ``config``."""
    import torch

    from ddiloco.common.model import build_model

    with torch.device("meta"):
        model = build_model(config.model, config.seed)
    return signature_of([(n, tuple(p.shape)) for n, p in model.named_parameters()])


def check_signature(got: coordinator_pb2.ModelSignature, expected: coordinator_pb2.ModelSignature) -> None:
    """Raise unless ``got`` describes the expected model; the message names what differs."""
    if not got.tensors:
        raise InvalidArgument("RegisterRequest.model is missing: send the signature of the model you built")
    mine = _named_shapes(got)
    if any(d < 0 for _, shape in mine for d in shape):
        raise InvalidArgument("RegisterRequest.model has a negative dimension")
    if got.sha256 != _digest(mine):
        raise InvalidArgument("RegisterRequest.model.sha256 does not match its own tensor list")
    if got.sha256 == expected.sha256:
        return
    # count the parameters ourselves for the message, saturating: a caller's dimensions may
    # multiply past int64, which a ModelSignature cannot hold ("Value out of range", UNKNOWN)
    parameters = min(INT64_MAX, sum(_count(shape) for _, shape in mine))
    theirs = dict(_named_shapes(expected))
    ours = dict(mine)
    diffs = [f"{n}: {list(s)} instead of {list(theirs[n])}" for n, s in ours.items() if n in theirs and theirs[n] != s]
    diffs += [f"unexpected {n} {list(s)}" for n, s in ours.items() if n not in theirs]
    diffs += [f"missing {n} {list(s)}" for n, s in theirs.items() if n not in ours]
    if not diffs:  # same tensors, other order
        diffs = ["same tensors in another order"]
    shown = "; ".join(diffs[:MAX_LISTED]) + (f"; and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else "")
    raise FailedPrecondition(
        f"this learner's model differs from the run's ({len(mine)} tensors, {parameters:,} parameters; "
        f"the run has {len(theirs)} tensors, {expected.parameters:,} parameters): {shown}"
    )
