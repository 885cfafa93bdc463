#!/usr/bin/env python3
"""How fast the wire codec runs on one core, beside a plain memory copy measured in the
same run (issue 15: >= 1.5 GB/s of fp32 per core for encode and decode, int8 and int4, with
error feedback).

For each codec it times, on ``--values`` float32 values (64 MB by default) drawn like a
pseudo-gradient (normal, a few outliers):

* ``encode``: quantize, pack, compress as the codec's default says, digest;
* ``encode_ef``: the same through error feedback, in its steady state (a residual held);
  what a learner's upload costs;
* ``decode``: verify the digest, decompress, dequantize, check finiteness; what the outer
  optimizer pays per delta and a learner per download;
* ``encode_zstd`` / ``decode_zstd``: the same with zstd, to show what it would cost.

``gb_per_s`` counts the fp32 bytes (4 per value) per second of the median of
``--repeats`` timings; ``vs_memcpy`` divides it by the memory copy's (a fresh
``numpy.copy`` of the same values, since the codec allocates its output too). torch and
numpy run on one thread. Usage: ``python bench/codec.py [--quick] [--values N]``; writes
``bench/results/codec.json`` (``--results-dir``); refuses uncommitted changes to services/
or bench/ unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # one core: before numpy and torch load

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common_bench as cb  # noqa: E402  (puts services/ on the path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ddiloco.common import codec  # noqa: E402

TARGET_GB_PER_S = 1.5
BLOCK = 64


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def pseudo_gradient(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(1e-3)
    x[:: 997] *= np.float32(30.0)  # outliers, as real pseudo-gradients have
    return x


def measure(values: int, repeats: int) -> tuple[float, list[dict]]:
    x = pseudo_gradient(values)
    nbytes = 4 * values
    memcpy = statistics.median(timed(lambda: x.copy(), repeats))
    memcpy_gbs = nbytes / memcpy / 1e9
    rows = [{"codec": "memcpy", "op": "copy", "gb_per_s": round(memcpy_gbs, 3), "vs_memcpy": 1.0,
             "seconds": round(memcpy, 5), "payload_bytes": nbytes}]
    print(f"memcpy: {memcpy_gbs:.2f} GB/s", file=sys.stderr, flush=True)
    arrays = [("x", x)]
    for name in ("int8", "int4"):
        plain = codec.encode(arrays, name, BLOCK)
        zstd = codec.encode(arrays, name, BLOCK, compression="zstd")
        ef = codec.ErrorFeedback()
        ef.encode(arrays, name, BLOCK)  # steady state: a residual is held from here on
        ops = {
            "encode": (lambda: codec.encode(arrays, name, BLOCK), plain),
            "encode_ef": (lambda: ef.encode(arrays, name, BLOCK), plain),
            "decode": (lambda: codec.decode_encoded(plain), plain),
            "encode_zstd": (lambda: codec.encode(arrays, name, BLOCK, compression="zstd"), zstd),
            "decode_zstd": (lambda: codec.decode_encoded(zstd), zstd),
        }
        for op, (fn, enc) in ops.items():
            fn()  # warm: first-touch allocations, lazy imports
            times = timed(fn, repeats)
            med = statistics.median(times)
            gbs = nbytes / med / 1e9
            rows.append({
                "codec": name, "op": op, "gb_per_s": round(gbs, 3), "vs_memcpy": round(gbs / memcpy_gbs, 3),
                "seconds": round(med, 5), "seconds_min": round(min(times), 5), "payload_bytes": len(enc.payload),
                "compression": enc.compression,
            })
            print(f"{name} {op}: {gbs:.2f} GB/s ({med * 1e3:.1f} ms, payload {len(enc.payload) / 1e6:.1f} MB)",
                  file=sys.stderr, flush=True)
    return memcpy_gbs, rows


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for name in ("int8", "int4"):
        for op in ("encode_ef", "encode", "decode"):
            row = next(r for r in rows if r["codec"] == name and r["op"] == op)
            out.append({"target": f"{name} {op} >= {TARGET_GB_PER_S} GB/s per core", "value": row["gb_per_s"],
                        "limit": TARGET_GB_PER_S, "met": row["gb_per_s"] >= TARGET_GB_PER_S, "kind": "abs"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 1M values, 2 repeats")
    ap.add_argument("--values", type=int, default=16 << 20, help="float32 values per payload (default 16M: 64 MB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    values, repeats = (1 << 20, 2) if args.quick else (args.values, args.repeats)
    prov = cb.start_provenance(args.allow_dirty or args.quick, "codec")
    torch.set_num_threads(1)
    memcpy_gbs, rows = measure(values, repeats)
    result = {
        "bench": "codec", "quick": args.quick, "values": values, "repeats": repeats, "block_size": BLOCK,
        "threads": torch.get_num_threads(), "memcpy_gb_per_s": round(memcpy_gbs, 3),
        "provenance": cb.finish_provenance(prov), "rows": rows, "targets": targets(rows),
    }
    print("\n| codec | op | GB/s (fp32) | vs memcpy | payload MB | compression |\n|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['codec']} | {r['op']} | {r['gb_per_s']:.2f} | {r['vs_memcpy']:.2f} | "
              f"{r['payload_bytes'] / 1e6:.1f} | {r.get('compression', '-')} |")
    print()
    print(cb.markdown_targets(result["targets"]))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("codec-quick.json" if args.quick else "codec.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
