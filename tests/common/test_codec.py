"""The wire codec: round trips within per-block bounds, and refusal of anything malformed."""

from __future__ import annotations

import pathlib

import numpy as np
import torch
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


@pytest.mark.parametrize("codec_name", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("as_torch", [False, True])
def test_a_withdrawn_upload_leaves_the_residual_as_it_was_before_it(codec_name, as_torch):
    """A delta the outer optimizer refused as stale is dropped with its windows; its
    quantization error must not reach the model with the next upload. After ``withdraw`` the
    residual is the one before that encode (to float32 rounding), so the next upload sends
    what it would have sent had the refused one never been encoded."""
    rng = np.random.default_rng(3)
    rounds = [[("a", rng.normal(size=(3, 50)).astype(np.float32)), ("b", rng.normal(size=70).astype(np.float32))]
              for _ in range(3)]
    if as_torch:
        rounds = [[(n, torch.from_numpy(x)) for n, x in r] for r in rounds]
    with_refusal, without = codec.ErrorFeedback(), codec.ErrorFeedback()
    with_refusal.encode(rounds[0], codec_name, 64)
    without.encode(rounds[0], codec_name, 64)
    before = {n: np.array(np.asarray(r), copy=True) for n, r in with_refusal.residual.items()}
    refused = with_refusal.encode(rounds[1], codec_name, 64)
    with_refusal.withdraw(rounds[1], refused)
    for n, r in before.items():
        np.testing.assert_allclose(np.asarray(with_refusal.residual[n]), r, rtol=0, atol=1e-6)
    sent = dict(codec.decode_encoded(with_refusal.encode(rounds[2], codec_name, 64)))
    expected = dict(codec.decode_encoded(without.encode(rounds[2], codec_name, 64)))
    for n in expected:  # a value on a level boundary may round either way: one step at most
        step = np.abs(expected[n]).max() / (127 if codec_name == "int8" else 7) if codec_name != "fp32" else 1e-6
        assert np.abs(sent[n] - expected[n]).max() <= step, n
        assert np.mean(sent[n] == expected[n]) > 0.98, n


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


@pytest.mark.parametrize("block", [0, 63, (1 << 20) + 2, (1 << 31) - 2])
def test_a_block_size_no_run_may_use_is_refused_both_ways(encoded, block):
    with pytest.raises(codec.CodecError, match="even number from 2 to 1048576"):
        codec.decode(encoded.payload, "int8", block, encoded.specs, encoded.digest, compression="none")
    with pytest.raises(codec.CodecError, match="even number from 2 to 1048576"):
        codec.encode([("w", np.ones(4, np.float32))], "int4", block)


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


# ------------------------------------------------- small tensors decoded together
def _small_tensors(seed: int) -> list[tuple[str, np.ndarray]]:
    """Many small tensors of odd sizes around one larger than a quantizer chunk: the decoder
    takes the small ones in runs, the large one alone (``codec._groups``)."""
    rng = np.random.default_rng(seed)
    sizes = [1, 7, 63, 64, 65, 129, 3, 0, 255]
    arrays = [(f"s{i}", (rng.normal(size=n) * 10.0 ** rng.integers(-6, 2)).astype(np.float32))
              for i, n in enumerate(sizes)]
    arrays.insert(4, ("large", rng.normal(size=(300, 7)).astype(np.float32)))
    arrays.append(("scalar", np.float32(rng.normal())))
    return arrays


@pytest.fixture(params=[None, 256], ids=["default-chunks", "chunks-of-256"])
def chunks(request, monkeypatch):
    from ddiloco.common import quantize

    if request.param is not None:  # runs of a few tensors, and "large" alone
        monkeypatch.setattr(quantize, "CHUNK_ELEMS", request.param)


def test_the_decoder_groups_tensors_in_runs_of_at_most_one_chunk_and_large_ones_alone(monkeypatch):
    from ddiloco.common import quantize

    monkeypatch.setattr(quantize, "CHUNK_ELEMS", 256)
    # padded to blocks of 64: 64 (more than doubled: alone), 128, 64, 320 (over a chunk),
    # 64 (more than doubled), 192, 0
    groups = codec._groups([1, 100, 64, 300, 10, 130, 0], 64)
    assert groups == [[0], [1, 2], [3], [4], [5, 6]]


def test_a_decodes_work_is_the_values_sent_whatever_the_senders_block_size(monkeypatch):
    """The block size is the sender's (up to 2^20). Batching small tensors padded each to a
    whole block: a thousand one-value tensors at block 2^17 made a 2 kB payload dequantize
    1.3e8 values (seconds of the outer optimizer's CPU per delta)."""
    from ddiloco.common import quantize

    arrays = [(f"t{i}", np.full(1, 0.5, np.float32)) for i in range(1000)] + [("w", np.ones(300, np.float32))]
    enc = codec.encode(arrays, "int8", 1 << 17)
    counted = []
    real = quantize.dequantize

    def counting(codes, qmax, block, scales, out):
        counted.append(out.numel())
        return real(codes, qmax, block, scales, out)

    monkeypatch.setattr(quantize, "dequantize", counting)
    decoded = codec.decode_encoded(enc)
    assert [a.tolist() for _, a in decoded[:3]] == [[0.5]] * 3
    assert sum(counted) <= 2 * sum(a.size for _, a in arrays)


def _rle_frame(content_size: int | None, blocks: int, block_bytes: int = 1 << 17) -> bytes:
    """A zstd frame of RLE blocks (4 bytes each on the wire, ``block_bytes`` decoded), stating
    ``content_size`` in its header (None: stating none)."""
    import struct

    if content_size is None:
        out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x70]))  # no size stated; a window descriptor
    else:
        out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", content_size))
    for i in range(blocks):
        out += ((i == blocks - 1) | (1 << 1) | (block_bytes << 3)).to_bytes(3, "little") + b"\x00"
    return bytes(out)


