"""The compiled CPU kernels give, bit for bit, what the torch path gives (and dequantize what
a numpy computation written here gives): scales, codes, residual and decoded values, for
every block width and tail, with and without an addend, on values that probe the rule's
edges (zeros of both signs, subnormals, halves, values near the float32 maximum) and with
NaNs and Infs (refused alike)."""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from ddiloco.common import quantize, quantize_cpu

QMAX = {"int8": 127, "int4": 7}


def _values(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 3, size=n)).astype(np.float32)
    if kind == "edges" and n:
        x[:: 5] = 0.0
        x[1:: 7] = -0.0
        x[2:: 11] = np.float32(1e-41) * rng.integers(-3, 4, size=x[2::11].size)  # subnormal
        x[3:: 13] = np.float32(3e38) * np.sign(rng.standard_normal(x[3::13].size)).astype(np.float32)
        x[4:: 17] = np.float32(0.5) * rng.integers(-20, 20, size=x[4::17].size)  # exact halves of a step
    if kind == "tiny" and n:
        x[:] = np.float32(1e-42) * rng.integers(-5, 6, size=n)  # every scale underflows to 0
    return x


def _run(fn, x, qmax, block, addend, residual, decoded):
    n = x.size
    nb = -(-n // block)
    scales = np.full(nb, 7.0, np.float32)
    codes = np.full(n if qmax == 127 else (n + 1) // 2, 0x55, np.int8 if qmax == 127 else np.uint8)
    xs = x.copy()
    res = xs if residual == "in-place" else (np.zeros(n, np.float32) if residual == "apart" else None)
    dec = np.zeros(n, np.float32) if decoded else None
    t = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    ok = fn(t(xs), qmax, block, t(scales), t(codes), t(res), t(addend), t(dec))
    return ok, scales, codes, res, dec


def _bits(a):
    return None if a is None else a.view(np.uint8).tobytes()


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [2, 6, 64, 250])  # even, as every payload header must say
@pytest.mark.parametrize("kind", ["normal", "edges", "tiny"])
def test_the_kernel_writes_the_torch_paths_bytes_and_values(name, block, kind):
    rng = np.random.default_rng([block, len(kind), QMAX[name]])
    for n in (1, 2, 5, block - 1, block, block + 1, 3 * block + 1, 1000, 4097):
        if n <= 0:
            continue
        x = _values(rng, n, kind)
        addend = _values(rng, n, "normal") if n % 2 else None  # finite sums
        for residual, decoded in (("in-place", True), ("apart", False), (None, True), (None, False)):
            want = _run(quantize.quantize_torch, x, QMAX[name], block, addend, residual, decoded)
            got = _run(quantize.quantize, x, QMAX[name], block, addend, residual, decoded)
            assert got[0] == want[0] and want[0], (n, residual)
            for g, w, what in zip(got[1:], want[1:], ("scales", "codes", "residual", "decoded")):
                assert _bits(g) == _bits(w), (what, n, residual, decoded)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_an_inf_is_reported_as_by_the_torch_path(name, bad):
    rng = np.random.default_rng(3)
    for at in (0, 63, 64, 200):
        x = _values(rng, 257, "normal")
        x[at] = bad
        want = _run(quantize.quantize_torch, x, QMAX[name], 64, None, "in-place", True)
        got = _run(quantize.quantize, x, QMAX[name], 64, None, "in-place", True)
        assert got[0] is False and want[0] is False
        # the blocks without it are quantized alike; the bad block's scale is not finite
        blk = at // 64
        assert np.isnan(got[1][blk]) == np.isnan(want[1][blk]) and not np.isfinite(got[1][blk])
        keep = np.arange(got[1].size) != blk
        assert _bits(got[1][keep]) == _bits(want[1][keep])


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [2, 64, 100])
def test_dequantize_is_each_code_times_its_blocks_scale(name, block):
    """The inverse, against numpy here: unpack the nibbles (low first, offset 8), multiply
    in float32 by the scale of the value's block."""
    rng = np.random.default_rng([block, QMAX[name]])
    for n in (1, 2, 7, block - 1, block, block + 1, 5 * block + 3, 4099):
        nb = -(-n // block)
        scales = (rng.standard_normal(nb) * 10.0 ** rng.integers(-30, 30, size=nb)).astype(np.float32)
        if name == "int8":
            codes = rng.integers(-128, 128, size=n, dtype=np.int8)
            q = codes.astype(np.float32)
        else:
            codes = rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8)
            q = np.stack([(codes & 15).astype(np.int16) - 8, (codes >> 4).astype(np.int16) - 8], 1)
            q = q.reshape(-1)[:n].astype(np.float32)
        want = q * np.repeat(scales, block)[:n]
        codes.flags.writeable = False  # as payload bytes arrive
        out = np.full(n, np.nan, np.float32)
        quantize.dequantize(codes, QMAX[name], block, torch.from_numpy(scales), torch.from_numpy(out))
        assert out.tobytes() == want.tobytes(), n


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_block_wider_than_the_tensor_is_one_block_and_sizes_nothing(name):
    """Scratch follows the tensor, not the block size named: a block of 2^40 values (4 TiB
    of scratch, were it sized by the block) over 1,001 values quantizes and decodes as one
    block of 1,002 (the even block just wider), bit for bit."""
    rng = np.random.default_rng(5)
    x = _values(rng, 1001, "normal")
    wide = _run(quantize.quantize, x, QMAX[name], 1 << 40, None, "apart", True)
    one = _run(quantize.quantize, x, QMAX[name], 1002, None, "apart", True)
    assert wide[0] and wide[1].size == 1
    for g, w in zip(wide[1:], one[1:]):
        assert _bits(g) == _bits(w)
    out_wide, out_one = np.empty(1001, np.float32), np.empty(1001, np.float32)
    quantize.dequantize(wide[2], QMAX[name], 1 << 40, torch.from_numpy(wide[1]), torch.from_numpy(out_wide))
    quantize.dequantize(one[2], QMAX[name], 1002, torch.from_numpy(one[1]), torch.from_numpy(out_one))
    assert out_wide.tobytes() == out_one.tobytes() == wide[4].tobytes()


