"""The fast codec against the first one, and against an error bound computed here.

``_ref_*`` below is the first codec's quantizer (numpy, whole-tensor temporaries), kept
only as a reference: for the same input the fast codec must write the same bytes before
compression (scales and codes) and decode to bit-identical values, so the committed
quality results, measured with the first codec, stay valid. Both are also run through
small chunks (``CHUNK_ELEMS`` lowered), so chunk edges fall inside tensors of a few
thousand values.

The error bound is derived here from the inputs alone, in float64, without the codec's
scales: half a step ``absmax(block) / qmax``, widened by the float32 roundings of the
scale, the division and the product (at most ``4 qmax`` units of 2^-24 of a step), plus
an absolute 1e-37 for blocks whose step is below the smallest normal float32 (their scale
loses precision, as it always did).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import zstandard

from ddiloco.common import codec, quantize
from ddiloco.common.wire import decode_payload, payload_info

QMAX = {"int8": 127, "int4": 7}


# ----------------------------------------------------------------- the first codec's rule
def _ref_quantize(flat, name, block):
    qmax = QMAX[name]
    n = flat.size
    nb = -(-n // block)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nb, block)
    absmax = np.abs(blocks).max(axis=1)
    scales = (absmax / qmax).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.rint(blocks / safe[:, None]).clip(-qmax, qmax).astype(np.int8).reshape(-1)[:n]
    return scales, q


def _ref_pack_int4(q):
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    if u.size % 2:
        u = np.concatenate([u, np.full(1, 8, dtype=np.uint8)])
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def _ref_raw(arrays, name, block):
    parts = []
    for _, arr in arrays:
        flat = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
        scales, q = _ref_quantize(flat, name, block)
        parts.append(scales.astype("<f4").tobytes())
        parts.append((_ref_pack_int4(q) if name == "int4" else q).tobytes())
    return b"".join(parts)


def _ref_decoded(arrays, name, block):
    out = []
    for _, arr in arrays:
        flat = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
        scales, q = _ref_quantize(flat, name, block)
        n = flat.size
        values = (q.astype(np.float32) * np.repeat(scales, block)[:n]).astype(np.float32)
        out.append(values.reshape(np.shape(arr)))
    return out


# ----------------------------------------------------------------- inputs
def _inputs(seed):
    """Tensors of awkward sizes and magnitudes: odd lengths, a scalar, zeros and -0.0,
    subnormals, values near the float32 maximum, one block of a single outlier."""
    rng = np.random.default_rng(seed)
    arrays = [
        ("odd", rng.normal(size=1001).astype(np.float32)),
        ("matrix", (rng.standard_t(3, size=(37, 61)) * 1e-3).astype(np.float32)),
        ("scalar", np.float32(rng.normal())),
        ("zeros", np.zeros(130, np.float32)),
        ("negzero", np.full(67, -0.0, np.float32)),
        ("subnormal", (rng.normal(size=515) * 1e-42).astype(np.float32)),
        ("huge", (rng.uniform(-1, 1, size=300) * 1e37).astype(np.float32)),
        ("outlier", np.where(np.arange(2048) == 77, 1e4, rng.normal(size=2048) * 1e-4).astype(np.float32)),
        ("empty", np.zeros((0, 3), np.float32)),
    ]
    mixed = rng.normal(size=4099).astype(np.float32)
    mixed[::7] = 0.0
    mixed[1::11] = -0.0
    arrays.append(("mixed", mixed))
    return arrays


@pytest.fixture(params=[None, 128, 192], ids=["default-chunks", "chunks-of-128", "chunks-of-192"])
def chunks(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(quantize, "CHUNK_ELEMS", request.param)
    return request.param


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [2, 6, 16, 64, 256])
def test_same_bytes_and_bit_identical_values_as_the_first_codec(name, block, chunks):
    for seed in range(3):
        arrays = _inputs(seed)
        enc = codec.encode(arrays, name, block)
        assert enc.compression == "none"
        assert enc.payload == _ref_raw(arrays, name, block)
        got = codec.decode_encoded(enc)
        for (n, g), want in zip(got, _ref_decoded(arrays, name, block)):
            assert g.shape == want.shape and g.dtype == np.float32
            assert g.tobytes() == want.tobytes(), n  # bits, so -0.0 and +0.0 count as different


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_error_feedback_matches_the_first_codec_round_for_round(name, chunks):
    """The first codec's error feedback: encode a + residual, decode the payload, keep the
    difference. The fast one keeps the residual while quantizing; over rounds the bytes
    sent and the residuals agree exactly."""
    rng = np.random.default_rng(7)
    ef = codec.ErrorFeedback()
    ref_residual: dict[str, np.ndarray] = {}
    for _ in range(6):
        arrays = [(n, a + np.float32(1e-3) * rng.normal(size=np.shape(a)).astype(np.float32)) for n, a in _inputs(0)[:3]]
        arrays = [(n, np.asarray(a, np.float32)) for n, a in arrays]
        corrected = [(n, a + ref_residual[n]) if n in ref_residual else (n, a) for n, a in arrays]
        want_raw = _ref_raw(corrected, name, 16)
        want = _ref_decoded(corrected, name, 16)
        enc = ef.encode(arrays, name, 16)
        assert enc.payload == want_raw
        for (n, c), d in zip(corrected, want):
            ref_residual[n] = np.asarray(c, np.float32) - d
            np.testing.assert_array_equal(np.asarray(ef.residual[n]), ref_residual[n])


def _independent_bound(arr, name, block):
    """Per value, the largest error the rule allows: from the input only, in float64."""
    qmax = QMAX[name]
    flat = np.asarray(arr, dtype=np.float64).reshape(-1)
    bound = np.empty_like(flat)
    for start in range(0, flat.size, block):
        step = np.max(np.abs(flat[start : start + block])) / qmax
        bound[start : start + block] = step / 2 * (1 + 4 * qmax * 2.0**-24) + 1e-37
    return bound


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [2, 16, 64])
def test_every_value_stays_within_half_a_step_of_its_block(name, block, chunks):
    for seed in range(3):
        arrays = _inputs(seed)
        for (n, got), (_, arr) in zip(codec.decode_encoded(codec.encode(arrays, name, block)), arrays):
            err = np.abs(got.astype(np.float64).reshape(-1) - np.asarray(arr, np.float64).reshape(-1))
            bound = _independent_bound(arr, name, block)
            assert np.all(err <= bound), f"{n}: error {err.max():.3g} above the bound at {np.argmax(err - bound)}"


def test_values_near_the_float32_maximum_stay_within_the_bound_or_are_refused():
    """A block whose absmax is near the float32 maximum may decode to Inf (q * scale rounds
    up past it); the decoder refuses that payload, as the first codec did, and otherwise
    the bound holds."""
    arr = (np.random.default_rng(3).uniform(-1, 1, size=640) * 3e38).astype(np.float32)
    for name in ("int8", "int4"):
        try:
            (_, got), = codec.decode_encoded(codec.encode([("h", arr)], name, 64))
        except codec.CodecError as exc:
            assert "NaN or Inf" in str(exc)
            continue
        err = np.abs(got.astype(np.float64) - arr.astype(np.float64))
        assert np.all(err <= _independent_bound(arr, name, 64))


def test_a_first_format_payload_decodes_as_it_did():
    """Format 1 (zstd, SHA-256), as the first codec wrote it: from a journal or an older peer."""
    arrays = _inputs(1)
    raw = _ref_raw(arrays, "int8", 64)
    payload = zstandard.ZstdCompressor(level=3).compress(raw)
    specs = tuple(codec.TensorSpec(n, tuple(np.shape(a))) for n, a in arrays)
    got = codec.decode(payload, "int8", 64, specs, hashlib.sha256(payload).hexdigest(), len(payload), fmt=1)
    for (_, g), want in zip(got, _ref_decoded(arrays, "int8", 64)):
        assert g.tobytes() == want.tobytes()
    # the same through the wire header, with the format field unset as older peers leave it
    enc = codec.encode(arrays, "int8", 64)
    info = payload_info(enc)
    info.ClearField("format")
    info.ClearField("xxh3_128")
    info.ClearField("compression")
    info.sha256 = hashlib.sha256(payload).hexdigest()
    info.payload_bytes = len(payload)
    for (_, g), want in zip(decode_payload(info, payload), _ref_decoded(arrays, "int8", 64)):
        assert g.tobytes() == want.tobytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: quantizing on the GPU")
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantizing_on_the_gpu_gives_the_bytes_of_the_cpu(name):
    arrays = _inputs(2)
    on_gpu = [(n, torch.from_numpy(np.asarray(a, np.float32).copy()).cuda()) for n, a in arrays]
    enc_gpu = codec.encode(on_gpu, name, 64)
    assert enc_gpu.payload == codec.encode(arrays, name, 64).payload
    ef_cpu, ef_gpu = codec.ErrorFeedback(), codec.ErrorFeedback()
    for _ in range(3):
        assert ef_gpu.encode(on_gpu, name, 64).payload == ef_cpu.encode(arrays, name, 64).payload
    for n, _ in arrays:
        assert ef_gpu.residual[n].is_cuda
        np.testing.assert_array_equal(ef_gpu.residual[n].cpu().numpy(), ef_cpu.residual[n])