def _decode_zstd(payload: bytes):
    """Decode ``payload`` as the lossless zstd payload of one 256-value tensor (1 kB), its
    digest right: what a sender that means harm can always arrange."""
    from ddiloco.common import wire

    info = wire.payload_info(codec.encode([("w", np.zeros(256, np.float32))], "fp32"))
    info.payload_bytes = len(payload)
    info.xxh3_128 = codec.digest_of(payload, 2)
    return wire.decode_payload(info, payload)


@pytest.mark.parametrize("stated", [1 << 46, 513, 0])
def test_a_zstd_frame_stating_another_size_than_the_specs_is_refused_before_decompressing(stated):
    from ddiloco.common import errors

    with pytest.raises(errors.InvalidArgument, match=f"frame states {stated} bytes, which does not match the 1024 bytes the tensor specs imply"):
        _decode_zstd(_rle_frame(stated, 1))


def test_a_zstd_frame_stating_no_size_is_held_to_what_the_specs_imply():
    from ddiloco.common import errors

    with pytest.raises(errors.Refused, match="not valid zstd: .*did not decompress full frame"):
        _decode_zstd(_rle_frame(None, 64))


def test_a_decompression_bomb_costs_the_receiver_no_memory(tmp_path):
    """Measured in a process of its own (peak resident memory only grows): a 16 kB frame
    stating and holding 512 MiB was decompressed in full before its length was checked."""
    import subprocess
    import sys

    script = f"""
import resource, sys
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import test_codec
frame = test_codec._rle_frame(512 << 20, 4096)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    test_codec._decode_zstd(frame)
except Exception as exc:
    print("refused:", type(exc).__name__ + ":", exc)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    import os

    services = str(pathlib.Path(codec.__file__).parents[2])  # this tree's code, not an installed copy
    env = {**os.environ, "PYTHONPATH": services}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True, env=env
    ).stdout
    assert "refused: InvalidArgument: payload's zstd frame states 536870912 bytes" in out, out
    assert int(out.split("grew_kib")[1]) < 64 * 1024, out


@pytest.mark.parametrize("name", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("block", [2, 64])
def test_what_the_sender_is_told_it_sent_is_what_the_receiver_decodes(name, block, chunks):
    for seed in range(3):
        arrays = _small_tensors(seed)
        enc, sent = codec.encode_with_sent(arrays, name, block)
        assert enc.payload == codec.encode(arrays, name, block).payload
        decoded = codec.decode_encoded(enc)
        assert len(sent) == len(decoded)
        for got, (n, want) in zip(sent, decoded):
            assert got.shape == want.shape and got.dtype == np.float32, n
            assert got.tobytes() == want.tobytes(), n  # bits: -0.0 and +0.0 differ


def test_a_non_finite_value_is_refused_naming_its_tensor_inside_a_run(chunks):
    arrays = _small_tensors(0)
    arrays[6] = (arrays[6][0], np.array([0.5, np.inf, 1.0], np.float32))
    arrays[8] = (arrays[8][0], np.array([np.nan] * 5, np.float32))
    with pytest.raises(codec.CodecError, match=f"tensor '{arrays[6][0]}' holds NaN or Inf"):
        codec.encode(arrays, "int8", 64)
    feedback = codec.ErrorFeedback()  # and error feedback starts those tensors afresh
    with pytest.raises(codec.CodecError, match=f"tensor '{arrays[6][0]}'"):
        feedback.encode(arrays, "int4", 64)
    assert not feedback.residual


def _with_scale(enc: codec.Encoded, tensor: int, value: float) -> bytes:
    """The payload of ``enc`` (uncompressed) with the first block scale of ``tensor`` replaced."""
    raw = bytearray(enc.payload)
    offset = 0
    for spec in enc.specs[:tensor]:
        offset += codec.raw_size(enc.codec, enc.block_size, (spec,))
    raw[offset : offset + 4] = np.array([value], "<f4").tobytes()
    return bytes(raw)


def _decode_raw(enc: codec.Encoded, raw: bytes):
    return codec.decode(raw, enc.codec, enc.block_size, enc.specs, codec.digest_of(raw), compression="none")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_payload_is_refused_tensor_by_tensor_in_order_inside_a_run(name, chunks):
    arrays = _small_tensors(1)
    enc = codec.encode(arrays, name, 64)
    names = [s.name for s in enc.specs]
    # a non-finite scale in the seventh tensor
    with pytest.raises(codec.CodecError, match=f"tensor '{names[6]}' has non-finite block scales"):
        _decode_raw(enc, _with_scale(enc, 6, float("inf")))
    # a finite scale so large that the second tensor decodes to Inf comes first
    raw = _with_scale(enc, 6, float("nan"))
    raw = _with_scale(codec.Encoded(enc.codec, enc.block_size, enc.specs, raw, "", 0), 1, 3e38)
    with pytest.raises(codec.CodecError, match=f"tensor '{names[1]}' holds NaN or Inf"):
        _decode_raw(enc, raw)
