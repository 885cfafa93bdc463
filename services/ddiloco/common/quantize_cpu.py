"""The quantizer's CPU kernels: ``quantize.py``'s rule in one pass over memory, compiled.

The torch path in ``quantize.py`` runs the rule as a chain of elementwise kernels over
L2-sized chunks: about ten passes through the cache per value (add the residual, abs,
amax, divide, round, clamp, convert, multiply back, subtract), each a separate loop with
its own overhead. On one core that held int8 encoding with error feedback near 1.1 GB/s
of fp32, where a memory copy runs at 3.5 to 6 GB/s. Here each block of values is read
from memory once into an L1-sized buffer, and every step runs on it before the next block
(numba compiles the loops to vectorized machine code), so only the input, the codes and
the residual cross main memory.

The arithmetic is the rule's, operation for operation, so that the bytes and decoded
values are identical to the torch path's (``tests/common/test_quantize_cpu.py`` holds
them to it, bit for bit):

* absmax as the largest ``bits(x) & 0x7FFFFFFF`` read as an int32: for non-negative
  floats the integer order is the float order, and a NaN's bits sort above Inf's, so a
  NaN reaches the scale as it does through torch's amax (and an integer maximum
  vectorizes, where a float one that must keep NaNs does not);
* ``scale = absmax / qmax`` and ``x / s`` as float32 divisions, ``rint`` (half to even),
  the clamp, the conversion; the residual is ``x - t * s`` with the rounded value ``t``
  (as the torch path: ``-0.0`` included), the decoded value ``float32(q) * scale``.

Compiled on first use in a process, every version the codec calls at once (a few seconds
each, ``ready``), under a file lock so that processes starting together do not write the
cache at once, and cached on disk beside this file, or in the user's cache when that is
read-only; where no cache can be written (a read-only file system) every process compiles
for itself. ``nogil``: a learner's
training thread and an outer optimizer's other RPCs go on while a payload is encoded.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading

import numba as nb
import numpy as np

log = logging.getLogger(__name__)

_OPTS = {"nogil": True, "boundscheck": False, "error_model": "numpy"}


def _njit(fn):
    try:
        return nb.njit(cache=True, **_OPTS)(fn)
    except RuntimeError:  # "cannot cache function": nowhere to write the cache
        return nb.njit(cache=False, **_OPTS)(fn)


def lock_path(kernel) -> str | None:
    """The file that serializes the kernels' compilation across processes: in the cache
    folder (None where they compile without a cache)."""
    folder = getattr(getattr(kernel, "_cache", None), "_cache_path", None)
    return os.path.join(folder, "ddiloco-kernels.lock") if folder else None


_ready = False
_ready_lock = threading.Lock()


# How long a process waits for another to finish compiling: far longer than compiling every
# version takes (seconds), short enough that a process frozen while holding the lock (a
# stopped learner) delays the others' first encode by this much at most
LOCK_WAIT_S = 120.0


def _lock(path: str | None, wait_s: float = LOCK_WAIT_S, shared: bool = False) -> int | None:
    """A descriptor holding an exclusive (``shared``: a shared) flock on ``path``, or None
    where there is none to take: no cache, a folder this user cannot write (numba saves
    nothing there either), a file system without flock, or a holder that keeps it past
    ``wait_s``. Without it the process compiles as numba alone would."""
    if path is None:
        return None
    try:  # flock needs no write access: a read-only descriptor serves any user
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
    # a blocking flock in a thread of its own, waited for a bounded time: the wait stays
    # visible to the kernel as one (/proc/locks) and costs no polling
    taken, guard = threading.Event(), threading.Lock()
    # "held" or "failed" once the flock returned; "given up" once the caller went on without it
    state = {"outcome": None}

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            outcome = "held"
        except OSError:  # a file system without flock: go on as numba alone would
            outcome = "failed"
        with guard:
            if state["outcome"] == "given up":  # the caller went on without it: let it go at once
                os.close(fd)
                return
            state["outcome"] = outcome
        taken.set()

    threading.Thread(target=take, name="kernel-cache-lock", daemon=True).start()
    taken.wait(wait_s)
    with guard:
        if state["outcome"] == "held":
            return fd
        if state["outcome"] == "failed":
            os.close(fd)
            return None
        state["outcome"] = "given up"
    log.warning("kernel cache lock %s still held after %.0f s; compiling without it", path, wait_s)
    return None


def _versions() -> list[tuple]:
    """One call of every compiled version the codec uses, in a fixed order: the quantizer
    writes int8 or packed uint8 codes; the decoder reads them from a payload's bytes
    (read-only) or from an array of the caller's (writable). Every float array comes from a
    torch tensor or numpy's allocator: aligned and writable."""
    f32 = np.zeros(2, np.float32)
    out = []
    for codes in (np.zeros(2, np.int8), np.zeros(1, np.uint8)):
        qmax = 127 if codes.dtype == np.int8 else 7
        out.append((quantize, (f32.copy(), f32.copy(), qmax, 2, np.zeros(1, np.float32), codes.copy(), f32.copy(), f32.copy())))
        for writable in (True, False):
            c = codes.copy()
            c.flags.writeable = writable
            out.append((dequantize, (c, qmax, 2, np.ones(1, np.float32), f32.copy())))
    return out


