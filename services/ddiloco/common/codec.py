"""Wire codec for tensors: per-block absmax quantization, optional zstd, a digest.

Payload layout (before compression), for each tensor in order:

* ``fp32``: the tensor's values as little-endian float32.
* ``int8``: ``nblocks`` float32 scales, then ``numel`` int8 values, where
  ``value ~= q * scale`` and ``scale = absmax(block) / 127``.
* ``int4``: ``nblocks`` float32 scales, then ``ceil(numel / 2)`` bytes holding two signed
  4-bit values each (low nibble first, offset by 8), ``scale = absmax(block) / 7``.

Blocks run over the flattened tensor, so every shape (0-d, 1-d, n-d) is handled alike; the
last block of a tensor may be short. The arithmetic is in ``quantize.py``.

Formats (``PayloadInfo.format``): the layout above is the same in both; what differs is
the envelope.

* 1, the first: always zstd (level 3), protected by a SHA-256 of the payload as sent.
  Decoded still (journals and peers of earlier versions); no longer written.
* 2: compressed as the header says (``none`` or ``zstd``), protected by an XXH3-128 of the
  payload as sent. Per codec, zstd is used only where it pays for its time
  (``DEFAULT_COMPRESSION``). The digest guards against corruption in transit and on disk,
  which is all SHA-256 did here too (an unkeyed digest proves nothing against someone who
  can rewrite the header), at a small fraction of the time.

A format this version does not know is refused, naming it.

Decoding trusts nothing: it checks the format, the length and digest of what arrived, the
decompressed length against what the tensor specs imply, and that every value is finite.
Any failure raises ``CodecError`` with a message that says what was wrong.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from ddiloco.common import quantize as qz
from ddiloco.common.config import CODECS, MAX_BLOCK_SIZE, block_size_ok

QMAX = {"int8": 127, "int4": 7}  # largest code of each lossy codec
FORMAT = 2  # what encode writes
FORMATS = (1, 2)  # what decode reads
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 3
# zstd saves ~5% of an int8 payload and ~12% of an int4 one (literals only: quantized
# values hold no repeats to match), at a cost several times that of the quantization
# itself; full fp32 fragments (a learner joining) are rare.
DEFAULT_COMPRESSION = {"fp32": "zstd", "int8": "none", "int4": "none"}


class CodecError(ValueError):
    """The payload is not what its header says it is."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @functools.cached_property
    def numel(self) -> int:
        # exact (a Python int never wraps), and computed once per spec: it is asked several
        # times per tensor of every payload, and np.prod on a short tuple took a tenth of the
        # outer optimizer's interpreter time on the tiny model's many small tensors
        return math.prod(int(d) for d in self.shape)


@dataclass(frozen=True)
class Encoded:
    codec: str
    block_size: int
    specs: tuple[TensorSpec, ...]
    # as sent: uncompressed, the very buffer the quantizer wrote (a bytearray: no copy of
    # the payload at the end of every encode); treat it as read-only
    payload: bytes | bytearray
    digest: str  # format 2: hex XXH3-128 of ``payload``
    raw_bytes: int  # size before compression, for logs
    compression: str = "none"
    format: int = FORMAT


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


def float32_raw_size(codec: str, block_size: int, shapes) -> int:
    """``raw_size`` of float32 tensors of these ``shapes`` (names do not change the size): what
    a fragment's delta takes uncompressed, for the size checks at start and on every header."""
    return raw_size(codec, block_size, tuple(TensorSpec("", tuple(s), "float32") for s in shapes))


def payload_bound(raw: int) -> int:
    """The most bytes a payload of ``raw`` uncompressed bytes can take as sent: raw itself,
    or zstd's worst case (zstd's own bound is raw + raw/256 + under 64 KiB / 2048 for small
    inputs, plus a frame header; this leaves room above all of it)."""
    return raw + (raw >> 7) + (1 << 12)


def digest_of(payload, fmt: int = FORMAT) -> str:
    """The digest a header of format ``fmt`` carries for ``payload`` (hex)."""
    if fmt == 1:
        return hashlib.sha256(payload).hexdigest()
    return xxhash.xxh3_128_hexdigest(payload)


HELD_DIGEST_BYTES = 32


