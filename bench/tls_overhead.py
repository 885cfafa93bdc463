"""What mutual TLS costs on the wire: one 256 MiB client stream over loopback gRPC, plaintext
and mutual TLS, alternating in one run.

    python bench/tls_overhead.py            # 256 MiB x 15 pairs (one upload per mode each)
    python bench/tls_overhead.py --quick    # 16 MiB x 2 pairs: the smoke form

The server and the channel are ddiloco's own (``ddiloco.common.rpc``: the same options,
credentials and certificates a learner's upload uses), the stream is the upload's shape
(1 MiB messages, client streaming, one answer), and the handler only counts the bytes: this
measures the transport, not the codec, the journal or the merge (the wire benchmark of the
transport work measures the whole upload). The servers run in a process of their own, as
the outer optimizer does on its host: with client and server in one process, both sides'
Python shared one interpreter lock, which halved the plaintext throughput and set TLS
against the client's own stream as well as against the cores.

An upload of 256 MiB takes a few tenths of a second here, and single uploads of the same
mode differ by up to 2x on this machine, so one figure per mode says little: each
repetition is a pair (one upload of each mode, back to back, the order swapped every
repetition), the overhead of a pair is 1 - its plaintext seconds / its TLS seconds (the
throughput TLS gives up), and the result is the median over the pairs, with their
quartiles. Throughputs are medians per mode. Writes bench/results/tls_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common_bench import ROOT, finish_provenance, start_provenance  # noqa: E402

import grpc  # noqa: E402

from ddiloco.common.certs import setup_run  # noqa: E402
from ddiloco.common.rpc import Server, channel  # noqa: E402
from ddiloco.common.security import Security  # noqa: E402

METHOD = "/ddiloco.bench.Sink/Push"
CHUNK = 1 << 20
TARGET = 0.10  # the bound on TLS's cost


def _sink(request_iterator, context) -> bytes:
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")


def serve(security: Security) -> tuple[Server, str]:
    server = Server("127.0.0.1:0", ["ddiloco.bench.Sink"], security=security)
    handler = grpc.method_handlers_generic_handler(
        "ddiloco.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(_sink)}
    )  # no (de)serializers: the messages are the raw bytes
    server.grpc_server.add_generic_rpc_handlers((handler,))
    server.start()
    server.set_ready()
    return server, f"127.0.0.1:{server.port}"


def _serve_both(tls_dir: str, ready, stop) -> None:
    """The server process: one plaintext and one mutual-TLS server until ``stop``."""
    servers = {"plaintext": serve(Security.insecure()), "mtls": serve(Security.from_dir(pathlib.Path(tls_dir) / "outer"))}
    ready.put({mode: address for mode, (_, address) in servers.items()})
    stop.wait()
    for server, _ in servers.values():
        server.stop(grace=0.5)


def upload(address: str, security: Security | None, total: int) -> float:
    """Seconds to stream ``total`` bytes and get the answer, on a fresh channel (its TLS
    handshake included, as a learner's first upload has it)."""
    payload = bytes(CHUNK)
    with channel(address, security, server_role="outer") as ch:
        push = ch.stream_unary(METHOD)
        t0 = time.perf_counter()
        got = push(iter([payload] * (total // CHUNK)), timeout=600)
        seconds = time.perf_counter() - t0
    assert int.from_bytes(got, "little") == total
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per upload")
    parser.add_argument("--reps", type=int, default=15, help="pairs of uploads (one per mode)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 pairs (smoke test)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "tls_overhead.json")
    parser.add_argument("--allow-dirty", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.reps = 16, 2
    prov = start_provenance(args.allow_dirty, "tls_overhead")
    total = args.mib * CHUNK
    with tempfile.TemporaryDirectory() as tmp:
        tls = pathlib.Path(tmp)
        setup_run(tls, 1)
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_serve_both, args=(str(tls), ready, stop), daemon=True)
        proc.start()
        addresses = ready.get(timeout=120)
        clients = {"plaintext": None, "mtls": Security.from_dir(tls / "learner-0")}
        seconds: dict[str, list[float]] = {"plaintext": [], "mtls": []}
        try:
            upload(addresses["plaintext"], None, CHUNK)  # warm both paths once
            upload(addresses["mtls"], clients["mtls"], CHUNK)
            for rep in range(args.reps):  # pairs side by side, so a drift in the machine's load hits both
                order = ("plaintext", "mtls") if rep % 2 == 0 else ("mtls", "plaintext")
                for mode in order:
                    seconds[mode].append(upload(addresses[mode], clients[mode], total))
        finally:
            stop.set()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    mbps = {m: round(total / statistics.median(s) / 1e6, 1) for m, s in seconds.items()}
    pairs = [1 - p / t for p, t in zip(seconds["plaintext"], seconds["mtls"])]
    overhead = round(statistics.median(pairs), 4)
    quartiles = [round(q, 4) for q in statistics.quantiles(pairs, n=4)] if len(pairs) > 1 else [overhead] * 3
    result = {
        "bench": "tls_overhead", "server": "own process", "bytes": total, "chunk_bytes": CHUNK, "reps": args.reps,
        "seconds": {m: [round(x, 4) for x in s] for m, s in seconds.items()},
        "throughput_mb_s": mbps, "pair_overheads": [round(x, 4) for x in pairs],
        "overhead": overhead, "overhead_quartiles": [quartiles[0], quartiles[2]],
        "target_overhead": TARGET, "met": overhead <= TARGET,
        **finish_provenance(prov),
    }
    print(f"| mode | MB/s (median of {args.reps}) |\n|---|---:|")
    for m in ("plaintext", "mtls"):
        print(f"| {m} | {mbps[m]} |")
    print(f"\nTLS overhead: {overhead:.1%}, median of {len(pairs)} pairs (quartiles {quartiles[0]:.1%} to "
          f"{quartiles[2]:.1%}; target <= {TARGET:.0%}: {'met' if result['met'] else 'missed'})")
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
