"""The model signature carries a digest of the initial parameter values: same tensors with
other values (a workload whose model() is not deterministic) are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddiloco.common.errors import FailedPrecondition
from ddiloco.coordinator.signature import check_signature, signature_of_model


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