def complete_marker(lock: str | None) -> str | None:
    """The file beside the lock that says every version the codec uses is saved in this
    cache for what numba checks a saved version against: this module's source (its
    modification time and size), numba's and Python's versions and the CPU the code is
    compiled for. A process writes it under the exclusive lock once it has saved them all."""
    if lock is None:
        return None
    try:
        st = os.stat(__file__)
        cpu = quantize.targetctx.codegen().magic_tuple()
    except (OSError, AttributeError):  # no source file, or a numba without these: no marker
        return None
    key = (nb.__version__, sys.version_info[:2], st.st_mtime_ns, st.st_size, cpu)
    return f"{lock}.{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}.complete"


def _load_saved() -> bool:
    """Call every version, saving nothing to the cache: True if each was loaded from it. A
    version missing from it compiles in this process alone, unsaved (saving is what must
    never happen beside another process), and the answer is False."""
    kernels = (quantize, dequantize)
    misses = sum(sum(k.stats.cache_misses.values()) for k in kernels)
    for k in kernels:
        k._cache.save_overload = lambda sig, data: None  # the instance's, over the class's
    try:
        for kernel, args in _versions():
            kernel(*args)
    finally:
        for k in kernels:
            del k._cache.save_overload
    return sum(sum(k.stats.cache_misses.values()) for k in kernels) == misses


def _load_shared(lock: str | None) -> bool | None:
    """``_load_saved`` under a shared lock: None where that lock cannot be taken."""
    fd = _lock(lock, shared=True)
    if fd is None:
        return None
    try:
        return _load_saved()
    finally:
        os.close(fd)


def _set_marker(marker: str, complete: bool) -> None:
    """Write (or, for a cache found incomplete, remove) ``marker``; a failure only costs
    later processes the shared lock."""
    try:
        if complete:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o666))
        else:
            os.unlink(marker)
    except OSError as exc:
        log.debug("kernel cache marker %s: %s", marker, exc)


def ready() -> None:
    """Compile (or load from the cache) every version the codec uses, once per process,
    holding a file lock in the cache folder. Why: numba's cache keeps one index per
    function, which a process reads, extends and writes back as it saves a newly compiled
    version, numbering the data files from what it read. Two processes saving two versions
    at once (an int8 and an int4 run starting together; a learner decoding payloads while
    another process decodes arrays it wrote) can both take number 1, and the index may then
    name one version's machine code for the other's signature: called with arrays it was
    not compiled for, a kernel that skips bounds checks writes past them. Under the lock
    one process compiles and saves the versions, in one order, while the others wait, then
    writes ``complete_marker``.

    A process that finds the marker only loads, under a *shared* lock, beside the others
    that load: held exclusively for loading too, the lock made the learners of one host
    load one after another (about 0.2 s each on an idle machine, seconds each once the first
    learners train on the same cores), so their training began up to 10 s apart and the
    first to start trained alone (docs/quality.md, M = 8). Should a version be missing all
    the same (cache files removed), it compiles unsaved, the marker is removed, and the
    process goes on as one that found none. A process that waited for the exclusive lock
    while another compiled looks for the marker again once it holds it, and loads under the
    shared lock if it is there: processes started together on an empty cache load beside
    one another once the first has saved, not one after another."""
    global _ready
    if _ready:  # every call after the first
        return
    with _ready_lock:
        if not _ready:
            _prepare(lock_path(quantize))
            _ready = True


def _prepare(lock: str | None) -> None:
    """``ready``'s work: load every version beside the others where the marker says the
    cache holds them all, else compile (or load) and save them under the exclusive lock."""
    marker = complete_marker(lock)

    def marked() -> bool:  # a process saved every version
        return marker is not None and os.path.exists(marker)

    unsaved = False  # a version this process compiled without saving it
    if marked():
        if loaded := _load_shared(lock):
            return
        unsaved = loaded is False
    fd = _lock(lock)
    if fd is not None and not unsaved and marked():
        os.close(fd)  # saved by the process this one waited for: load beside the others
        if loaded := _load_shared(lock):
            return
        unsaved = loaded is False
        fd = _lock(lock)
    try:
        for kernel, args in _versions():  # loaded, or compiled and saved, under the lock
            kernel(*args)
        if fd is not None and marker is not None:
            _set_marker(marker, complete=not unsaved)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


