"""The model signature carries a digest of the initial parameter values: same tensors with
other values (a workload whose model() is not deterministic) are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddiloco.common.errors import FailedPrecondition, InvalidArgument
from ddiloco.coordinator.signature import MAX_DIMS, check_signature, signature_of, signature_of_model


def linear(bias: float) -> nn.Module:
    model = nn.Linear(2, 1)
    nn.init.zeros_(model.weight)
    nn.init.constant_(model.bias, bias)
    return model


def test_the_same_model_passes():
    check_signature(signature_of_model(linear(0.5)), signature_of_model(linear(0.5)))


def test_the_same_tensors_with_other_values_are_refused():
    with pytest.raises(FailedPrecondition, match="the run's tensors but other initial values"):
        check_signature(signature_of_model(linear(0.25)), signature_of_model(linear(0.5)))


def test_a_signature_without_the_values_digest_is_refused():
    sig = signature_of_model(linear(0.5))
    sig.values_sha256 = ""
    with pytest.raises(FailedPrecondition, match="values_sha256 missing"):
        check_signature(sig, signature_of_model(linear(0.5)))


def test_the_same_tensors_in_another_dtype_are_refused_by_name():
    # bfloat16 holds 0.5 and 0 exactly, so the values digest alone would let this one in
    with pytest.raises(FailedPrecondition, match=r"other dtypes: weight: bfloat16 instead of float32; bias: bfloat16"):
        check_signature(signature_of_model(linear(0.5).to(torch.bfloat16)), signature_of_model(linear(0.5)))


def test_a_signature_without_dtypes_is_refused_and_a_long_dtype_is_not_echoed_whole():
    sig = signature_of_model(linear(0.5))
    sig.tensors[0].dtype = ""
    sig.tensors[1].dtype = "x" * 10_000
    with pytest.raises(FailedPrecondition, match=r"weight: no dtype instead of float32; bias: x{16} instead") as refused:
        check_signature(sig, signature_of_model(linear(0.5)))
    assert len(str(refused.value)) < 300


def test_a_tensor_of_more_dimensions_than_any_model_has_is_refused_before_anything_is_built_from_it():
    sig = signature_of([("weight", (1,) * (MAX_DIMS + 1))], "0" * 64)
    with pytest.raises(InvalidArgument, match=f"a tensor of more than {MAX_DIMS} dimensions"):
        check_signature(sig, signature_of_model(linear(0.5)))
    at_the_bound = signature_of([("weight", (1,) * MAX_DIMS)], "0" * 64)
    with pytest.raises(FailedPrecondition, match="differs from the run's"):  # a shape like any other
        check_signature(at_the_bound, signature_of_model(linear(0.5)))


def test_a_signature_of_many_unexpected_tensors_names_the_first_few_and_counts_the_rest():
    sig = signature_of([(f"extra{i}", (2,)) for i in range(10_000)], "0" * 64)
    with pytest.raises(FailedPrecondition) as refused:
        check_signature(sig, signature_of_model(linear(0.5)))
    message = str(refused.value)
    assert "(10000 tensors, 20,000 parameters; the run has 2 tensors, 3 parameters)" in message
    assert "unexpected extra0 [2]" in message and "unexpected extra4 [2]" in message and "extra5 " not in message
    assert message.endswith("; and 9997 more"), message  # 10,000 unexpected and 2 missing, 5 of them named


def test_a_signature_of_far_more_tensors_than_the_run_has_is_refused_from_the_counts():
    """Before its tensors are hashed and compared (400,000 of them cost 1.3 s a Register)."""
    expected = signature_of_model(linear(0.5))
    many = signature_of([(f"t{i}", (1,)) for i in range(100_000)], "0" * 64, ["float32"] * 100_000)
    with pytest.raises(FailedPrecondition, match=f"this learner's model has 100,000 tensors, the run's model {len(expected.tensors)}"):
        check_signature(many, expected)