def test_the_kernels_are_compiled_and_release_the_gil():
    """What makes them fast and lets other threads run while a payload is encoded."""
    x = torch.ones(10)
    scales, codes, out = torch.empty(1), torch.empty(10, dtype=torch.int8), torch.empty(10)
    assert quantize.quantize(x, 127, 64, scales, codes)
    quantize.dequantize(codes.numpy(), 127, 64, scales, out)
    assert torch.equal(out, x)
    for kernel in (quantize_cpu.quantize, quantize_cpu.dequantize):
        assert kernel.targetoptions["nogil"] is True
        assert kernel.signatures  # compiled machine code, not the interpreted function


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only mount in a mount namespace needs root and unshare")
def test_on_a_read_only_file_system_the_kernels_compile_without_a_cache(tmp_path):
    """Where neither the module's folder nor the user's cache can be written (a container
    with a read-only root file system), numba refuses to build a cached function at
    import; the kernels then compile in each process instead. Real: the module's file on a
    read-only bind mount, HOME on it too, in a mount namespace of its own."""
    src = pathlib.Path(quantize_cpu.__file__)
    ro = tmp_path / "ro"
    (ro / "home").mkdir(parents=True)
    shutil.copy(src, ro / src.name)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import numpy as np, quantize_cpu as k\n"
        "k.ready()\n"  # no cache, no lock
        "x = np.arange(-5, 6, dtype=np.float32); e = np.empty(0, np.float32)\n"
        "s = np.empty(1, np.float32); c = np.empty(11, np.int8)\n"
        "assert k.quantize(x, e, 127, 64, s, c, e, e)\n"
        "print(type(k.quantize._cache).__name__, s[0] == np.float32(5) / np.float32(127), c.tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(HOME=str(ro / "home"), XDG_CACHE_HOME=str(ro / "home"))
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && '
         'touch "$1/probe" 2>/dev/null && exit 3; exec "$2" -c "$3" "$1"', "sh", str(ro), sys.executable, script],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    kind, scale_ok, codes = out.stdout.split(" ", 2)
    assert kind == "NullCache" and scale_ok == "True"
    assert codes.strip() == str([round(v * 25.4) for v in range(-5, 6)])  # no ties: 25.4 v
    assert sorted(p.name for p in ro.iterdir()) == ["home", src.name]  # nothing was written


