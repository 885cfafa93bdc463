"""How the outer optimizer's merge throughput scales with outer shards (``--outer-shards S``).

One invocation, per model preset (``small``, ``medium``) and per S in 1, 2, 4:

* a real coordinator and S outer-optimizer processes (gRPC, journal and checkpoints on
  disk, int8), the model in P = 4 fragments, and M = 16 registered learner ids, each driven
  by a thread of this process that does what a learner does in steady state, as fast as the
  outer optimizer lets it: push one delta per fragment (to the fragment's shard, with the
  shard's interleaved sequence numbers), wait until every fragment has a newer version,
  pull the changes, push again. The quorum is M: every merge holds one round of the M
  learners' deltas of its fragment, and nothing waits for a grace window.

Reported per model and S: deltas merged per second (all shards), fp32 GB/s ingested, the
latency from a delta's acknowledgement to the merge that applies it (p50, p95), the outer
processes' CPU seconds per delta, and the scaling efficiency: throughput at S over S times
the throughput at S = 1 (target ≥ 0.75 while the machine has a core per shard). The bench's
drivers run in this process and take CPU too, which is why the machine's core count is in
the result.

    python bench/outer_scale.py            # small, medium; S = 1, 2, 4; M = 16; 6 rounds
    python bench/outer_scale.py --quick    # the CI smoke form: tiny, S = 1, 2; M = 4; 3 rounds

Writes ``bench/results/outer_scale.json`` (``outer_scale-quick.json`` with --quick). Runs
alone on the machine, like every bench (``bench/common_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common_bench as cb  # noqa: E402
from outer_throughput import DELTA_SCALE, _percentile, _register  # noqa: E402

ROOT = cb.ROOT
FRAGMENTS = 4


class Driver(threading.Thread):
    """One learner id in steady state over every fragment: push each, wait for all to merge, pull."""

    def __init__(self, addresses: list[str], run_id: str, learner_id: int, encs: list, window_tokens: int,
                 inner_steps: int, rounds: int, errors: list) -> None:
        super().__init__(name=f"driver-{learner_id}", daemon=True)
        from ddiloco.common.shard_client import ShardedOuterClient
        from ddiloco.common.transport import OuterClient

        self.shards = len(addresses)
        if self.shards == 1:
            self.client = OuterClient(addresses[0], run_id, learner_id)
        else:
            self.client = ShardedOuterClient(addresses, run_id, learner_id)
        self.learner_id = learner_id
        self.encs, self.window_tokens, self.inner_steps, self.rounds = encs, window_tokens, inner_steps, rounds
        self.errors = errors

    def run(self) -> None:
        from ddiloco.common.fragments import shard_of
        from ddiloco.learner.shard_uploader import next_seq

        last = [0] * self.shards
        try:
            versions = [self.client.pull(f, -1, timeout=60).version for f in range(FRAGMENTS)]
            for _ in range(self.rounds):
                for f in range(FRAGMENTS):
                    shard = shard_of(f, self.shards)
                    seq = next_seq(shard, self.shards, last[shard])
                    last[shard] = seq
                    self.client.push(self.encs[f], seq=seq, base_version=versions[f], tokens=self.window_tokens,
                                     inner_steps=self.inner_steps, loss=0.0, timeout=300, fragment=f)
                seen = -1
                while True:
                    st = self.client.status(wait_newer_than=seen, wait_s=5.0) if seen >= 0 else self.client.status()
                    seen = st.version
                    now = {fs.fragment: fs.version for fs in st.fragments}
                    if all(now[f] > versions[f] for f in range(FRAGMENTS)):
                        break
                for f in range(FRAGMENTS):
                    versions[f] = self.client.pull(f, versions[f], timeout=300).version
        except Exception as exc:  # reported by the bench, which then fails
            self.errors.append(f"learner {self.learner_id}: {exc!r}")
        finally:
            self.client.close()


def measure(model: str, shards: int, learners: int, rounds: int, warmup: int, work: pathlib.Path) -> dict:
    import numpy as np

    from ddiloco.common import codec
    from ddiloco.common.shard_client import ShardedOuterClient
    from ddiloco.common.transport import OuterClient
    from ddiloco.launcher.processes import Cluster

    inner_steps, batch_size = 20, 8
    cluster = Cluster(work)
    try:
        cluster.start_coordinator([
            "--model", model, "--learners", str(learners), "--inner-steps", str(inner_steps),
            "--batch-size", str(batch_size), "--quorum", str(learners), "--eval-interval", "3600",
            "--lease-timeout", "3600", "--max-seconds", "7200", "--fragments", str(FRAGMENTS),
            "--outer-shards", str(shards),
        ])
        outers = cluster.start_outers(shards)
        deadline = time.monotonic() + 300
        while True:
            m = cluster.membership()
            if m is not None and all(m.outer_shards):
                addresses = list(m.outer_shards)
                break
            if any(p.returncode() is not None for p in outers) or time.monotonic() > deadline:
                raise RuntimeError(f"the outer shards did not register; see {work / 'logs'}")
            time.sleep(0.1)
        config, ids = _register(cluster.coordinator_address, learners)
        probe = OuterClient(addresses[0], config.run_id, ids[0]) if shards == 1 else ShardedOuterClient(
            addresses, config.run_id, ids[0])
        rng = np.random.default_rng(0)
        encs, sizes = [], []
        for f in range(FRAGMENTS):
            g = probe.pull(f, -1, timeout=60)
            arrays = [(n, rng.uniform(-DELTA_SCALE, DELTA_SCALE, size=a.shape).astype(np.float32)) for n, a in g.arrays]
            encs.append(codec.encode(arrays, config.learner.codec, config.learner.block_size))
            sizes.append(sum(a.size for _, a in arrays))
        probe.close()
        window_tokens = inner_steps * batch_size * config.model.context
        errors: list[str] = []
        drivers = [Driver(addresses, config.run_id, lid, encs, window_tokens, inner_steps, rounds, errors) for lid in ids]
        pids = [p.popen.pid for p in outers]
        cpu0, t0 = sum(cb.process_cpu_seconds(p) for p in pids), time.monotonic()
        for d in drivers:
            d.start()
        for d in drivers:
            d.join(timeout=1800)
        cpu1, t1 = sum(cb.process_cpu_seconds(p) for p in pids), time.monotonic()
        if errors or any(d.is_alive() for d in drivers):
            raise RuntimeError(f"drivers failed: {errors[:4]} (alive: {sum(d.is_alive() for d in drivers)})")
    finally:
        cluster.stop_all()

    from ddiloco.common.metrics import is_outer

    events = [e for e in cb.read_events(work) if is_outer(e.get("source"))]
    merges = sorted((e for e in events if e.get("event") == "merge"), key=lambda e: e["t"])
    accepted = {(e["learner"], e["seq"]): e["t"] for e in events if e.get("event") == "delta_accepted"}
    refused = [e for e in events if e.get("event") == "delta_refused"]
    if len(merges) < rounds * FRAGMENTS or refused:
        raise RuntimeError(f"{len(merges)} merges for {rounds} rounds of {FRAGMENTS} fragments, {len(refused)} refused")
    # measured: merges after the warm-up rounds' (each round merges every fragment once)
    start = warmup * FRAGMENTS
    measured = merges[start:]
    span = measured[-1]["t"] - merges[start - 1]["t"]
    deltas = sum(len(m["deltas"]) for m in measured)
    values = sum(len(m["deltas"]) * sizes[m["fragment"]] for m in measured)  # fp32 values merged
    latency = [m["t"] - accepted[tuple(d)] for m in measured for d in m["deltas"] if tuple(d) in accepted]
    all_deltas = sum(len(m["deltas"]) for m in merges)
    return {
        "model": model,
        "shards": shards,
        "params": sum(sizes),
        "learners": learners,
        "fragments": FRAGMENTS,
        "rounds": rounds,
        "merges_measured": len(measured),
        "deltas_per_s": round(deltas / span, 3),
        "ingest_fp32_gb_per_s": round(values * 4 / span / 1e9, 4),
        "accept_to_merge_seconds_p50": round(_percentile(latency, 0.5), 4),
        "accept_to_merge_seconds_p95": round(_percentile(latency, 0.95), 4),
        "outer_cpu_seconds_per_delta": round((cpu1 - cpu0) / all_deltas, 5),
        "outer_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny, S = 1, 2, 4 learners, 3 rounds")
    ap.add_argument("--models", default=None, help="comma-separated presets (default small,medium; quick: tiny)")
    ap.add_argument("--shards", default=None, help="comma-separated S values (default 1,2,4; quick 1,2)")
    ap.add_argument("--learners", type=int, default=None, help="M (default 16; quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds driven, the first two not measured (default 6; quick 3)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    models = (args.models or ("tiny" if args.quick else "small,medium")).split(",")
    shard_counts = [int(x) for x in (args.shards or ("1,2" if args.quick else "1,2,4")).split(",")]
    if 1 not in shard_counts or any(not 1 <= s <= FRAGMENTS for s in shard_counts):
        ap.error(f"--shards must include 1 (the baseline) and stay within 1 to {FRAGMENTS}")
    learners = args.learners or (4 if args.quick else 16)
    rounds = args.rounds or (3 if args.quick else 6)
    warmup = 1 if rounds < 5 else 2
    prov = cb.start_provenance(args.allow_dirty or args.quick, "outer_scale")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-outer-scale-") as tmp:
        for model in models:
            for s in shard_counts:
                print(f"[{time.strftime('%H:%M:%S')}] {model}: S = {s}, M = {learners}, {rounds} rounds ...",
                      file=sys.stderr, flush=True)
                rows.append(measure(model, s, learners, rounds, warmup, pathlib.Path(tmp) / f"{model}-S{s}"))
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["shards"] == 1)
        r["speedup"] = round(r["deltas_per_s"] / base["deltas_per_s"], 3)
        r["scaling_efficiency"] = round(r["speedup"] / r["shards"], 3)
    doc = {
        "bench": "outer_scale",
        "command": "python bench/outer_scale.py" + (" --quick" if args.quick else ""),
        "cpus": os.cpu_count(),
        "target": "scaling_efficiency >= 0.75 while the machine has a core per shard",
        "rows": rows,
        **cb.finish_provenance(prov),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("outer_scale-quick.json" if args.quick else "outer_scale.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("| model | S | deltas/s | fp32 GB/s in | accept->merge p50 s | p95 s | outer CPU s/delta | speedup | efficiency |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['shards']} | {r['deltas_per_s']:.2f} | {r['ingest_fp32_gb_per_s']:.3f} "
              f"| {r['accept_to_merge_seconds_p50']:.3f} | {r['accept_to_merge_seconds_p95']:.3f} "
              f"| {r['outer_cpu_seconds_per_delta']:.4f} | {r['speedup']:.2f} | {r['scaling_efficiency']:.2f} |")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
