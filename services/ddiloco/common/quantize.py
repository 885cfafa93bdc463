"""The codec's arithmetic: per-block absmax quantization and its inverse.

The rule is the first codec's (numpy, PR history of ``codec.py``), step for step, so that the
same input gives bit-identical scales, codes and decoded values:

* ``absmax = max |x|`` over the block; ``scale = absmax / qmax`` (float32, correctly rounded);
* ``q = clamp(round_half_to_even(x / s), -qmax, qmax)`` with ``s = scale`` where ``scale > 0``,
  else 1 (a block of zeros, or one so small that its scale underflows to 0);
* decoded value ``= float32(q) * scale``.

Every step is an exactly rounded IEEE operation (division, not multiplication by a
reciprocal: a divisor that is a plain Python number lets some backends do the latter, so
divisors here are always tensors), hence the same bits on any CPU or GPU.

On the CPU the rule runs in ``quantize_cpu``'s compiled kernels, one pass over memory per
block. Elsewhere (a learner's delta on its GPU) it runs here in torch, where the whole tensor
is one chunk; the torch path also runs on the CPU, in the tests, as the kernels' check.

Why torch, in chunks: the first codec ran every step over the whole tensor, each step
allocating and writing a temporary as large as the input, so quantization cost several
passes through main memory. Here the input is taken ``CHUNK_ELEMS`` values at a time, the
scratch buffers fit in a core's L2 cache, and only the input, the codes and (with error
feedback) the residual travel through memory once each. torch's elementwise kernels are
vectorized; they run on the GPU unchanged when the input lives there. Reads from payload
bytes go through numpy, which takes read-only buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from ddiloco.common import quantize_cpu

# 256 Ki values: 1 MiB of float32 scratch plus the chunk of input, within a 2 MiB L2.
CHUNK_ELEMS = 1 << 18
# |q| <= 128 for every code either codec can carry (int8: -128..127, int4: -8..7), so scales
# whose magnitude is at most this bound give finite values without looking at each one.
_FINITE_SCALE = float(np.finfo(np.float32).max) / 128.0


def _chunk_rows(block: int, n: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(1, n // block)
    return max(1, CHUNK_ELEMS // block)


def _step(start: int, n: int, block: int, rows: int, full: int) -> tuple[int, int, int]:
    """The next chunk from value ``start``: (blocks, block width, values). Whole blocks in
    chunks of ``rows``, then the short last block alone."""
    done = start // block
    if done < full:
        k = min(rows, full - done)
        return k, block, k * block
    return 1, n - start, n - start


def quantize(
    x: torch.Tensor,
    qmax: int,
    block: int,
    scales: torch.Tensor,
    codes: torch.Tensor,
    residual: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
    decoded: torch.Tensor | None = None,
) -> bool:
    """Quantize the flat float32 tensor ``x`` into ``scales`` (float32, one per block) and
    ``codes`` (int8 per value for qmax 127; for qmax 7, uint8 holding two values each, low
    nibble first, offset by 8, an odd tail padded with the code of 0). With ``residual``
    (which may be ``x`` itself), it receives ``x`` minus its decoded value: what error
    feedback carries to the next round. With ``addend``, ``x`` is first replaced by
    ``x + addend``, chunk by chunk (error feedback's residual plus this round's input: one
    pass less through memory than adding first). Returns False if ``x`` holds a NaN or an
    Inf (the outputs are then meaningless)."""
    if x.numel() == 0:
        return True
    if x.device.type == "cpu":
        none = _NONE
        quantize_cpu.ready()
        return quantize_cpu.quantize(
            x.numpy(), none if addend is None else addend.numpy(), qmax, block, scales.numpy(), codes.numpy(),
            none if residual is None else residual.numpy(), none if decoded is None else decoded.numpy())
    return quantize_torch(x, qmax, block, scales, codes, residual, addend, decoded)


# the kernels' stand-in for an absent argument (numba takes no None in a typed slot)
_NONE = np.empty(0, dtype=np.float32)


def quantize_torch(x, qmax, block, scales, codes, residual=None, addend=None, decoded=None) -> bool:
    """``quantize`` (the same arguments, torch tensors on one device) in torch's
    elementwise kernels, on any device."""
    n = x.numel()
    if n == 0:
        return True
    device = x.device
    packed = qmax == 7
    rows = _chunk_rows(block, n, device)
    span = min(rows * block, n)
    tmp = torch.empty(span, dtype=torch.float32, device=device)
    stage = torch.empty(span + 1, dtype=torch.int8, device=device) if packed else None
    pair = torch.empty((span + 1) // 2, dtype=torch.int16, device=device) if packed else None
    qmax_t = torch.full((1,), float(qmax), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    full = n // block
    start = 0
    while start < n:
        k, width, length = _step(start, n, block, rows, full)
        xb = x[start : start + length].view(k, width)
        if addend is not None:
            xb.add_(addend[start : start + length].view(k, width))
        sc = scales[start // block : start // block + k]
        t = tmp[:length].view(k, width)
        # absmax (a NaN or an Inf carries into the scale); abs then amax along rows is several
        # times faster than aminmax along rows of 64 in torch's CPU kernels
        torch.amax(torch.abs(xb, out=t), dim=1, out=sc)
        torch.div(sc, qmax_t, out=sc)
        safe = torch.where(sc > 0, sc, one)
        torch.div(xb, safe.unsqueeze(1), out=t)
        t.round_()  # half to even, as numpy's rint
        t.clamp_(-qmax, qmax)
        q = stage[:length].view(k, width) if packed else codes[start : start + length].view(k, width)
        q.copy_(t)
        if decoded is not None:
            # from the codes, as dequantize reads them: a code of 0 is +0.0 there, where t may
            # hold -0.0 (a small negative value rounded)
            d = decoded[start : start + length].view(k, width)
            d.copy_(q)
            d.mul_(sc.unsqueeze(1))
        if residual is not None:
            t.mul_(sc.unsqueeze(1))  # the decoded value (up to the sign of a zero)
            torch.sub(xb, t, out=residual[start : start + length].view(k, width))
        if packed:
            _pack(stage, pair, length, codes, start // 2)
        start += length
    return bool(torch.isfinite(scales).all())


def _pack(stage: torch.Tensor, pair: torch.Tensor, length: int, codes: torch.Tensor, at: int) -> None:
    """Two signed 4-bit codes per byte: (q0 + 8) | (q1 + 8) << 4, read as little-endian pairs."""
    if length % 2:
        stage[length] = 0  # the padding value 0 (code 8), as the first codec wrote it
        length += 1
    stage[:length].add_(8)
    v = stage[:length].view(torch.int16)  # byte 2i is the low half: v = u0 | u1 << 8
    p = pair[: length // 2]
    torch.bitwise_right_shift(v, 4, out=p)  # u1 << 4 (u0 < 16 shifts out)
    p.bitwise_or_(v).bitwise_and_(0xFF)
    codes[at : at + length // 2].copy_(p)


def dequantize(codes: np.ndarray, qmax: int, block: int, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse: ``out`` (flat float32 on the CPU, n values) from ``codes`` (a read-only
    numpy view: int8, or packed uint8 for qmax 7) and ``scales``. Work is O(n) whatever
    ``block`` is: the block size comes from the sender's header."""
    if out.numel():
        quantize_cpu.ready()
        quantize_cpu.dequantize(codes, qmax, block, scales.numpy(), out.numpy())


def scales_are_safe(scales: torch.Tensor) -> bool:
    """Whether every value ``q * scale`` is finite for any code: the scales are finite and
    small enough. Otherwise the decoded values themselves must be checked."""
    if scales.numel() == 0:
        return True
    return bool(torch.isfinite(scales).all()) and float(scales.abs().max()) <= _FINITE_SCALE