_EVERY_USE = """
import sys
import numpy as np
from ddiloco.common import codec, quantize_cpu as k
print(k.lock_path(k.quantize), flush=True)
sys.stdin.readline()
k.ready()
versions = (tuple(k.quantize.signatures), tuple(k.dequantize.signatures))
rng = np.random.default_rng(0)
arrays = [(f"t{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate([1, 7, 63, 64, 65, 300, 4097])]
for name in ("int8", "int4"):
    feedback = codec.ErrorFeedback()
    for compression in ("none", "zstd"):
        enc = feedback.encode(arrays, name, 64, compression)
        codec.decode_encoded(enc)
        codec.decode(bytes(enc.payload), name, 64, enc.specs, enc.digest, compression=compression)
        codec.decode_encoded(codec.encode_with_sent(arrays, name, 64, compression)[0])
assert (tuple(k.quantize.signatures), tuple(k.dequantize.signatures)) == versions, "a version ready() does not make"
print(len(versions[0]), len(versions[1]), flush=True)
"""


def _waits_for_a_lock(pid: int) -> bool:
    """Whether ``pid`` is blocked on a file lock (``/proc/locks`` marks waiters ``->``)."""
    return any("->" in line and f" {pid} " in line for line in pathlib.Path("/proc/locks").read_text().splitlines())


def _until_it_waits_for(proc: subprocess.Popen, what: str, within_s: float) -> None:
    """Poll (an observable state) until ``proc`` is blocked asking for ``what``."""
    deadline = time.monotonic() + within_s
    while not _waits_for_a_lock(proc.pid):
        assert proc.poll() is None, f"it went on without {what}: " + proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, f"it never asked for {what}"
        time.sleep(0.01)


def _start(script: str, env) -> tuple[subprocess.Popen, pathlib.Path]:
    """``script`` in a process of its own; it prints the lock's path, then waits for a line."""
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pathlib.Path(proc.stdout.readline().strip())


def test_a_process_compiles_every_version_only_under_the_cache_lock(tmp_path):
    """Two processes saving kernels to numba's cache at once can leave its index naming one
    version's machine code for another's signature (``quantize_cpu.ready``). A process with
    an empty cache waits for the lock before it compiles anything, then compiles every
    version the codec uses, and the codec's every path (int8 and int4, compressed or not,
    payloads read-only or not, error feedback, what was sent) needs no other."""
    cache = tmp_path / "cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    proc, lock = _start(_EVERY_USE, env)
    try:
        assert cache in lock.parents, lock
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            _until_it_waits_for(proc, "the lock", within_s=60)
            assert not list(cache.rglob("*.nbi")), "it compiled and saved before it held the lock"
        finally:
            os.close(fd)  # releases the lock
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["2", "4"]
    assert sorted(p.name.split("-")[0] for p in cache.rglob("*.nbi")) == ["quantize_cpu.dequantize", "quantize_cpu.quantize"]


