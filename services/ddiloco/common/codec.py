"""Wire codec for tensors: per-block absmax quantization, then zstd.

Payload layout (before compression), for each tensor in order:

* ``fp32``: the tensor's values as little-endian float32.
* ``int8``: ``nblocks`` float32 scales, then ``numel`` int8 values, where
  ``value ~= q * scale`` and ``scale = absmax(block) / 127``.
* ``int4``: ``nblocks`` float32 scales, then ``ceil(numel / 2)`` bytes holding two signed
  4-bit values each (low nibble first, offset by 8), ``scale = absmax(block) / 7``.

Blocks run over the flattened tensor, so every shape (0-d, 1-d, n-d) is handled alike; the
last block of a tensor may be short. The compressed payload is protected by a SHA-256.

Decoding trusts nothing: it checks the compressed length and digest, the decompressed
length against what the tensor specs imply, and that every value is finite. Any failure
raises ``CodecError`` with a message that says what was wrong.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import zstandard

CODECS = ("fp32", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
ZSTD_LEVEL = 3


class CodecError(ValueError):
    """The payload is not what its header says it is."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class Encoded:
    codec: str
    block_size: int
    specs: tuple[TensorSpec, ...]
    payload: bytes  # compressed
    sha256: str
    raw_bytes: int  # size before compression, for logs


def _nblocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def raw_size(codec: str, block_size: int, specs: tuple[TensorSpec, ...]) -> int:
    """Exact uncompressed payload size implied by the specs."""
    total = 0
    for spec in specs:
        n = spec.numel
        if codec == "fp32":
            total += 4 * n
        elif codec == "int8":
            total += 4 * _nblocks(n, block_size) + n
        elif codec == "int4":
            total += 4 * _nblocks(n, block_size) + (n + 1) // 2
        else:
            raise CodecError(f"unknown codec {codec!r}")
    return total


