"""What a ddiloco learner costs over a plain PyTorch training loop of the same model.

One invocation measures, on the same machine, the same device and the same thread count:

* ``plain``: the run's workload trained by a bare loop (its model, its batches of shard 0,
  AdamW with the learner's settings, clipping), no ddiloco anywhere: tokens per second of
  the loop after a warm-up.
* ``learner``: ``ddiloco run`` with one learner (coordinator and outer optimizer beside it,
  uploads, pulls and folds in the background, as in any run): the learner's tokens per
  second over its training wall time (``report.json``: tokens / wall_seconds).

The runs alternate, plain loop first and last (plain, learner, plain, learner, ..., plain),
and each learner run is compared with the mean of the plain runs on either side of it, so a
drift of the machine during the bench lands on both sides of each ratio. The result is the
median of those ratios; the target is at least 0.95 (the background work must be nearly
free).

    python bench/learner_overhead.py            # bytegpt small, 3 pairs: 40 s learner runs, 20 s plain runs
    python bench/learner_overhead.py --quick    # the CI smoke form: tiny, seconds, one pair

Writes ``bench/results/learner_overhead.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common_bench as cb  # noqa: E402

ROOT = cb.ROOT
TARGET = 0.95


def plain_tokens_per_second(flags: list[str], seconds: float, warmup_steps: int) -> dict:
    """The bare loop: tokens per second over ``seconds`` after ``warmup_steps`` steps."""
    import argparse as ap

    import torch

    from ddiloco.common.runflags import add_run_flags, run_config_from_args
    from ddiloco.workloads import load

    torch.set_num_threads(1)  # as a learner runs (--threads 1)
    parser = ap.ArgumentParser()
    add_run_flags(parser)
    cfg = run_config_from_args(parser.parse_args(flags))
    workload = load(cfg)
    model = workload.build_model()
    model.train()
    params = list(model.parameters())
    lc = cfg.learner
    opt = torch.optim.AdamW(params, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.95))
    batches = workload.train_batches(0, cfg.learners, cfg.data.seed, 0)
    tokens = steps = 0
    t0 = None
    while True:
        if steps == warmup_steps:
            t0, tokens = time.perf_counter(), 0
        if t0 is not None and time.perf_counter() - t0 >= seconds:
            break
        batch = next(batches)
        tokens += workload.batch_weight(batch)
        for g in opt.param_groups:
            g["lr"] = lc.lr * min(1.0, (steps + 1) / max(lc.warmup_steps, 1))
        loss = workload.loss(model, batch)
        float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        opt.step()
        steps += 1
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_second": tokens / wall}


def learner_tokens_per_second(flags: list[str], seconds: float, work: pathlib.Path, insecure: bool = False) -> dict:
    report = cb.run_ddiloco(work / "run", flags + ["--max-seconds", str(seconds)], learners=1, insecure=insecure)
    lr = report["learners"][0]
    out = {"tokens": lr["tokens"], "seconds": lr["wall_seconds"], "tokens_per_second": lr["tokens"] / lr["wall_seconds"],
           "deltas_merged": lr["deltas_merged"], "compute_seconds": lr.get("compute_seconds")}
    # Steady state, as the plain loop's figure is (it skips its first steps): from the end of
    # the learner's first window of fragment 0 to the end of its last, so neither the first
    # steps nor the drain at the end weigh in. The wall figure above includes both.
    ends = [(e["t"], e["steps"]) for e in cb.read_events(work / "run")
            if e.get("event") == "window" and e.get("learner") == 0 and e.get("fragment") == 0]
    per_step = lr["tokens"] / lr["inner_steps"] if lr.get("inner_steps") else None
    if len(ends) >= 3 and per_step:
        span = ends[-1][0] - ends[0][0]
        out["steady"] = {"windows": len(ends) - 1, "seconds": round(span, 3),
                         "tokens_per_second": sum(n for _, n in ends[1:]) * per_step / span}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: the tiny model, a few seconds each, one pair")
    parser.add_argument("--seconds", type=float, default=40.0, help="training seconds of each learner measurement")
    parser.add_argument("--pairs", type=int, default=3, help="learner runs, each between two plain-loop runs")
    parser.add_argument("--allow-dirty", action="store_true")
    parser.add_argument("--insecure", action="store_true",
                        help="run the learner's services without mutual TLS (diagnostic: TLS's share of the overhead)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "learner_overhead.json")
    args = parser.parse_args()
    prov = cb.start_provenance(args.allow_dirty or args.quick, "learner_overhead")
    seconds = 6.0 if args.quick else args.seconds
    pairs = 1 if args.quick else args.pairs
    model = "tiny" if args.quick else "small"
    flags = ["--model", model, "--learners", "1", "--inner-steps", "20", "--eval-interval", "30"]
    work = pathlib.Path(tempfile.mkdtemp(prefix="ddiloco-overhead-"))
    # plain, learner, plain, learner, ..., plain: each learner run is judged against the
    # plain runs on either side of it, so the machine's drift (8% over two minutes has been
    # seen here) lands on both sides of each ratio instead of on one
    plains, learners = [], []
    try:
        plains.append(plain_tokens_per_second(flags, seconds / 2, warmup_steps=5))
        for i in range(pairs):
            learners.append(learner_tokens_per_second(flags, seconds, work / f"pair{i}", insecure=args.insecure))
            plains.append(plain_tokens_per_second(flags, seconds / 2, warmup_steps=5))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios, steady_ratios = [], []
    for i, learner in enumerate(learners):
        around = (plains[i]["tokens_per_second"] + plains[i + 1]["tokens_per_second"]) / 2
        ratios.append(learner["tokens_per_second"] / around)
        if learner.get("steady"):
            steady_ratios.append(learner["steady"]["tokens_per_second"] / around)
    ratio = statistics.median(ratios)
    steady_ratio = statistics.median(steady_ratios) if steady_ratios else None
    plain = statistics.mean(p["tokens_per_second"] for p in plains)
    result = {
        "config": {"flags": flags, "seconds": seconds, "pairs": pairs, "quick": args.quick, "threads": 1, "device": "cpu",
                   "tls": not args.insecure},
        "plain": plains, "learners": learners,
        "plain_tokens_per_second": plain,
        "ratios": ratios, "ratio": ratio, "target": TARGET, "met": ratio >= TARGET,
        "steady_ratios": steady_ratios, "steady_ratio": steady_ratio,
        "provenance": cb.finish_provenance(prov),
    }
    print("| measurement | tokens/s | ratio to the plain runs beside it |\n|---|---:|---:|")
    for i, p in enumerate(plains):
        print(f"| plain loop {i + 1} | {p['tokens_per_second']:,.0f} | |")
        if i < len(learners):
            print(f"| ddiloco learner {i + 1} | {learners[i]['tokens_per_second']:,.0f} | {ratios[i]:.3f} |")
    print(f"| ratio, median of {len(ratios)} (target >= {TARGET}) | | {ratio:.3f} ({'met' if ratio >= TARGET else 'missed'}) |")
    if steady_ratio is not None:
        print(f"| steady-state ratio, median | | {steady_ratio:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
