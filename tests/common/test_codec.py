"""The wire codec: round trips within per-block bounds, and refusal of anything malformed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ddiloco.common import codec

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


def _roundtrip(named, name, block):
    enc = codec.encode(named, name, block)
    return enc, codec.decode_encoded(enc)


@settings(max_examples=60, deadline=None)
@given(arr=arrays(np.float32, shapes, elements=finite), block=st.sampled_from([2, 8, 64]))
def test_fp32_round_trip_is_exact(arr, block):
    _, out = _roundtrip([("t", arr)], "fp32", block)
    assert out[0][1].shape == arr.shape
    np.testing.assert_array_equal(out[0][1], arr)


@settings(max_examples=80, deadline=None)
@given(
    arr=arrays(np.float32, shapes, elements=finite),
    name=st.sampled_from(["int8", "int4"]),
    block=st.sampled_from([2, 4, 16, 64]),
)
def test_quantized_round_trip_stays_within_half_a_step_of_its_block(arr, name, block):
    _, out = _roundtrip([("t", arr)], name, block)
    got = out[0][1]
    assert got.shape == arr.shape and got.dtype == np.float32
    bound = codec.max_block_error(arr, name, block)
    err = np.abs(got.reshape(-1).astype(np.float64) - arr.reshape(-1).astype(np.float64))
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)


def test_every_shape_is_handled_including_scalars_and_odd_lengths():
    named = [("scalar", np.float32(3.5)), ("odd", np.arange(7, dtype=np.float32)), ("cube", np.ones((3, 5, 2), np.float32))]
    for name in codec.CODECS:
        _, out = _roundtrip(named, name, 4)
        assert [a.shape for _, a in out] == [(), (7,), (3, 5, 2)]


def test_int4_packs_two_values_per_byte():  # and the payload is not compressed by default
    arr = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    enc8 = codec.encode([("t", arr)], "int8", 64)
    enc4 = codec.encode([("t", arr)], "int4", 64)
    assert enc4.raw_bytes == 4096 // 2 + 4 * 64
    assert enc8.raw_bytes == 4096 + 4 * 64


def test_error_feedback_keeps_the_sum_of_what_was_sent_close_to_the_truth():
    rng = np.random.default_rng(1)
    fb = codec.ErrorFeedback()
    true_sum = np.zeros(1000, np.float32)
    sent_sum = np.zeros(1000, np.float32)
    for _ in range(50):
        d = rng.normal(scale=0.01, size=1000).astype(np.float32)
        enc = fb.encode([("d", d)], "int4", 32)
        sent = codec.decode_encoded(enc)[0][1]
        true_sum += d
        sent_sum += sent
    # the gap is bounded by one round's residual, not 50 rounds of accumulated error
    assert np.abs(true_sum - sent_sum).max() <= np.abs(fb.residual["d"]).max() + 1e-6
    assert np.abs(fb.residual["d"]).max() < 0.01


TENSORS = {"embed": (40, 16), "attn.w": (16, 48), "attn.b": (48,), "mlp.w": (16, 64), "mlp.b": (64,), "ln": (16,), "head": (16, 40), "scale": ()}


@pytest.mark.parametrize("codec_name", ["int8", "int4"])
@pytest.mark.parametrize("fragments", [1, 2, 8])
def test_error_feedback_keeps_each_fragments_residual_until_its_own_next_upload(codec_name, fragments):
    """Each round, the P fragments upload their tensors in separate calls to one shared
    ErrorFeedback (as the uploader does). Over 50 rounds, the sum of what was sent stays
    within one round's quantization error of the sum of the truth, for every tensor: another
    fragment's upload must not discard a residual that is not its own."""
    rng = np.random.default_rng(fragments)
    names = list(TENSORS)
    groups = [names[f::fragments] for f in range(fragments)]
    fb = codec.ErrorFeedback()
    true_sum = {n: np.zeros(TENSORS[n], np.float64) for n in names}
    sent_sum = {n: np.zeros(TENSORS[n], np.float64) for n in names}
    one_round = {n: 0.0 for n in names}  # the largest error a single round's quantization makes
    for _ in range(50):
        for group in groups:
            deltas = [(n, rng.normal(scale=0.01, size=TENSORS[n]).astype(np.float32)) for n in group]
            enc = fb.encode(deltas, codec_name, 32)
            sent = dict(codec.decode_encoded(enc))
            for n, d in deltas:
                true_sum[n] += d
                sent_sum[n] += sent[n]
                # the input that round was d plus a residual of at most half a step, so its
                # step is at most 1 + 1/(2 qmax) times d's own
                one_round[n] = max(one_round[n], float(codec.max_block_error(d, codec_name, 32).max()) * 1.1)
    for n in names:
        gap = float(np.abs(true_sum[n] - sent_sum[n]).max())
        assert gap <= one_round[n] + 1e-7, f"{n}: cumulative error {gap:.3g} exceeds one round's {one_round[n]:.3g}"


