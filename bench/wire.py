#!/usr/bin/env python3
"""How fast a payload crosses loopback gRPC, beside raw TCP measured in the same run
(issue 15: upload and download of a 256 MB payload at >= 0.5x raw TCP).

* ``grpc``: the outer optimizer's own wire: a server process built like the service
  (``common.rpc.Server``, ``wire.add_outer_servicer``), whose PushDelta reassembles the
  stream as the service does and whose PullGlobal streams what was pushed with
  ``wire.stream_frames``; the client is the learner's ``OuterClient`` (``push_payload``,
  ``pull_payload``), with the run's default chunk size unless ``--chunk-mb`` says more.
  Decoding and merging are left out: ``bench/codec.py`` times the codec.
* ``tcp``: a plain socket between the same two processes: ``sendall`` of the whole payload,
  ``recv_into`` a buffer allocated before the clock starts (gRPC's receiver allocates as
  the data arrives, as the service does), a one-byte reply at the end of an upload.
* ``bare``: the ceiling of any data path through gRPC's Python layer on this machine: the
  same server and channel options, raw-bytes messages with no (de)serializer, chunks cut
  from the payload before the clock starts, a handler that only counts what arrives (an
  upload) or sends back the chunks the last upload left (a download), a client that only
  counts. Nothing is framed, copied, reassembled or kept in Python; what is left is gRPC's
  own cost per byte. ``bare_ratio`` is its throughput over TCP's: the most any change to
  ddiloco's wire that stays on gRPC could reach here.
* ``nopool``: the ``grpc`` round again, against a second server process, with every payload
  received into fresh memory at both ends (``wire.ReceivePool(max_free=0)``): the wire as it
  was before the receive pool, so what the pool is worth is read within one run.

Each direction is timed ``--repeats`` times, a TCP, a bare and a no-pool round beside each
gRPC round (medians); ``ratio`` is gRPC over TCP. The
payload is random bytes (the transport never looks inside). Usage:
``python bench/wire.py [--quick] [--mb 256] [--chunk-mb 1 4]``; writes
``bench/results/wire.json`` (``--results-dir``); refuses uncommitted changes to services/ or
bench/ unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import socket
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common_bench as cb  # noqa: E402  (puts services/ on the path)

TARGET_RATIO = 0.5
BARE_SERVICE = "ddiloco.bench.Bare"


# ----------------------------------------------------------------------------- servers
def _with_options(extra: list[tuple[str, int]]) -> None:
    """Add gRPC channel arguments to the project's server and client options (exploration:
    ``--grpc-option``); the defaults are the services' own."""
    from ddiloco.common import rpc

    rpc.SERVER_OPTIONS = rpc.SERVER_OPTIONS + extra
    rpc.CLIENT_OPTIONS = rpc.CLIENT_OPTIONS + extra


def _no_pool() -> None:
    """This process receives every payload into fresh memory, as before the receive pool."""
    from ddiloco.common import wire

    wire.RECEIVE_POOL = wire.ReceivePool(max_free=0)


def _grpc_server(ready, stop, extra: list[tuple[str, int]], pool: bool = True) -> None:
    _with_options(extra)
    if not pool:
        _no_pool()
    from ddiloco.common.rpc import Server
    from ddiloco.common.wire import OUTER_SERVICE, add_outer_servicer, reassemble, stream_frames
    from ddiloco.v1 import common_pb2, outer_pb2, outer_pb2_grpc

    class Sink(outer_pb2_grpc.OuterOptimizerServicer):
        payload = b""
        chunk = 1 << 20

        def PushDelta(self, request_iterator, context):
            header, self.payload = reassemble(request_iterator, 1 << 34, "delta")
            return outer_pb2.PushDeltaResponse(outcome=outer_pb2.PUSH_OUTCOME_ACCEPTED, global_version=header.seq)

        def PullGlobal(self, request, context):
            header = outer_pb2.GlobalHeader(version=1, payload=common_pb2.PayloadInfo(payload_bytes=len(self.payload)))
            yield from stream_frames(outer_pb2.GlobalChunk, header, self.payload, request.fragment or self.chunk)

    import grpc

    received: list[bytes] = []

    def bare_push(request_iterator, context) -> bytes:
        received.clear()
        received.extend(request_iterator)  # the messages as gRPC hands them over, kept as they are
        return sum(map(len, received)).to_bytes(8, "little")

    def bare_pull(request, context):
        yield from list(received)

    server = Server("127.0.0.1:0", [OUTER_SERVICE, BARE_SERVICE])
    add_outer_servicer(Sink(), server.grpc_server)
    server.grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(bare_push),
        "Pull": grpc.unary_stream_rpc_method_handler(bare_pull),
    }),))  # no (de)serializers: the messages are the raw bytes
    server.start()
    server.set_ready()
    ready.put(server.port)
    stop.wait()
    server.stop(0)


