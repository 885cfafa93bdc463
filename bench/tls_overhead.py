"""What mutual TLS costs on the wire: one 256 MiB client stream over gRPC, plaintext and
mutual TLS, alternating in one run, over loopback or over a tc-shaped link.

    python bench/tls_overhead.py                    # loopback: 256 MiB x 15 pairs (one upload per mode each)
    python bench/tls_overhead.py --rate-mbit 1000   # over a link shaped to 1 Gbit/s (root): tls_overhead-1000mbit.json
    python bench/tls_overhead.py --quick            # 16 MiB x 2 pairs: the smoke form
    perf record -a -- python bench/tls_overhead.py --only mtls --reps 6   # one mode only, under a profiler; writes nothing

The server and the channel are ddiloco's own (``ddiloco.common.rpc``: the same options,
credentials and certificates a learner's upload uses), the stream is the upload's shape
(1 MiB messages, client streaming, one answer), and the handler only counts the bytes: this
measures the transport, not the codec, the journal or the merge (the wire benchmark of the
transport work measures the whole upload). The servers run in a process of their own, as
the outer optimizer does on its host, and so does the client: with client and server in
one process, both sides' Python shared one interpreter lock, which halved the plaintext
throughput and set TLS against the client's own stream as well as against the cores.

With ``--rate-mbit R`` the servers run in a hub network namespace and the client in a
datacenter namespace behind a veth link that tc shapes to R Mbit/s each way (the topology of
``ddiloco run --topology netns``, ``ddiloco.netns``): a deployment's case, where the link,
not the cores, may bound an upload. Loopback is the worst case for TLS: nothing but the
cores bounds the plaintext stream there.

An upload of 256 MiB takes a few tenths of a second on loopback here, and single uploads of
the same mode differ by up to 2x on this machine, so one figure per mode says little: each
repetition is a pair (one upload of each mode, back to back, the order swapped every
repetition), the overhead of a pair is 1 - its plaintext seconds / its TLS seconds (the
throughput TLS gives up), and the result is the median over the pairs, with their
quartiles. Throughputs are medians per mode. Writes bench/results/tls_overhead.json
(loopback) or tls_overhead-<R>mbit.json (shaped).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
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
TARGET = 0.10  # the bound on TLS's cost (on loopback)
MODES = ("plaintext", "mtls")


def _sink(request_iterator, context) -> bytes:
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")


def serve(security: Security, host: str) -> tuple[Server, str]:
    server = Server(f"{host}:0", ["ddiloco.bench.Sink"], security=security)
    handler = grpc.method_handlers_generic_handler(
        "ddiloco.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(_sink)}
    )  # no (de)serializers: the messages are the raw bytes
    server.grpc_server.add_generic_rpc_handlers((handler,))
    server.start()
    server.set_ready()
    return server, f"{host}:{server.port}"


def serve_both(tls_dir: pathlib.Path, host: str) -> None:
    """The server process: one plaintext and one mutual-TLS server; prints their addresses
    as one JSON line and serves until its standard input closes."""
    servers = {"plaintext": serve(Security.insecure(), host), "mtls": serve(Security.from_dir(tls_dir / "outer"), host)}
    print(json.dumps({mode: address for mode, (_, address) in servers.items()}), flush=True)
    sys.stdin.read()
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


def run_pairs(addresses: dict[str, str], tls_dir: pathlib.Path, total: int, reps: int,
              modes: tuple[str, ...] = MODES) -> dict[str, list[float]]:
    """The client process: ``reps`` pairs, the order swapped every pair, so that a drift in
    the machine's load hits both modes (``modes``: one of them alone, for a profiler)."""
    clients = {"plaintext": None, "mtls": Security.from_dir(tls_dir / "learner-0")}
    for mode in modes:  # warm the paths once
        upload(addresses[mode], clients[mode], CHUNK)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(reps):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            seconds[mode].append(upload(addresses[mode], clients[mode], total))
    return seconds


def measure(tls_dir: pathlib.Path, total: int, reps: int, server_wrap: list[str], host: str,
            client_wrap: list[str], modes: tuple[str, ...] = MODES) -> dict[str, list[float]]:
    """Start the server process (under ``server_wrap``, bound to ``host``) and the client
    process (under ``client_wrap``), and return the client's seconds per mode."""
    me = [sys.executable, str(pathlib.Path(__file__).resolve())]
    server = subprocess.Popen([*server_wrap, *me, "--serve", str(tls_dir), "--host", host],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"tls_overhead: the server process exited ({server.wait()}) before serving")
        client = subprocess.run(
            [*client_wrap, *me, "--client", line.strip(), str(tls_dir), "--bytes", str(total), "--reps", str(reps),
             "--modes", *modes],
            capture_output=True, text=True, timeout=3600,
        )
        if client.returncode != 0:
            raise SystemExit(f"tls_overhead: the client process failed:\n{client.stderr[-3000:]}")
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def measure_shaped(tls_dir: pathlib.Path, total: int, reps: int, rate_mbit: float) -> tuple[dict[str, list[float]], dict]:
    from ddiloco.netns.session import NetnsSession
    from ddiloco.wan.profiles import MBIT, Profile

    profile = Profile(f"{rate_mbit:g}mbit", f"{rate_mbit:g} Mbit/s each way", (int(round(rate_mbit * MBIT)),))
    with NetnsSession(profile, 1) as s:
        seconds = measure(tls_dir, total, reps, s.hub_wrap, s.hub_address, s.dc_wrap(0))
        assert s.built is not None
        down, up = s.built.shaping[0]
        link = {"qdisc": down.kind, "rate_bits": [down.rate_bits, up.rate_bits]}
    return seconds, link


