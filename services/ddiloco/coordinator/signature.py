"""The model signature: which parameter tensors a model has, in order, with their shapes.

A learner sends the signature of the model it built from the run configuration; the
coordinator refuses it at registration unless it equals the signature the run's own
configuration gives (``expected_signature``). Without this, a learner running other model
code (an older release, a patched build) joined, and then failed with a shape mismatch in
its first fold, or worse, sent deltas the outer optimizer had to refuse one by one.

The signature also carries a digest of the initial parameter values (``values_sha256``):
every learner builds the model from the run's workload under the run's seed, and a workload
whose ``model()`` is not deterministic (its own unseeded randomness, a file that differs
between hosts) would otherwise join with weights that differ from its peers'. So both
sides build the model for real, once per process.
"""

from __future__ import annotations

import hashlib

from ddiloco.common.config import RunConfig
from ddiloco.common.errors import FailedPrecondition, InvalidArgument
from ddiloco.v1 import common_pb2, coordinator_pb2

MAX_LISTED = 5  # differences named in a refusal; the rest are counted
MAX_DTYPE_CHARS = 16  # of a caller's dtype string quoted in a refusal (the longest torch name is 14)
# Dimensions of one tensor in a caller's signature: a model's parameters have a handful. A
# bound, so that the work a Register costs is not set by a dimension list the caller sends
# (a 9 MiB message holds one "tensor" of millions of dimensions).
MAX_DIMS = 64


def signature_of(
    named_shapes: list[tuple[str, tuple[int, ...]]], values_sha256: str = "", dtypes: list[str] | None = None,
) -> coordinator_pb2.ModelSignature:
    """``dtypes``: each tensor's torch dtype name (default float32 for all)."""
    dtypes = dtypes or ["float32"] * len(named_shapes)
    if len(dtypes) != len(named_shapes):  # zip would drop tensors from the signature silently
        raise ValueError(f"{len(dtypes)} dtypes for {len(named_shapes)} tensors")
    tensors = [common_pb2.TensorSpec(name=n, shape=list(s), dtype=d) for (n, s), d in zip(named_shapes, dtypes)]
    parameters = sum(_count(shape) for _, shape in named_shapes)
    return coordinator_pb2.ModelSignature(
        tensors=tensors, parameters=parameters, sha256=_digest(named_shapes), values_sha256=values_sha256
    )


def values_digest(model) -> str:
    """SHA-256 of a model's parameters, as float32 bytes in ``named_parameters`` order (hex):
    ``codec.held_digest`` over the whole model."""
    from ddiloco.common import codec  # imports torch: only where a model exists anyway

    return codec.held_digest([p for _, p in model.named_parameters()]).hex()


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


def _listed(differences: list[str], total: int | None = None) -> str:
    """The first ``MAX_LISTED`` differences, and how many more there are (of ``total``, if
    only the first few were written out)."""
    more = (len(differences) if total is None else total) - MAX_LISTED
    return "; ".join(differences[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _named_shapes(sig: coordinator_pb2.ModelSignature) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.name, tuple(t.shape)) for t in sig.tensors]


def model_signature(config: RunConfig, workload=None) -> coordinator_pb2.ModelSignature:
    """The signature of the model this process's code builds for ``config`` (through
    ``workload``, the run's workload already loaded, or loaded here)."""
    if workload is None:
        from ddiloco.workloads import load

        workload = load(config)
    return signature_of_model(workload.build_model())


def signature_of_model(model) -> coordinator_pb2.ModelSignature:
    named = list(model.named_parameters())
    return signature_of(
        [(n, tuple(p.shape)) for n, p in named], values_digest(model), [str(p.dtype).removeprefix("torch.") for _, p in named],
    )


def check_signature(got: coordinator_pb2.ModelSignature, expected: coordinator_pb2.ModelSignature) -> None:
    """Raise unless ``got`` describes the expected model; the message names what differs."""
    if not got.tensors:
        raise InvalidArgument("RegisterRequest.model is missing: send the signature of the model you built")
    if any(len(t.shape) > MAX_DIMS for t in got.tensors):
        raise InvalidArgument(f"RegisterRequest.model has a tensor of more than {MAX_DIMS} dimensions")
    if len(got.tensors) > 2 * len(expected.tensors) + 10_000:
        # far from the run's model whatever its tensors are: said from the counts, before the
        # work of hashing and comparing them (400,000 tensors took 1.3 s of the coordinator's
        # CPU per Register, while honest heartbeats waited)
        raise FailedPrecondition(
            f"this learner's model has {len(got.tensors):,} tensors, the run's model {len(expected.tensors):,}"
        )
    mine = _named_shapes(got)
    if any(d < 0 for _, shape in mine for d in shape):
        raise InvalidArgument("RegisterRequest.model has a negative dimension")
    if got.sha256 != _digest(mine):
        raise InvalidArgument("RegisterRequest.model.sha256 does not match its own tensor list")
    if got.sha256 == expected.sha256:
        # the values digest is of the values as float32, so a model built in another dtype
        # (bfloat16 rounds its initial values) would mostly be caught below; name it instead
        # (a learner training in another precision folds and sends at that precision)
        other = [
            f"{t.name}: {t.dtype[:MAX_DTYPE_CHARS] or 'no dtype'} instead of {e.dtype}"
            for t, e in zip(got.tensors, expected.tensors) if t.dtype != e.dtype
        ]
        if other:
            raise FailedPrecondition(f"this learner's model has the run's tensors in other dtypes: {_listed(other)}")
        if got.values_sha256 != expected.values_sha256:
            raise FailedPrecondition(
                "this learner's model has the run's tensors but other initial values "
                f"(values_sha256 {got.values_sha256[:12] or 'missing'} instead of {expected.values_sha256[:12]}): "
                f"the workload's model() must give the same parameters for the same seed in every process"
            )
        return
    # count the parameters ourselves for the message, saturating: a caller's dimensions may
    # multiply past int64, which a ModelSignature cannot hold ("Value out of range", UNKNOWN)
    parameters = min(INT64_MAX, sum(_count(shape) for _, shape in mine))
    theirs = dict(_named_shapes(expected))
    ours = dict(mine)
    # names first, words for the few shown only: a caller's signature may list a million tensors
    other_shape = [n for n, s in ours.items() if n in theirs and theirs[n] != s]
    unexpected = [n for n in ours if n not in theirs]
    missing = [n for n in theirs if n not in ours]
    diffs = [f"{n}: {list(ours[n])} instead of {list(theirs[n])}" for n in other_shape[:MAX_LISTED]]
    diffs += [f"unexpected {n} {list(ours[n])}" for n in unexpected[:MAX_LISTED]]
    diffs += [f"missing {n} {list(theirs[n])}" for n in missing[:MAX_LISTED]]
    total = len(other_shape) + len(unexpected) + len(missing)
    if not diffs:  # same tensors, other order
        diffs, total = ["same tensors in another order"], 1
    shown = _listed(diffs, total)
    raise FailedPrecondition(
        f"this learner's model differs from the run's ({len(mine)} tensors, {parameters:,} parameters; "
        f"the run has {len(theirs)} tensors, {expected.parameters:,} parameters): {shown}"
    )