def test_non_finite_input_is_refused_at_encode():
    with pytest.raises(codec.CodecError, match="NaN or Inf"):
        codec.encode([("bad", np.array([1.0, np.nan], np.float32))], "int8")


@pytest.fixture
def encoded():
    arr = np.linspace(-1, 1, 300, dtype=np.float32).reshape(10, 30)
    return codec.encode([("w", arr)], "int8", 64)


def test_truncated_payload_is_refused(encoded):
    with pytest.raises(codec.CodecError, match="truncated"):
        codec.decode(encoded.payload[:-5], "int8", 64, encoded.specs, encoded.digest, len(encoded.payload), compression="none")


def test_checksum_mismatch_is_refused(encoded):
    corrupt = bytearray(encoded.payload)
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(codec.CodecError, match="checksum"):
        codec.decode(bytes(corrupt), "int8", 64, encoded.specs, encoded.digest, len(corrupt), compression="none")


def test_shape_that_disagrees_with_the_payload_length_is_refused(encoded):
    specs = (codec.TensorSpec("w", (10, 31)),)
    with pytest.raises(codec.CodecError, match="does not match"):
        codec.decode(encoded.payload, "int8", 64, specs, encoded.digest, compression="none")


def test_wrong_dtype_is_refused(encoded):
    specs = (codec.TensorSpec("w", (10, 30), "float16"),)
    with pytest.raises(codec.CodecError, match="dtype"):
        codec.decode(encoded.payload, "int8", 64, specs, encoded.digest, compression="none")


def test_nan_inside_a_valid_payload_is_refused():
    import hashlib

    import zstandard

    raw = np.array([1.0, np.nan, 2.0], dtype="<f4").tobytes()
    payload = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(codec.CodecError, match="NaN or Inf"):
        codec.decode(payload, "fp32", 64, (codec.TensorSpec("x", (3,)),), hashlib.sha256(payload).hexdigest(), fmt=1)


def test_a_specs_element_count_is_exact_and_never_wraps():
    assert codec.TensorSpec("scalar", ()).numel == 1
    assert codec.TensorSpec("w", (10, 31)).numel == 310
    # past int64 a wrapped product could pass a size check it must fail
    assert codec.TensorSpec("huge", (2**40, 2**40)).numel == 2**80
    assert codec.TensorSpec("np", (np.int64(2**40), np.int64(2**40))).numel == 2**80


@pytest.mark.parametrize("name,expected", [("fp32", 4 * 22), ("int8", 4 * 4 + 15 + 4 * 2 + 7), ("int4", 4 * 4 + 8 + 4 * 2 + 4)])
def test_float32_raw_size_is_the_scales_and_the_packed_values_of_each_tensor(name, expected):
    # 15 values in 4 blocks of 4 and 7 values in 2: a float32 scale per block, then a byte
    # (int8) or half a byte rounded up per tensor (int4) per value
    assert codec.float32_raw_size(name, 4, [(3, 5), (7,)]) == expected
