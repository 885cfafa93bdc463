"""How fast the outer optimizer takes in deltas, merges them and serves the result, against
what M learners of the same model produce.

One invocation, per model preset (``tiny``, ``small``, ``medium``):

* a real coordinator and outer optimizer (processes, gRPC, journal and checkpoints on disk,
  the run's codec, int8 by default), and M = 16 registered learner ids, each driven by a
  thread of this process that does what a learner does to the outer optimizer in steady
  state, as fast as the outer optimizer lets it: push one delta (a whole window of H steps,
  base = its current version), wait for the next version (the status long poll), pull the
  change (the quantized download view), push again. The quorum is M, so every merge holds
  the M deltas of one round and nothing waits for a grace window: the outer optimizer is
  the only thing the round waits for;
* the same model's training loop alone (``bench/learner_overhead.py``'s plain loop, one
  thread): how long one learner takes for a window of H steps, which sets the rate at which
  M learners produce deltas (M per window time).

Reported per model: deltas per second merged, parameters ingested (fp32 GB/s) and wire
bytes, rounds per second, the latency from a delta's acknowledgement to the version that
holds it (p50, p95), the outer process's CPU seconds per delta (from ``/proc``; the capacity
figure that does not depend on how many cores the bench's own threads take), and the
headroom: deltas per second merged over what M learners produce. The outer optimizer is not
the bottleneck while the headroom is above 1. Evaluation is off (``--eval-interval`` one
hour): it runs in its own thread and is a fixed cost per evaluation, not per delta.

    python bench/outer_throughput.py            # tiny, small, medium; M = 16; 8 measured rounds each
    python bench/outer_throughput.py --quick    # the CI smoke form: tiny, M = 4, 3 rounds

Writes ``bench/results/outer_throughput.json`` (``outer_throughput-quick.json`` with --quick).
Runs alone on the machine, like every bench (``bench/common_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import secrets
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common_bench as cb  # noqa: E402

ROOT = cb.ROOT
DELTA_SCALE = 1e-3  # well inside what H AdamW steps can move a coordinate (admission's bound)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Driver(threading.Thread):
    """One learner id in steady state: push, wait for the next version, pull, push."""

    def __init__(self, address: str, run_id: str, learner_id: int, enc, window_tokens: int, inner_steps: int,
                 rounds: int, errors: list) -> None:
        super().__init__(name=f"driver-{learner_id}", daemon=True)
        from ddiloco.common.transport import OuterClient

        self.client = OuterClient(address, run_id, learner_id)
        self.enc, self.window_tokens, self.inner_steps, self.rounds = enc, window_tokens, inner_steps, rounds
        self.errors = errors
        self.ack_seconds: list[float] = []
        self.pull_bytes = 0

    def run(self) -> None:
        try:
            version = self.client.pull(0, -1, timeout=60).version
            for seq in range(1, self.rounds + 1):
                t0 = time.monotonic()
                self.client.push(self.enc, seq=seq, base_version=version, tokens=self.window_tokens,
                                 inner_steps=self.inner_steps, loss=0.0, timeout=300)
                self.ack_seconds.append(time.monotonic() - t0)
                while self.client.status(wait_newer_than=version, wait_s=5.0).version <= version:
                    pass
                g = self.client.pull(0, version, timeout=300)
                self.pull_bytes += g.nbytes
                version = g.version
        except Exception as exc:  # reported by the bench, which then fails
            self.errors.append(f"learner {self.client.learner_id}: {exc!r}")
        finally:
            self.client.close()


def _register(coordinator: str, n: int):
    from ddiloco.common.config import RunConfig
    from ddiloco.common.rpc import channel
    from ddiloco.coordinator.signature import model_signature
    from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc

    with channel(coordinator) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        config = RunConfig.from_json(stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=10).config_json)
        signature = model_signature(config)
        ids = [
            stub.Register(coordinator_pb2.RegisterRequest(
                address="bench", requested_learner_id=-1, instance_token=secrets.token_hex(8), model=signature),
                timeout=10).learner_id
            for _ in range(n)
        ]
    return config, ids


def measure_outer(model: str, learners: int, rounds: int, warmup: int, inner_steps: int, batch_size: int,
                  work: pathlib.Path) -> dict:
    import numpy as np

    from ddiloco.common import codec
    from ddiloco.common.transport import OuterClient
    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(work)
    try:
        cluster.start_coordinator([
            "--model", model, "--learners", str(learners), "--inner-steps", str(inner_steps),
            "--batch-size", str(batch_size), "--quorum", str(learners), "--eval-interval", "3600",
            "--lease-timeout", "3600", "--max-seconds", "7200",
        ])
        outer = cluster.start_outer()
        deadline = time.monotonic() + 180
        while not cluster.registered_outer():
            if outer.returncode() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the outer optimizer did not register; see {outer.log_path}")
            time.sleep(0.1)
        config, ids = _register(cluster.coordinator_address, learners)
        probe = OuterClient(cluster.outer_address, config.run_id, ids[0])
        g = probe.pull(0, -1, timeout=60)
        probe.close()
        rng = np.random.default_rng(0)
        arrays = [(n, rng.uniform(-DELTA_SCALE, DELTA_SCALE, size=a.shape).astype(np.float32)) for n, a in g.arrays]
        enc = codec.encode(arrays, config.learner.codec, config.learner.block_size)
        params = sum(a.size for _, a in arrays)
        window_tokens = inner_steps * batch_size * config.model.context

        errors: list[str] = []
        drivers = [Driver(cluster.outer_address, config.run_id, lid, enc, window_tokens, inner_steps, rounds, errors)
                   for lid in ids]
        cpu0, t0 = cb.process_cpu_seconds(outer.popen.pid), time.monotonic()
        for d in drivers:
            d.start()
        for d in drivers:
            d.join(timeout=1800)
        cpu1, t1 = cb.process_cpu_seconds(outer.popen.pid), time.monotonic()
        if errors or any(d.is_alive() for d in drivers):
            raise RuntimeError(f"drivers failed: {errors[:4]} (alive: {sum(d.is_alive() for d in drivers)})")
    finally:
        cluster.stop_all()

    events = [e for e in cb.read_events(work) if e.get("source", "outer") == "outer"]
    merges = sorted((e for e in events if e.get("event") == "merge"), key=lambda e: e["t"])
    accepted = {(e["learner"], e["seq"]): e["t"] for e in events if e.get("event") == "delta_accepted"}
    refused = [e for e in events if e.get("event") == "delta_refused"]
    if len(merges) < rounds or refused:
        raise RuntimeError(f"{len(merges)} merges for {rounds} rounds, {len(refused)} deltas refused")
    # measured: the rounds after the warm-up ones, from the merge that ends the warm-up
    measured = merges[warmup:rounds]
    span = measured[-1]["t"] - merges[warmup - 1]["t"]
    deltas = sum(len(m["deltas"]) for m in measured)
    latency = [m["t"] - accepted[tuple(d)] for m in measured for d in m["deltas"] if tuple(d) in accepted]
    acks = [s for d in drivers for s in d.ack_seconds[warmup:]]
    all_deltas = sum(len(m["deltas"]) for m in merges)
    return {
        "model": model,
        "params": params,
        "learners": learners,
        "codec": config.learner.codec,
        "payload_bytes": len(enc.payload),
        "rounds": rounds,
        "rounds_measured": len(measured),
        "deltas_per_merge": round(deltas / len(measured), 3),
        "deltas_per_s": round(deltas / span, 3),
        "rounds_per_s": round(len(measured) / span, 3),
        "ingest_fp32_gb_per_s": round(deltas * params * 4 / span / 1e9, 4),
        "wire_mb_per_s": round(deltas * len(enc.payload) / span / 1e6, 2),
        "ack_seconds_p50": round(_percentile(acks, 0.5), 4),
        "accept_to_version_seconds_p50": round(_percentile(latency, 0.5), 4),
        "accept_to_version_seconds_p95": round(_percentile(latency, 0.95), 4),
        # over the whole drive (warm-up included): the process's CPU for every delta it took
        "outer_cpu_seconds_per_delta": round((cpu1 - cpu0) / all_deltas, 5),
        "outer_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 3),
        "pull_bytes_per_delta": round(sum(d.pull_bytes for d in drivers) / all_deltas, 1),
    }


def window_seconds(model: str, inner_steps: int, batch_size: int, seconds: float) -> dict:
    """One learner's time for a window of H steps of this model (the plain loop, one thread)."""
    from learner_overhead import plain_tokens_per_second

    plain = plain_tokens_per_second(["--model", model, "--batch-size", str(batch_size)], seconds, warmup_steps=3)
    from ddiloco.common.config import MODEL_PRESETS

    window_tokens = inner_steps * batch_size * MODEL_PRESETS[model].context
    return {"learner_tokens_per_s": round(plain["tokens_per_second"], 1),
            "window_seconds": round(window_tokens / plain["tokens_per_second"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny, 4 learners, 3 rounds")
    ap.add_argument("--models", default=None, help="comma-separated presets (default tiny,small,medium; quick: tiny)")
    ap.add_argument("--learners", type=int, default=None, help="M (default 16; quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds driven, the first two not measured (default 10; quick 3)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    models = (args.models or ("tiny" if args.quick else "tiny,small,medium")).split(",")
    learners = args.learners or (4 if args.quick else 16)
    rounds = args.rounds or (3 if args.quick else 10)
    warmup = 1 if rounds < 5 else 2
    inner_steps, batch_size = 20, 8
    prov = cb.start_provenance(args.allow_dirty or args.quick, "outer_throughput")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-outer-throughput-") as tmp:
        for model in models:
            print(f"[{time.strftime('%H:%M:%S')}] {model}: M = {learners}, {rounds} rounds ...", file=sys.stderr, flush=True)
            row = measure_outer(model, learners, rounds, warmup, inner_steps, batch_size, pathlib.Path(tmp) / model)
            row.update(window_seconds(model, inner_steps, batch_size, 1.0 if args.quick else 10.0))
            produced = learners / row["window_seconds"]  # deltas per second M learners make
            row["learners_deltas_per_s"] = round(produced, 3)
            # from the two figures as recorded, so that the row is consistent with itself
            row["headroom"] = round(row["deltas_per_s"] / (row["learners_deltas_per_s"] or produced), 3)
            rows.append(row)
    doc = {
        "bench": "outer_throughput",
        "command": "python bench/outer_throughput.py" + (" --quick" if args.quick else ""),
        "inner_steps": inner_steps, "batch_size": batch_size,
        "rows": rows,
        **cb.finish_provenance(prov),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("outer_throughput-quick.json" if args.quick else "outer_throughput.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("| model | params | M | deltas/s | fp32 GB/s in | wire MB/s | accept->version p50 s | outer CPU s/delta "
          "| learners make deltas/s | headroom |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params']:,} | {r['learners']} | {r['deltas_per_s']:.2f} | {r['ingest_fp32_gb_per_s']:.3f} "
              f"| {r['wire_mb_per_s']:.1f} | {r['accept_to_version_seconds_p50']:.3f} | {r['outer_cpu_seconds_per_delta']:.4f} "
              f"| {r['learners_deltas_per_s']:.2f} | {r['headroom']:.2f} |")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
