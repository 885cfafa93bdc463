#!/usr/bin/env python3
"""Why the merge is built the way it is: the same 4-learner job, at equal tokens, merged four ways
(``--quick``: 2 learners, a smoke test of the machinery).

* ``sync``: synchronous DiLoCo (every learner waits; the outer step sees all M deltas).
* ``naive``: asynchronous, a full synchronous outer step per arrival (``--naive-merge``).
* ``staleness-gain-2``: asynchronous on the work clock, with staleness-compensated momentum
  (``--staleness-gain 2``, the default before the exact work clock).
* ``ddiloco``: the default: asynchronous on the exact work clock, plain momentum.

Asynchronous runs depend on arrival order, so each is repeated; the table shows mean and
spread. Usage: ``python bench/merge_ablation.py [--quick] [--tokens N] [--repeats R]``.
Writes ``bench/results/merge_ablation.json`` (or ``--out``).
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "services"))
sys.path.insert(0, str(ROOT / "bench"))

import common_bench as cb  # noqa: E402
from ddiloco.launcher.run import LaunchOptions, launch  # noqa: E402

LEARNERS = 4
QUICK_LEARNERS = 2  # --quick checks that every variant runs end to end, not how they compare


def variants(learners: int) -> dict[str, list[str]]:
    return {
        "sync": ["--sync", "--quorum", str(learners)],
        "naive": ["--naive-merge"],
        "staleness-gain-2": ["--staleness-gain", "2"],
        "ddiloco": [],
    }


VARIANTS = variants(LEARNERS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny budget, one repeat")
    parser.add_argument("--tokens", type=int, default=600_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "merge_ablation.json")
    parser.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = parser.parse_args()
    prov = cb.start_provenance(args.allow_dirty or args.quick, "merge_ablation")
    tokens, repeats = (30_000, 1) if args.quick else (args.tokens, args.repeats)
    learners = QUICK_LEARNERS if args.quick else LEARNERS
    base = ["--model", "tiny", "--learners", str(learners), "--inner-steps", "10", "--batch-size", "8",
            "--max-tokens", str(tokens), "--max-seconds", "1800", "--eval-interval", "3"]
    rows = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="ddiloco-ablation-"))
    try:
        for name, flags in variants(learners).items():
            for rep in range(1 if name == "sync" else repeats):  # sync does not depend on arrival order
                out = work / f"{name}-{rep}"
                t0 = time.time()
                result = launch(LaunchOptions(out=out, run_flags=base + flags, learners=learners, device="cpu", progress=False,
                                             monitoring=False))
                if not result.ok:
                    print(f"{name}: run failed: {result.failures}", file=sys.stderr)
                    return 1
                r = result.report
                rows.append({
                    "method": name, "repeat": rep, "final_eval_loss": r["final_eval_loss"],
                    "final_eval_accuracy": r["final_eval_accuracy"], "tokens": r["tokens_trained"],
                    "outer_steps": r["outer_steps"], "wall_seconds": round(time.time() - t0, 1),
                })
                print(f"{name} #{rep}: eval loss {r['final_eval_loss']:.4f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sync_loss = next(r["final_eval_loss"] for r in rows if r["method"] == "sync")
    print("\n| method | runs | final eval loss (mean) | min | max | vs sync |\n|---|---|---|---|---|---|")
    summary = []
    for name in VARIANTS:
        losses = [r["final_eval_loss"] for r in rows if r["method"] == name]
        mean = statistics.fmean(losses)
        summary.append({"method": name, "mean_final_eval_loss": mean, "runs": len(losses), "vs_sync": mean / sync_loss - 1})
        print(f"| {name} | {len(losses)} | {mean:.4f} | {min(losses):.4f} | {max(losses):.4f} | {mean / sync_loss - 1:+.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/merge_ablation.py" + (" --quick" if args.quick else f" --tokens {tokens} --repeats {repeats}")
    args.out.write_text(json.dumps({"command": command, "config": {"tokens": tokens, "repeats": repeats, "flags": base},
                                    "provenance": cb.finish_provenance(prov), "rows": rows, "summary": summary},
                                   indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
