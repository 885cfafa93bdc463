#!/usr/bin/env python3
"""Which of the chaos bench's faults cost Decoupled DiLoCo what, per token and per hour.

``bench/chaos.py`` compares ddiloco under its fault schedule with ddiloco fault-free at the
end of the same wall-clock budget. That gap mixes two things: tokens not trained (goodput:
learners down, restarting, waiting) and what each merged token is worth (work trained on
an old base while the outer optimizer is away, merged as a backlog). This bench separates
them and the fault families: one invocation runs ddiloco with the chaos bench's settings
four ways, one after another:

* ``none``: no faults;
* ``learners``: the learner kills alone (SIGKILL every 60 s, restarted 20 s later);
* ``outer``: the outer-optimizer kills alone (one with a round of deltas pending after a
  freeze, one during a checkpoint write, each restarted 5 s later);
* ``all``: both, the chaos bench's schedule.

Reported per row: final eval loss, tokens merged, goodput and its waste; and the eval loss
at equal tokens merged, relative to the ``none`` row, at three levels (half, three
quarters, and all of the fewest tokens any row merged): the cost per token, which the
number of tokens trained does not enter.

    python bench/chaos_ablation.py            # M = 8, T = 300 s, emulated 0.1 s steps, ~23 minutes
    python bench/chaos_ablation.py --quick    # the smoke form: M = 2, T = 30 s, rows none and all

Writes ``bench/results/chaos_ablation.json`` (``chaos_ablation-quick.json`` with --quick).
Runs alone on the machine, like every bench (``bench/common_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import chaos  # noqa: E402  (puts services/ on the path)
import common_bench as cb  # noqa: E402

ROOT = cb.ROOT
# row name -> the fault families it holds (chaos.FAMILIES)
ROWS = {"none": (), "learners": ("learners",), "outer": ("outer",), "all": chaos.FAMILIES}
LEVELS = (0.5, 0.75, 1.0)  # fractions of the fewest tokens any row merged


def equal_token_table(rows: list[dict]) -> list[dict]:
    """Per row, its eval loss at equal tokens merged and its ratio to the ``none`` row's,
    at ``LEVELS`` of the fewest tokens merged by any row (every curve reaches them)."""
    base = next(r for r in rows if r["row"] == "none")
    fewest = min(r["tokens_merged"] for r in rows)
    out = []
    for r in rows:
        at = []
        for level in LEVELS:
            tokens = int(level * fewest)
            loss = chaos.loss_at_tokens(r["loss_curve"], tokens)
            ref = chaos.loss_at_tokens(base["loss_curve"], tokens)
            at.append({"tokens": tokens, "eval_loss": round(loss, 4), "vs_none": round(loss / ref - 1, 4)})
        out.append({"row": r["row"], "at": at})
    return out


def print_tables(rows: list[dict], table: list[dict]) -> None:
    print("| faults | final eval loss | vs none | tokens merged | goodput | waiting | restarting | refused stale |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = next(r for r in rows if r["row"] == "none")
    for r in rows:
        w = r.get("waste") or {}
        print(f"| {r['row']} | {r['final_eval_loss']:.4f} | {r['final_eval_loss'] / base['final_eval_loss'] - 1:+.2%} | "
              f"{r['tokens_merged']:,} | {chaos.fmt(r['goodput'])} | {chaos.fmt(w.get('waiting'))} | "
              f"{chaos.fmt(w.get('restarting'))} | {chaos.fmt(w.get('refused_stale'))} |")
    print()
    levels = table[0]["at"]
    print("| faults | " + " | ".join(f"loss at {a['tokens']:,} tokens (vs none)" for a in levels) + " |")
    print("|---|" + "---:|" * len(levels))
    for t in table:
        print(f"| {t['row']} | " + " | ".join(f"{a['eval_loss']:.4f} ({a['vs_none']:+.2%})" for a in t["at"]) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 learners, 30 s, rows none and all")
    ap.add_argument("--rows", default=None, help=f"comma-separated rows to run, of {', '.join(ROWS)} (default: all four; "
                    "none is always run, as the reference)")
    ap.add_argument("--seconds", type=float, default=None, help="training budget per run (outer kills move to half of it)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="run folders (default: a new folder under /tmp)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    names = (args.rows.split(",") if args.rows else (["none", "all"] if args.quick else list(ROWS)))
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; expected some of {list(ROWS)}")
    names = ["none"] + [n for n in names if n != "none"]
    s = chaos.bench_settings(args.quick, args.device)
    if args.seconds:  # as bench/chaos.py --seconds
        s.seconds = args.seconds
        s.outer_kill_at = s.seconds / 2
        s.checkpoint_kill_at = -1.0  # 0.7 x seconds
    prov = cb.start_provenance(args.allow_dirty or args.quick, "chaos_ablation")
    out = args.out or pathlib.Path(f"/tmp/ddiloco-bench-chaos-ablation-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos ablation: M={s.learners}, T={s.seconds:g}s, step >= {s.step_seconds:g}s; rows {names}", file=sys.stderr)
    rows = []
    for name in names:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        row = chaos.run_ddiloco(s, out / name, sync=False, chaos=bool(ROWS[name]), families=ROWS[name])
        rows.append({"row": name, **row})
    table = equal_token_table(rows)
    doc = {
        "command": "python bench/chaos_ablation.py" + (" --quick" if args.quick else ""),
        "settings": vars(s),
        "provenance": cb.finish_provenance(prov),
        "rows": rows,
        "equal_tokens": table,
        "argv": shlex.join(sys.argv),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("chaos_ablation-quick.json" if args.quick else "chaos_ablation.json")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print_tables(rows, table)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