def _tcp_server(ready, stop, nbytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while not stop.is_set():
        listener.settimeout(0.5)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            op = conn.recv(1)
            if op == b"u":  # upload: receive everything, then answer one byte
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")
            elif op == b"d":  # download: send what the last upload left
                conn.sendall(view)
    listener.close()


# ----------------------------------------------------------------------------- clients
def tcp_round(port: int, payload: bytes, op: str) -> float:
    nbytes = len(payload)
    # the receive buffer is allocated (and touched) before the clock starts: raw TCP at its best
    view = memoryview(bytearray(nbytes)) if op == "d" else None
    with socket.create_connection(("127.0.0.1", port)) as conn:
        t0 = time.perf_counter()
        conn.sendall(op.encode())
        if op == "u":
            conn.sendall(payload)
            conn.recv(1)
        else:
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if not n:
                    raise RuntimeError("TCP download cut short")
                got += n
        return time.perf_counter() - t0


def grpc_round(client, payload: bytes, op: str, chunk: int) -> float:
    from ddiloco.v1 import common_pb2, outer_pb2

    t0 = time.perf_counter()
    if op == "u":
        header = outer_pb2.DeltaHeader(run_id="bench", learner_id=1, seq=1,
                                       payload=common_pb2.PayloadInfo(payload_bytes=len(payload)))
        client.push_payload(header, payload, timeout=600)
    else:
        _, got = client.pull_payload(chunk, -1, timeout=600)  # the sink reads the chunk size from ``fragment``
        if len(got) != len(payload):
            raise RuntimeError(f"download of {len(got)} bytes, {len(payload)} expected")
    return time.perf_counter() - t0


def bare_round(ch, chunks: list[bytes], op: str) -> float:
    """One upload or download of ``chunks`` through the bare service (see the docstring); a
    download returns the chunks of the last upload."""
    nbytes = sum(map(len, chunks))
    t0 = time.perf_counter()
    if op == "u":
        got = int.from_bytes(ch.stream_unary(f"/{BARE_SERVICE}/Push")(iter(chunks), timeout=600), "little")
    else:
        got = sum(len(m) for m in ch.unary_stream(f"/{BARE_SERVICE}/Pull")(b"", timeout=600))
    seconds = time.perf_counter() - t0
    if got != nbytes:
        raise RuntimeError(f"bare {op}: {got} bytes, {nbytes} expected")
    return seconds


def measure(mb: int, chunks_mb: list[float], repeats: int, extra: list[tuple[str, int]]) -> list[dict]:
    import numpy as np

    from ddiloco.common.rpc import channel
    from ddiloco.common.transport import OuterClient

    nbytes = mb << 20
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ready = ctx.Queue()
    _with_options(extra)
    procs = [ctx.Process(target=_grpc_server, args=(ready, stop, extra), daemon=True),
             ctx.Process(target=_tcp_server, args=(ready, stop, nbytes), daemon=True),
             ctx.Process(target=_grpc_server, args=(ready, stop, extra, False), daemon=True)]
    ports = []
    for p in procs:
        p.start()
        ports.append(ready.get(timeout=120))
    grpc_port, tcp_port, nopool_port = ports
    from ddiloco.common import wire

    pooled, fresh = wire.RECEIVE_POOL, wire.ReceivePool(max_free=0)

    def nopool_round(client, op: str, chunk: int) -> float:
        """A gRPC round with every payload received into fresh memory at both ends."""
        wire.RECEIVE_POOL = fresh
        try:
            return grpc_round(client, payload, op, chunk)
        finally:
            wire.RECEIVE_POOL = pooled

    rows = []
    try:
        tcp_round(tcp_port, payload, "u")  # warm: the server's buffer, the connection path
        for chunk_mb in chunks_mb:
            chunk = int(chunk_mb * (1 << 20))
            client = OuterClient(f"127.0.0.1:{grpc_port}", "bench", 1, chunk_bytes=chunk)
            nopool = OuterClient(f"127.0.0.1:{nopool_port}", "bench", 1, chunk_bytes=chunk)
            bare = channel(f"127.0.0.1:{grpc_port}")
            chunks = [payload[i:i + chunk] for i in range(0, nbytes, chunk)]  # cut before any clock
            try:
                grpc_round(client, payload, "u", chunk)  # warm: channel up, flow-control windows grown
                nopool_round(nopool, "u", chunk)
                bare_round(bare, chunks, "u")
                for op, direction in (("u", "upload"), ("d", "download")):
                    # interleaved, one TCP round beside each gRPC round: the machine's state
                    # (page cache, other load, frequency) drifts between runs, and a ratio of
                    # rounds taken side by side is what the target is about
                    # (and one round without the receive pool, the wire as it was before it)
                    tcp_s, grpc_s, bare_s, nopool_s = [], [], [], []
                    for _ in range(repeats):
                        tcp_s.append(tcp_round(tcp_port, payload, op))
                        grpc_s.append(grpc_round(client, payload, op, chunk))
                        bare_s.append(bare_round(bare, chunks, op))
                        nopool_s.append(nopool_round(nopool, op, chunk))
                    sec, tsec, bsec = statistics.median(grpc_s), statistics.median(tcp_s), statistics.median(bare_s)
                    nsec = statistics.median(nopool_s)
                    g, t, b = nbytes / sec / 1e9, nbytes / tsec / 1e9, nbytes / bsec / 1e9
                    n = nbytes / nsec / 1e9
                    rows.append({"direction": direction, "payload_mb": mb, "chunk_mb": chunk_mb,
                                 "grpc_gb_per_s": round(g, 3), "tcp_gb_per_s": round(t, 3), "ratio": round(g / t, 3),
                                 "bare_grpc_gb_per_s": round(b, 3), "bare_ratio": round(b / t, 3),
                                 "nopool_grpc_gb_per_s": round(n, 3), "nopool_ratio": round(n / t, 3),
                                 "grpc_seconds": round(sec, 4), "tcp_seconds": round(tsec, 4),
                                 "bare_seconds": round(bsec, 4), "nopool_seconds": round(nsec, 4)})
                    print(f"{direction} {mb} MB, chunks of {chunk_mb} MiB: gRPC {g:.2f} GB/s, TCP {t:.2f} GB/s "
                          f"({g / t:.2f}x), bare gRPC {b:.2f} GB/s ({b / t:.2f}x), without the receive pool {n:.2f} GB/s "
                          f"({n / t:.2f}x)", file=sys.stderr, flush=True)
            finally:
                client.close()
                nopool.close()
                bare.close()
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 MB, one repeat")
    ap.add_argument("--mb", type=int, default=256, help="payload size in MiB")
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=None,
                    help="chunk sizes to try, MiB (default: the run's default chunk size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--grpc-option", action="append", default=[], metavar="KEY=INT",
                    help="an extra gRPC channel argument for server and client, e.g. grpc.http2.max_frame_size=1048576")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    from ddiloco.common.config import LearnerConfig

    default_chunk_mb = LearnerConfig().chunk_bytes / (1 << 20)
    mb, repeats = (8, 1) if args.quick else (args.mb, args.repeats)
    chunks_mb = args.chunk_mb or [default_chunk_mb]
    prov = cb.start_provenance(args.allow_dirty or args.quick, "wire")
    extra = [(k, int(v)) for k, v in (o.split("=", 1) for o in args.grpc_option)]
    rows = measure(mb, chunks_mb, repeats, extra)
    result = {
        "bench": "wire", "quick": args.quick, "payload_mb": mb, "repeats": repeats, "grpc_options": extra,
        "default_chunk_mb": default_chunk_mb, "provenance": cb.finish_provenance(prov), "rows": rows,
        "targets": [
            {"target": f"{r['direction']} {r['payload_mb']} MB, chunks of {r['chunk_mb']:g} MiB: gRPC >= {TARGET_RATIO}x TCP",
             "value": r["ratio"], "limit": TARGET_RATIO, "met": r["ratio"] >= TARGET_RATIO, "kind": "abs"}
            for r in rows
        ],
    }
    print("\n| direction | payload MB | chunk MiB | gRPC GB/s | TCP GB/s | ratio | bare gRPC GB/s | bare ratio "
          "| no pool GB/s | no pool ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['direction']} | {r['payload_mb']} | {r['chunk_mb']:g} | {r['grpc_gb_per_s']:.2f} | "
              f"{r['tcp_gb_per_s']:.2f} | {r['ratio']:.2f} | {r['bare_grpc_gb_per_s']:.2f} | {r['bare_ratio']:.2f} | "
              f"{r['nopool_grpc_gb_per_s']:.2f} | {r['nopool_ratio']:.2f} |")
    print()
    print(cb.markdown_targets(result["targets"]))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("wire-quick.json" if args.quick else "wire.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