def profile_one(mode: str, total: int, reps: int) -> int:
    """``--only MODE``: ``reps`` uploads of one mode (server and client in their processes as
    in the measurement), their throughput printed, nothing written."""
    with tempfile.TemporaryDirectory() as tmp:
        tls = pathlib.Path(tmp)
        setup_run(tls, 1)
        seconds = measure(tls, total, reps, [], "127.0.0.1", [], (mode,))[mode]
    print(f"{mode}: {reps} uploads of {total >> 20} MiB, median {total / statistics.median(seconds) / 1e6:.1f} MB/s, "
          f"seconds {[round(x, 3) for x in seconds]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per upload")
    parser.add_argument("--reps", type=int, default=15, help="pairs of uploads (one per mode)")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="shape the client's link to this many Mbit/s each way (network namespaces; root)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 pairs (smoke test)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="result file (default bench/results/tls_overhead.json, or tls_overhead-<R>mbit.json)")
    parser.add_argument("--allow-dirty", action="store_true")
    parser.add_argument("--only", choices=MODES, default=None,
                        help="upload in this mode only and print its throughput, writing nothing: for a profiler "
                             "attached from outside (perf record -a), to set one mode's CPU beside the other's")
    # the two roles this script plays in its own child processes
    parser.add_argument("--serve", type=pathlib.Path, metavar="TLS_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, metavar=("ADDRESSES", "TLS_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve_both(args.serve, args.host)
        return 0
    if args.client is not None:
        addresses, tls_dir = json.loads(args.client[0]), pathlib.Path(args.client[1])
        print(json.dumps(run_pairs(addresses, tls_dir, args.bytes, args.reps, tuple(args.modes))))
        return 0
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        parser.error(f"--rate-mbit must be a positive number of Mbit/s, got {args.rate_mbit}")
    if args.quick:
        args.mib, args.reps = 16, 2
    if args.mib < 1 or args.reps < 1:
        parser.error("--mib and --reps must be at least 1")
    if args.only is not None:
        if args.rate_mbit is not None:
            parser.error("--only measures loopback; leave out --rate-mbit")
        return profile_one(args.only, args.mib * CHUNK, args.reps)
    name = "tls_overhead" if args.rate_mbit is None else f"tls_overhead-{args.rate_mbit:g}mbit"
    out = args.out or ROOT / "bench" / "results" / f"{name}.json"
    prov = start_provenance(args.allow_dirty, "tls_overhead")
    total = args.mib * CHUNK
    with tempfile.TemporaryDirectory() as tmp:
        tls = pathlib.Path(tmp)
        setup_run(tls, 1)
        if args.rate_mbit is None:
            seconds, link = measure(tls, total, args.reps, [], "127.0.0.1", []), {"kind": "loopback"}
        else:
            seconds, link = measure_shaped(tls, total, args.reps, args.rate_mbit)
            link = {"kind": "netns veth", **link}
    mbps = {m: round(total / statistics.median(s) / 1e6, 1) for m, s in seconds.items()}
    pairs = [1 - p / t for p, t in zip(seconds["plaintext"], seconds["mtls"])]
    overhead = round(statistics.median(pairs), 4)
    quartiles = [round(q, 4) for q in statistics.quantiles(pairs, n=4)] if len(pairs) > 1 else [overhead] * 3
    result = {
        "bench": "tls_overhead", "server": "own process", "client": "own process", "link": link,
        "rate_mbit": args.rate_mbit, "bytes": total, "chunk_bytes": CHUNK, "reps": args.reps,
        "seconds": {m: [round(x, 4) for x in s] for m, s in seconds.items()},
        "throughput_mb_s": mbps, "pair_overheads": [round(x, 4) for x in pairs],
        "overhead": overhead, "overhead_quartiles": [quartiles[0], quartiles[2]],
        # the target is loopback's, where only the cores bound the stream
        "target_overhead": TARGET if args.rate_mbit is None else None,
        "met": overhead <= TARGET if args.rate_mbit is None else None,
        **finish_provenance(prov),
    }
    where = "loopback" if args.rate_mbit is None else f"a link shaped to {args.rate_mbit:g} Mbit/s"
    print(f"over {where}\n\n| mode | MB/s (median of {args.reps}) |\n|---|---:|")
    for m in MODES:
        print(f"| {m} | {mbps[m]} |")
    verdict = (f"target <= {TARGET:.0%}: {'met' if result['met'] else 'missed'}" if args.rate_mbit is None
               else f"the target of {TARGET:.0%} is loopback's")
    print(f"\nTLS overhead: {overhead:.1%}, median of {len(pairs)} pairs (quartiles {quartiles[0]:.1%} to "
          f"{quartiles[2]:.1%}; {verdict})")
    if not args.quick:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