def _quantize(flat: np.ndarray, codec: str, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    qmax = _QMAX[codec]
    n = flat.size
    nb = _nblocks(n, block_size)
    padded = np.zeros(nb * block_size, dtype=np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nb, block_size)
    absmax = np.abs(blocks).max(axis=1)
    scales = (absmax / qmax).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.rint(blocks / safe[:, None]).clip(-qmax, qmax).astype(np.int8).reshape(-1)[:n]
    return scales, q


def _dequantize(scales: np.ndarray, q: np.ndarray, block_size: int) -> np.ndarray:
    # O(numel) whatever the block size: ``block_size`` comes from the sender's header, and
    # padding to whole blocks made a header with block_size 2^31 allocate 8 GiB per tensor
    n = q.size
    full = min(n // block_size, scales.size)
    out = np.empty(n, dtype=np.float32)
    head = full * block_size
    if full:
        out[:head] = (q[:head].astype(np.float32).reshape(full, block_size) * scales[:full, None]).reshape(-1)
    if head < n:
        out[head:] = q[head:].astype(np.float32) * scales[full]
    return out


def _pack_int4(q: np.ndarray) -> np.ndarray:
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    if u.size % 2:
        u = np.concatenate([u, np.full(1, 8, dtype=np.uint8)])
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def _unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.int8)
    out[0::2] = (packed & 0x0F).astype(np.int8) - 8
    out[1::2] = (packed >> 4).astype(np.int8) - 8
    return out[:n]


def encode(
    arrays: list[tuple[str, np.ndarray]], codec: str = "int8", block_size: int = 64
) -> Encoded:
    """Encode named float arrays. Non-finite inputs are refused: they would poison a merge."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if block_size < 2 or block_size % 2:
        raise CodecError(f"block size must be an even number >= 2, got {block_size}")
    parts: list[bytes] = []
    specs = []
    for name, arr in arrays:
        flat = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
        if not np.isfinite(flat).all():
            raise CodecError(f"tensor {name!r} holds NaN or Inf")
        specs.append(TensorSpec(name, tuple(int(d) for d in np.shape(arr))))
        if codec == "fp32":
            parts.append(flat.astype("<f4").tobytes())
            continue
        scales, q = _quantize(flat, codec, block_size)
        parts.append(scales.astype("<f4").tobytes())
        parts.append((_pack_int4(q) if codec == "int4" else q).tobytes())
    raw = b"".join(parts)
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    return Encoded(
        codec=codec,
        block_size=block_size,
        specs=tuple(specs),
        payload=payload,
        sha256=hashlib.sha256(payload).hexdigest(),
        raw_bytes=len(raw),
    )


def decode(
    payload: bytes,
    codec: str,
    block_size: int,
    specs: tuple[TensorSpec, ...],
    sha256: str,
    payload_bytes: int | None = None,
) -> list[tuple[str, np.ndarray]]:
    """Validate and decode a payload into named float32 arrays, in spec order."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    if codec != "fp32" and (block_size < 2 or block_size % 2):
        raise CodecError(f"invalid block size {block_size}")
    for spec in specs:
        if spec.dtype != "float32":
            raise CodecError(f"tensor {spec.name!r} has dtype {spec.dtype!r}; only float32 is accepted")
        if any(d < 0 for d in spec.shape):
            raise CodecError(f"tensor {spec.name!r} has a negative dimension {spec.shape}")
    if payload_bytes is not None and len(payload) != payload_bytes:
        raise CodecError(f"payload truncated or padded: header says {payload_bytes} bytes, got {len(payload)}")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != sha256:
        raise CodecError(f"checksum mismatch: header sha256 {sha256[:16]}..., payload has {digest[:16]}...")
    expected = raw_size(codec, block_size, specs)
    try:
        # max_output_size bounds memory: a decompression bomb cannot exceed what specs imply.
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected + 1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload is not valid zstd: {exc}") from exc
    if len(raw) != expected:
        raise CodecError(f"decoded length {len(raw)} bytes does not match the {expected} bytes the tensor specs imply")
    out = []
    offset = 0
    buf = memoryview(raw)
    for spec in specs:
        n = spec.numel
        if codec == "fp32":
            values = np.frombuffer(buf[offset : offset + 4 * n], dtype="<f4").astype(np.float32)
            offset += 4 * n
        else:
            nb = _nblocks(n, block_size)
            scales = np.frombuffer(buf[offset : offset + 4 * nb], dtype="<f4").astype(np.float32)
            offset += 4 * nb
            if not np.isfinite(scales).all():
                raise CodecError(f"tensor {spec.name!r} has non-finite block scales")
            if codec == "int8":
                q = np.frombuffer(buf[offset : offset + n], dtype=np.int8)
                offset += n
            else:
                nbytes = (n + 1) // 2
                q = _unpack_int4(np.frombuffer(buf[offset : offset + nbytes], dtype=np.uint8), n)
                offset += nbytes
            values = _dequantize(scales, q, block_size)
        if not np.isfinite(values).all():
            raise CodecError(f"tensor {spec.name!r} holds NaN or Inf")
        out.append((spec.name, values.reshape(spec.shape)))
    return out


def max_block_error(values: np.ndarray, codec: str, block_size: int) -> np.ndarray:
    """The per-element error bound of a lossy codec: half a quantization step of its block."""
    if codec == "fp32":
        return np.zeros(values.size, dtype=np.float32)
    flat = np.asarray(values, dtype=np.float32).reshape(-1)
    scales, _ = _quantize(flat, codec, block_size)
    return np.repeat(scales / 2, block_size)[: flat.size]


class ErrorFeedback:
    """Carries each tensor's quantization residual into the next round.

    What a lossy codec drops this round is added to next round's input, so the error does
    not accumulate: over many rounds, the sum of what was sent tracks the sum of the true
    pseudo-gradients within one round's quantization error.

    The residual is kept per tensor name, and a call updates only the tensors it encodes:
    with P fragments each call carries one fragment's tensors, and each fragment's residual
    must survive the other fragments' uploads until its own next one.
    """

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray] = {}

    def encode(self, arrays: list[tuple[str, np.ndarray]], codec: str, block_size: int) -> Encoded:
        corrected = [(n, a + self.residual[n]) if n in self.residual else (n, a) for n, a in arrays]
        enc = encode(corrected, codec, block_size)
        if codec == "fp32":
            for n, _ in arrays:  # sent exactly, residual included: nothing left to carry
                self.residual.pop(n, None)
            return enc
        decoded = decode(enc.payload, enc.codec, enc.block_size, enc.specs, enc.sha256)
        for (n, c), (_, d) in zip(corrected, decoded):
            self.residual[n] = np.asarray(c, dtype=np.float32) - d
        return enc