def test_the_cache_lock_is_held_where_it_can_be_taken_and_skipped_where_not(tmp_path):
    """Without a lock the processes compile as numba alone would; a kernel must never fail
    or hang for want of one (no cache, a folder that cannot be written, a file system
    without flock, a holder that never lets go)."""
    assert quantize_cpu._lock(None) is None
    assert quantize_cpu._lock(str(tmp_path / "no-such-folder" / "k.lock")) is None
    fd = quantize_cpu._lock(str(tmp_path / "k.lock"))
    assert fd is not None
    try:
        other = os.open(tmp_path / "k.lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held: another description cannot take it
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
        # a holder that keeps it (a process frozen while compiling) is waited for a bounded
        # time, then the kernels compile without it
        assert quantize_cpu._lock(str(tmp_path / "k.lock"), wait_s=0.1) is None
    finally:
        os.close(fd)
    again = quantize_cpu._lock(str(tmp_path / "k.lock"), wait_s=60)  # released: taken
    assert again is not None
    os.close(again)


_LOAD = """
import sys
from ddiloco.common import quantize_cpu as k
print(k.lock_path(k.quantize), flush=True)
sys.stdin.readline()
k.ready()
hits = sum(sum(f.stats.cache_hits.values()) for f in (k.quantize, k.dequantize))
misses = sum(sum(f.stats.cache_misses.values()) for f in (k.quantize, k.dequantize))
print(hits, misses, flush=True)
"""


def _filled_cache(tmp_path) -> tuple[dict, pathlib.Path]:
    """A cache one process filled with every version, and its marker."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    proc, lock = _start(_LOAD, env)
    out, err = proc.communicate("go\n", timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["0", "6"]  # an empty cache: every version compiled (and saved)
    markers = list(lock.parent.glob(lock.name + ".*.complete"))
    assert len(markers) == 1, markers
    return env, markers[0]


def test_processes_that_find_a_complete_cache_load_it_together(tmp_path):
    """Loading held the exclusive lock too, so the learners of one host loaded the kernels
    one after another and began training up to 10 s apart (docs/quality.md, M = 8). Once a
    process has saved every version (its marker written), the next ones load under a shared
    lock: one loads while another holds it shared, without waiting (before, it waited for
    the exclusive lock, LOCK_WAIT_S = 120 s, past this test's minute)."""
    env, _ = _filled_cache(tmp_path)
    proc, lock = _start(_LOAD, env)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # another process loading
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        os.close(fd)
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["6", "0"]  # every version loaded from the cache, none compiled


def test_a_marker_over_an_incomplete_cache_saves_nothing_beside_others_and_is_removed(tmp_path):
    """Should the cache lose a version while its marker stays, the process that finds it
    missing compiles it without saving (saving beside a process that loads is what the lock
    exists to prevent), waits for the exclusive lock, and removes the marker; the next
    process then compiles and saves under the exclusive lock, as with an empty cache."""
    env, marker = _filled_cache(tmp_path)
    for saved in marker.parent.glob("quantize_cpu.quantize-*"):
        saved.unlink()  # the quantizer's index and code: gone
    proc, lock = _start(_LOAD, env)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        # loaded (and missed) beside us: now it wants the lock alone
        _until_it_waits_for(proc, "the exclusive lock", within_s=120)
        assert not list(marker.parent.glob("quantize_cpu.quantize-*")), "it saved beside another holder"
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["4", "2"]  # the dequantizer's four loaded, the quantizer's two compiled
    assert not marker.exists()
    proc, _ = _start(_LOAD, env)
    out, err = proc.communicate("go\n", timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["4", "2"]  # compiled again, and saved this time
    assert marker.exists() and list(marker.parent.glob("quantize_cpu.quantize-*.nbi"))


_LOAD_RECORDING_MODE = _LOAD.replace("k.ready()", """
import os, pathlib
versions = k._versions
def recording():  # the lock this process holds as it calls the kernels
    mine = [l.split()[3] for l in pathlib.Path("/proc/locks").read_text().splitlines()
            if "->" not in l and l.split()[4] == str(os.getpid())]
    print(*mine, flush=True)
    return versions()
k._versions = recording
k.ready()
""")


def test_a_process_that_waited_for_a_compile_loads_under_the_shared_lock(tmp_path):
    """Processes started together on an empty cache all ask for the exclusive lock; one
    compiles and saves. Each of the others, once it holds the lock and finds the marker the
    first one wrote, lets it go and loads under the shared lock (before, it loaded holding
    the exclusive one, so they loaded one after another)."""
    env, marker = _filled_cache(tmp_path)
    marker.unlink()  # what a process that started before the first one saved found
    proc, lock = _start(_LOAD_RECORDING_MODE, env)
    try:
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the process compiling
            proc.stdin.write("go\n")
            proc.stdin.flush()
            _until_it_waits_for(proc, "the lock", within_s=60)
            marker.touch()  # every version saved
        finally:
            os.close(fd)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert out.splitlines() == ["READ", "6 0"]  # loaded under the shared lock, nothing compiled