def held_digest(arrays) -> bytes:
    """SHA-256 of float arrays' float32 values, in order (numpy, or torch on any device): how
    a learner names a copy of a fragment it holds without sending it
    (``PullGlobalRequest.have_digest``). Shapes and names are not in it; the run's model
    signature already fixed them at registration. The model signature's ``values_sha256``
    is the same digest over the whole model."""
    h = hashlib.sha256()
    for arr in arrays:
        t, _ = _flat(arr)
        h.update(t.cpu().numpy())  # the contiguous float32 buffer itself, not a copy of it
    return h.digest()


# ----------------------------------------------------------------------------- encoding
def _flat(arr) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A flat float32 contiguous tensor of ``arr`` (numpy or torch, any device), sharing
    memory where it can, and the shape."""
    if isinstance(arr, torch.Tensor):
        t = arr.detach()
        return t.to(torch.float32).contiguous().reshape(-1), tuple(int(d) for d in t.shape)
    flat = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if not flat.flags.writeable:  # torch wants a writable buffer; this codec never writes it
        flat = flat.copy()
    return torch.from_numpy(flat), tuple(int(d) for d in np.shape(arr))


def _check_codec(codec: str, block_size: int) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if not block_size_ok(block_size):
        raise CodecError(f"block size must be an even number from 2 to {MAX_BLOCK_SIZE}, got {block_size}")


def _groups(numels: list[int], block_size: int) -> list[list[int]]:
    """Which tensors the decoder dequantizes in one call: runs of consecutive tensors whose
    block-padded sizes add up to at most one chunk of the quantizer (``CHUNK_ELEMS``), and
    alone every larger tensor and every one that padding would more than double: the work
    stays proportional to the values sent, whatever the block size.

    Why: a model holds many small tensors (norms, biases, a small model's every matrix), and
    checking and dequantizing one costs a few torch and numpy calls whatever its size; the
    tiny model's 28 tensors decode in 0.19 ms batched against 1.3 ms one at a time. Padding
    codes of 0 to whole blocks decode to zeros that are dropped, so the values are exactly
    those of tensor-by-tensor decoding. (The encoder quantizes one tensor at a time: its
    compiled kernel is called directly, and batching would only add two copies.)"""
    limit = qz.CHUNK_ELEMS
    groups: list[list[int]] = []
    run: list[int] = []
    filled = 0
    for i, n in enumerate(numels):
        padded = _nblocks(n, block_size) * block_size
        # a tensor padded to more than twice its size goes alone too: the block size is the
        # sender's (up to 2^20), and padding a thousand one-value tensors to whole blocks of
        # it made the work of a decode the sender's to choose (seconds for a 20 kB payload)
        if padded > limit or padded > 2 * n:
            if run:
                groups.append(run)
            groups.append([i])
            run, filled = [], 0
            continue
        if run and filled + padded > limit:
            groups.append(run)
            run, filled = [], 0
        run.append(i)
        filled += padded
    if run:
        groups.append(run)
    return groups


def _places(raw: np.ndarray, codec: str, block_size: int, numels: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every tensor's place in a lossy payload (``raw``, bytes): views of its scales (float32)
    and of its codes (int8, or packed uint8 for int4), in order."""
    scales, codes, offset = [], [], 0
    for n in numels:
        nb = _nblocks(n, block_size)
        ncodes = n if codec == "int8" else (n + 1) // 2
        scales.append(raw[offset : offset + 4 * nb].view("<f4"))
        c = raw[offset + 4 * nb : offset + 4 * nb + ncodes]
        codes.append(c.view(np.int8) if codec == "int8" else c)
        offset += 4 * nb + ncodes
    return scales, codes


def _quantize_one(x: torch.Tensor, codec: str, block_size: int, scales_np: np.ndarray, codes_np: np.ndarray,
                  residual: bool, addend: torch.Tensor | None, decoded: torch.Tensor | None) -> bool:
    """Quantize one flat tensor into its place in the payload (``scales_np``, ``codes_np``)."""
    qmax = QMAX[codec]
    if x.device.type == "cpu":
        return qz.quantize(x, qmax, block_size, torch.from_numpy(scales_np), torch.from_numpy(codes_np),
                           x if residual else None, addend, decoded)
    # quantize where the tensor lives; only the codes and scales cross to the host
    scales = torch.empty(scales_np.size, dtype=torch.float32, device=x.device)
    codes = torch.empty(codes_np.size, dtype=torch.int8 if codec == "int8" else torch.uint8, device=x.device)
    on_device = torch.empty_like(x) if decoded is not None else None
    ok = qz.quantize(x, qmax, block_size, scales, codes, x if residual else None, addend, on_device)
    scales_np[:] = scales.cpu().numpy()
    codes_np[:] = codes.cpu().numpy()
    if decoded is not None:
        decoded.copy_(on_device.cpu())
    return ok


def _encode_flat(
    named: list[tuple[str, torch.Tensor, tuple[int, ...]]],
    codec: str,
    block_size: int,
    compression: str | None,
    residuals: bool = False,
    addends: list[torch.Tensor | None] | None = None,
    sent: list[np.ndarray] | None = None,
) -> Encoded:
    """Encode flat tensors; with ``residuals``, each input tensor is overwritten by its
    quantization residual (the caller owns it: error feedback), and what is encoded is the
    tensor plus its ``addends`` entry where there is one. With ``sent`` (a list), it receives
    what the receiver will decode, bit for bit, as float32 arrays of the input shapes."""
    compression = DEFAULT_COMPRESSION[codec] if compression is None else compression
    if compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
    specs = tuple(TensorSpec(name, shape) for name, _, shape in named)
    buf = bytearray(raw_size(codec, block_size, specs))
    raw = np.frombuffer(buf, dtype=np.uint8)
    addends = addends if addends is not None else [None] * len(named)
    if codec == "fp32":
        offset = 0
        for name, x, shape in named:
            n = x.numel()
            dst = raw[offset : offset + 4 * n].view("<f4")
            dst[:] = x.cpu().numpy()
            if not np.isfinite(dst).all():
                raise CodecError(f"tensor {name!r} holds NaN or Inf")
            if sent is not None:
                sent.append(dst.astype(np.float32).reshape(shape))
            offset += 4 * n
    else:
        numels = [x.numel() for _, x, _ in named]
        scales_nps, codes_nps = _places(raw, codec, block_size, numels)
        values = [np.empty(shape, dtype=np.float32) for _, _, shape in named] if sent is not None else None
        decoded = [torch.from_numpy(v.reshape(-1)) for v in values] if values is not None else [None] * len(named)
        # one tensor at a time: the compiled kernel's call costs microseconds, so batching small
        # tensors into one buffer (as the decoder does) would only add two copies
        for i, (name, x, _) in enumerate(named):
            if not _quantize_one(x, codec, block_size, scales_nps[i], codes_nps[i], residuals, addends[i],
                                 decoded[i]):
                raise CodecError(f"tensor {name!r} holds NaN or Inf")
        if sent is not None:
            sent.extend(values)
    if compression == "zstd":
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    else:
        payload = buf
    return Encoded(
        codec=codec,
        block_size=block_size,
        specs=specs,
        payload=payload,
        digest=digest_of(payload),
        raw_bytes=raw.size,
        compression=compression,
    )


def encode(arrays: list, codec: str = "int8", block_size: int = 64, compression: str | None = None) -> Encoded:
    """Encode named float arrays (numpy, or torch on any device). Non-finite inputs are
    refused: they would poison a merge. ``compression``: ``none`` or ``zstd``; by default
    the codec's ``DEFAULT_COMPRESSION``."""
    _check_codec(codec, block_size)
    return _encode_flat(_named_flat(arrays), codec, block_size, compression)


def _named_flat(arrays: list) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(name, flat float32 tensor, shape) of each named array, as ``_encode_flat`` takes them."""
    return [(name, *_flat(arr)) for name, arr in arrays]


def encode_with_sent(arrays: list, codec: str = "int8", block_size: int = 64,
                     compression: str | None = None) -> tuple[Encoded, list[np.ndarray]]:
    """``encode``, and the float32 values the receiver will decode from it (bit for bit what
    ``decode_encoded`` gives), taken from the quantizer as it writes the codes: for a sender
    that must keep what the receiver holds, without decoding its own payload."""
    _check_codec(codec, block_size)
    sent: list[np.ndarray] = []
    enc = _encode_flat(_named_flat(arrays), codec, block_size, compression, sent=sent)
    return enc, sent


# ----------------------------------------------------------------------------- decoding
def decode(
    payload,
    codec: str,
    block_size: int,
    specs: tuple[TensorSpec, ...],
    digest: str,
    payload_bytes: int | None = None,
    *,
    fmt: int = FORMAT,
    compression: str | None = None,
) -> list[tuple[str, np.ndarray]]:
    """Validate and decode a payload into named float32 arrays, in spec order. ``digest``
    is the one of format ``fmt`` (format 1: SHA-256; 2: XXH3-128); format 1 payloads are
    zstd, format 2 ones as ``compression`` says."""
    if fmt not in FORMATS:
        raise CodecError(
            f"payload format {fmt} is unknown to this version, which reads formats {FORMATS}: "
            "the peer runs a newer ddiloco; run one version throughout"
        )
    if fmt == 1:
        compression = "zstd"
    elif compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    if codec != "fp32" and not block_size_ok(block_size):
        raise CodecError(f"invalid block size {block_size}: an even number from 2 to {MAX_BLOCK_SIZE}")
    for spec in specs:
        if spec.dtype != "float32":
            raise CodecError(f"tensor {spec.name!r} has dtype {spec.dtype!r}; only float32 is accepted")
        if any(d < 0 for d in spec.shape):
            raise CodecError(f"tensor {spec.name!r} has a negative dimension {spec.shape}")
    if payload_bytes is not None and len(payload) != payload_bytes:
        raise CodecError(f"payload truncated or padded: header says {payload_bytes} bytes, got {len(payload)}")
    got = digest_of(payload, fmt)
    if got != digest:
        what = "sha256" if fmt == 1 else "xxh3_128"
        raise CodecError(f"checksum mismatch: header {what} {digest[:16]}..., payload has {got[:16]}...")
    expected = raw_size(codec, block_size, specs)
    if compression == "zstd":
        try:
            # A frame that states its content size is decompressed into a buffer of that size,
            # whatever max_output_size says (zstandard 0.25): a 16 kB frame of RLE blocks
            # stating 512 MiB fills 512 MiB, one stating 2^46 bytes fails to allocate. So the
            # stated size must be what the specs imply before anything is allocated; a frame
            # that states none is held to max_output_size.
            declared = zstandard.frame_content_size(payload)
            if declared >= 0 and declared != expected:
                raise CodecError(
                    f"payload's zstd frame states {declared} bytes, which does not match the {expected} bytes "
                    "the tensor specs imply"
                )
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected + 1)
        except zstandard.ZstdError as exc:
            raise CodecError(f"payload is not valid zstd: {exc}") from exc
    else:
        raw = payload
    if len(raw) != expected:
        raise CodecError(f"decoded length {len(raw)} bytes does not match the {expected} bytes the tensor specs imply")
    buf = np.frombuffer(raw, dtype=np.uint8)
    if codec == "fp32":
        out = []
        offset = 0
        for spec in specs:
            n = spec.numel
            values = np.empty(n, dtype=np.float32)
            values[:] = buf[offset : offset + 4 * n].view("<f4")
            offset += 4 * n
            if not bool(np.isfinite(values).all()):
                raise CodecError(f"tensor {spec.name!r} holds NaN or Inf")
            out.append((spec.name, values.reshape(spec.shape)))
        return out
    numels = [spec.numel for spec in specs]
    scales_at, codes_at = _places(buf, codec, block_size, numels)
    values: list[np.ndarray] = []
    for group in _groups(numels, block_size):
        if len(group) == 1:
            i = group[0]
            values.append(_dequantize_one(specs[i], codec, block_size, scales_at[i], codes_at[i]))
        else:
            values.extend(_dequantize_run([specs[i] for i in group], codec, block_size,
                                          [scales_at[i] for i in group], [codes_at[i] for i in group]))
    return [(spec.name, v) for spec, v in zip(specs, values)]


def _dequantize_one(spec: TensorSpec, codec: str, block_size: int, scales_np: np.ndarray,
                    codes: np.ndarray) -> np.ndarray:
    n = spec.numel
    values = np.empty(n, dtype=np.float32)
    scales = torch.from_numpy(scales_np.astype(np.float32))
    if not bool(torch.isfinite(scales).all()):
        raise CodecError(f"tensor {spec.name!r} has non-finite block scales")
    qz.dequantize(codes, QMAX[codec], block_size, scales, torch.from_numpy(values))
    # finite scales small enough make every value finite; only huge ones need a look
    if not (qz.scales_are_safe(scales) or bool(np.isfinite(values).all())):
        raise CodecError(f"tensor {spec.name!r} holds NaN or Inf")
    return values.reshape(spec.shape)


def _dequantize_run(specs: list[TensorSpec], codec: str, block_size: int, scales_nps: list[np.ndarray],
                    codes_nps: list[np.ndarray]) -> list[np.ndarray]:
    """Several small tensors in one call (``_groups``): their codes and scales gathered
    into whole blocks (padding decodes to zeros, dropped), one dequantization, and each
    tensor's values a view of the result. The same values as one tensor at a time, and the
    same refusals, in the same order of tensors."""
    ns = [spec.numel for spec in specs]
    padded = [_nblocks(n, block_size) * block_size for n in ns]
    total = sum(padded)
    scales = np.concatenate(scales_nps).astype(np.float32)
    scales_t = torch.from_numpy(scales)
    if codec == "int8":
        codes = np.zeros(total, dtype=np.int8)
    else:
        codes = np.full(total // 2, 0x88, dtype=np.uint8)  # two codes of 0 per byte
    at = 0
    for n, p, c in zip(ns, padded, codes_nps):
        if codec == "int8":
            codes[at : at + n] = c
        else:
            codes[at // 2 : at // 2 + c.size] = c
        at += p
    # non-finite scales decode to NaN here, harmlessly: the checks below refuse them, tensor by
    # tensor in order, as one tensor at a time would
    values = np.empty(total, dtype=np.float32)
    qz.dequantize(codes, QMAX[codec], block_size, scales_t, torch.from_numpy(values))
    safe = qz.scales_are_safe(scales_t)
    out = []
    at, s_at = 0, 0
    for spec, n, p in zip(specs, ns, padded):
        nb = p // block_size
        v = values[at : at + n]
        if not safe:
            if not bool(np.isfinite(scales[s_at : s_at + nb]).all()):
                raise CodecError(f"tensor {spec.name!r} has non-finite block scales")
            if not bool(np.isfinite(v).all()):
                raise CodecError(f"tensor {spec.name!r} holds NaN or Inf")
        out.append(v.reshape(spec.shape))
        at += p
        s_at += nb
    return out


def decode_encoded(enc: Encoded) -> list[tuple[str, np.ndarray]]:
    """Decode what ``encode`` produced (validated like anything else)."""
    return decode(enc.payload, enc.codec, enc.block_size, enc.specs, enc.digest, len(enc.payload),
                  fmt=enc.format, compression=enc.compression)


def max_block_error(values: np.ndarray, codec: str, block_size: int) -> np.ndarray:
    """The per-element error bound of a lossy codec: half a quantization step of its block
    (the block's scale). A block whose step is below the smallest normal float32 (absolute
    values under about 1.5e-36 in int8) has a scale of few significant bits, or 0, and may
    be off by more, by at most about 1e-37 in absolute terms (``tests/common/
    test_codec_reference.py`` holds the codec to that, from the inputs alone). The scale is
    kept as the first codec computed it, so its bytes stay the same."""
    if codec == "fp32":
        return np.zeros(np.size(values), dtype=np.float32)
    x, _ = _flat(values)
    n = x.numel()
    scales = torch.empty(_nblocks(n, block_size), dtype=torch.float32)
    codes = torch.empty(n if codec == "int8" else (n + 1) // 2, dtype=torch.int8 if codec == "int8" else torch.uint8)
    qz.quantize(x, QMAX[codec], block_size, scales, codes)
    return np.repeat(scales.numpy() / 2, block_size)[:n]


class ErrorFeedback:
    """Carries each tensor's quantization residual into the next round.

    What a lossy codec drops this round is added to next round's input, so the error does
    not accumulate: over many rounds, the sum of what was sent tracks the sum of the true
    pseudo-gradients within one round's quantization error.

    The residual is kept per tensor name, and a call updates only the tensors it encodes:
    with P fragments each call carries one fragment's tensors, and each fragment's residual
    must survive the other fragments' uploads until its own next one.

    The quantizer writes the residual as it goes (input minus its decoded value, bit for
    bit what decoding the payload would give), into the buffer that held this round's
    corrected input: no decode, no extra pass, no allocation once the first round is done.
    Residuals live where the inputs do (numpy, or torch on the inputs' device).
    """

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray | torch.Tensor] = {}

    def _corrected(self, name: str, arr) -> tuple[np.ndarray | torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This round's input plus the residual, in a buffer this object owns: (the buffer as
        kept, its flat float32 tensor, and what the quantizer still has to add to it: the
        input, when the buffer holds the residual; residual + input == input + residual, bit
        for bit)."""
        prev = self.residual.get(name)
        if isinstance(arr, torch.Tensor):
            a = arr.detach()
            if prev is not None:
                if isinstance(prev, torch.Tensor) and a.dtype == torch.float32 and prev.shape == a.shape and prev.device == a.device:
                    return prev, prev.reshape(-1), a.contiguous().reshape(-1)
                c = (a + torch.as_tensor(prev, device=a.device)).to(torch.float32).contiguous()
            else:
                c = a.to(torch.float32, copy=True).contiguous()
            return c, c.reshape(-1), None
        a = np.asarray(arr)
        if prev is not None:
            if isinstance(prev, np.ndarray) and a.dtype == np.float32 and prev.shape == a.shape:
                flat_a = np.ascontiguousarray(a).reshape(-1)
                if not flat_a.flags.writeable:
                    flat_a = flat_a.copy()
                return prev, torch.from_numpy(prev.reshape(-1)), torch.from_numpy(flat_a)
            c = np.ascontiguousarray(a + np.asarray(prev), dtype=np.float32)
        else:
            c = np.array(a, dtype=np.float32, order="C", copy=True)
        return c, torch.from_numpy(c.reshape(-1)), None

    def encode(self, arrays: list, codec: str, block_size: int, compression: str | None = None) -> Encoded:
        _check_codec(codec, block_size)
        if codec == "fp32":
            corrected = [(n, a + self.residual[n]) if n in self.residual else (n, a) for n, a in arrays]
            enc = encode(corrected, codec, block_size, compression)
            for n, _ in arrays:  # sent exactly, residual included: nothing left to carry
                self.residual.pop(n, None)
            return enc
        named, kept, addends = [], [], []
        for name, arr in arrays:
            buf, flat, addend = self._corrected(name, arr)
            named.append((name, flat, tuple(int(d) for d in np.shape(arr))))
            kept.append((name, buf))
            addends.append(addend)
        try:
            enc = _encode_flat(named, codec, block_size, compression, residuals=True, addends=addends)
        except CodecError:
            for name, _ in arrays:  # the buffers are half overwritten: start these tensors afresh
                self.residual.pop(name, None)
            raise
        for name, buf in kept:
            self.residual[name] = buf
        return enc

    def withdraw(self, arrays: list, enc: Encoded) -> None:
        """Undo ``encode(arrays)``, whose payload ``enc`` was never applied (the outer
        optimizer refused it as stale, for good). Each tensor's residual goes back to what
        it was before: r = sent + r_now - input (sent + r_now is this round's corrected
        input), so the next upload carries the error of the work that was merged and
        nothing of the refused work, whose windows are dropped. Kept, the refused delta's
        quantization error (up to half a step of its blocks) would have reached the model
        with the next delta. Exact to float32 rounding; the residual is updated in place
        rather than copied before every encode: one decode on a rare refusal instead of a
        copy on every upload."""
        sent = dict(decode_encoded(enc))
        for name, arr in arrays:
            if name not in sent:
                continue
            now = self.residual.get(name)
            if isinstance(arr, torch.Tensor):
                a = arr.detach().to(torch.float32)
                s = torch.as_tensor(sent[name], device=a.device).reshape(a.shape)
                prev = s - a if now is None else torch.as_tensor(now, device=a.device) + s - a
            else:
                a = np.asarray(arr, dtype=np.float32)
                s = sent[name].reshape(a.shape)
                prev = s - a if now is None else np.asarray(now) + s - a
            self.residual[name] = prev