@_njit
def quantize(x, addend, qmax, block, scales, codes, residual, decoded):  # pragma: no cover - compiled
    """``quantize.quantize`` on numpy arrays. ``addend``, ``residual`` and ``decoded`` are
    used when they hold as many values as ``x`` (pass empty arrays otherwise); ``residual``
    may be ``x`` itself. Returns False when a scale is not finite (a NaN or an Inf in ``x``:
    the outputs are then meaningless)."""
    n = x.size
    has_add = addend.size == n and n > 0
    has_res = residual.size == n and n > 0
    has_dec = decoded.size == n and n > 0
    packed = qmax == 7
    qm = np.float32(qmax)
    nqm = -qm
    one = np.float32(1.0)
    # scratch for one block, never wider than the tensor: memory follows the data, not the
    # block size a caller names
    width = min(block, n)
    vals = np.empty(width, dtype=np.float32)  # this block's input (plus addend): L1-resident
    bits = vals.view(np.int32)
    t = np.empty(width, dtype=np.float32)  # rounded and clamped, as floats
    stage = np.empty(width, dtype=np.int8)  # the codes, before int4 packing
    box = np.empty(1, dtype=np.int32)
    box_f = box.view(np.float32)
    ok = True
    carry = np.int32(0)  # int4: the low nibble of a byte that a block of odd width left open
    for b in range((n + block - 1) // block):
        start = b * block
        w = min(block, n - start)
        xs = x[start : start + w]
        if has_add:
            ad = addend[start : start + w]
            for j in range(w):
                vals[j] = xs[j] + ad[j]
        else:
            for j in range(w):
                vals[j] = xs[j]
        m = np.int32(0)
        for j in range(w):
            m = max(m, bits[j] & np.int32(0x7FFFFFFF))
        box[0] = m
        sc = box_f[0] / qm
        scales[b] = sc
        if not np.isfinite(sc):
            ok = False
        s = sc if sc > 0 else one
        for j in range(w):
            r = np.rint(vals[j] / s)
            r = qm if r > qm else r
            r = nqm if r < nqm else r
            t[j] = r
        for j in range(w):
            stage[j] = np.int8(t[j])
        if has_dec:
            ds = decoded[start : start + w]
            for j in range(w):
                ds[j] = np.float32(stage[j]) * sc
        if has_res:
            rs = residual[start : start + w]
            for j in range(w):
                rs[j] = vals[j] - t[j] * s
        if not packed:
            cs = codes[start : start + w]
            for j in range(w):
                cs[j] = stage[j]
            continue
        # int4: byte i holds values 2i (low nibble) and 2i + 1 (high), each offset by 8
        j = 0
        if start % 2 == 1:
            codes[start // 2] = np.uint8(carry | ((np.int32(stage[0]) + 8) << 4))
            j = 1
        at = (start + j) // 2
        pairs = (w - j) // 2
        for k in range(pairs):
            codes[at + k] = np.uint8((np.int32(stage[j + 2 * k]) + 8) | ((np.int32(stage[j + 2 * k + 1]) + 8) << 4))
        j += 2 * pairs
        if j < w:
            carry = np.int32(stage[j]) + 8
            if start + w == n:  # an odd tail: padded with the code of 0
                codes[(start + j) // 2] = np.uint8(carry | (8 << 4))
    return ok


@_njit
def dequantize(codes, qmax, block, scales, out):  # pragma: no cover - compiled
    """``quantize.dequantize`` on numpy arrays: ``out[i] = float32(q_i) * scale``."""
    n = out.size
    packed = qmax == 7
    stage = np.empty(min(block, n) + 2, dtype=np.float32)  # as wide as a block, or the tensor
    for b in range((n + block - 1) // block):
        start = b * block
        w = min(block, n - start)
        sc = scales[b]
        os = out[start : start + w]
        if not packed:
            cs = codes[start : start + w]
            for j in range(w):
                os[j] = np.float32(cs[j]) * sc
            continue
        first = start // 2
        for k in range((start + w + 1) // 2 - first):
            c = np.int32(codes[first + k])
            stage[2 * k] = np.float32((c & 15) - 8)
            stage[2 * k + 1] = np.float32((c >> 4) - 8)
        off = start % 2
        for j in range(w):
            os[j] = stage[off + j] * sc
