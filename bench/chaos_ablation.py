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
* ``all``: both, the chaos bench's schedule;
* ``again``: no faults, a second time: its "cost" against ``none`` of the same seed is what
  two fault-free runs of the same settings differ by (timing alone decides how many steps a
  learner adds to a window while it waits), the noise floor measured in the same run.

Reported per row: final eval loss, tokens merged, goodput and its waste; and the eval loss
at equal tokens merged, relative to the ``none`` row, at three levels (half, three
quarters, and all of the fewest tokens any row merged): the cost per token, which the
number of tokens trained does not enter.

One run per row does not resolve costs of a few percent: two runs of the same settings
differ by that much per token (arrival orders differ from run to run). ``--repeats R``
runs the rows R times, interleaved (none, all, none, all, ...: drift of the machine falls
on every row alike), repeat r with the run seed r, and compares each run with the ``none``
run of its own repeat; the summary gives each row's mean, lowest and highest cost over the
repeats, and the fault-free runs' own spread at the same token counts: the noise floor a
cost must clear.

    python bench/chaos_ablation.py            # M = 8, T = 300 s, emulated 0.1 s steps, ~23 minutes
    python bench/chaos_ablation.py --rows none,all --repeats 3   # ~33 minutes
    python bench/chaos_ablation.py --rows none,learners,outer --repeats 3   # each family alone; ~50 minutes
    python bench/chaos_ablation.py --rows none,all,again --repeats 3   # with its noise floor; ~48 minutes
    python bench/chaos_ablation.py --quick    # the smoke form: M = 2, T = 30 s, rows none and all
    python bench/chaos_ablation.py --compare A.json B.json   # same row, same seed, B against A

``--compare`` runs nothing: for every row and repeat in both results files (two revisions,
say) it prints B's eval loss against A's at equal tokens merged, at the same levels.

Writes ``bench/results/chaos_ablation.json``; ``--quick`` adds ``-quick`` to the name,
``--rows`` the rows (``chaos_ablation-none-all-repeats3.json`` for the second command above),
``--repeats R`` ``-repeatsR``.
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
ROWS = {"none": (), "learners": ("learners",), "outer": ("outer",), "all": chaos.FAMILIES, "again": ()}
LEVELS = (0.5, 0.75, 1.0)  # fractions of the fewest tokens any row merged


def fault_free_by_repeat(rows: list[dict]) -> dict[int, dict]:
    """The ``none`` run of each repeat (results written before repeats existed: repeat 0)."""
    return {r.get("repeat", 0): r for r in rows if r["row"] == "none"}


def equal_token_table(rows: list[dict]) -> list[dict]:
    """Per run, its eval loss at equal tokens merged and its ratio to the ``none`` run of the
    same repeat, at ``LEVELS`` of the fewest tokens merged by any run (every curve reaches
    them, so every repeat is read at the same token counts)."""
    base = fault_free_by_repeat(rows)
    fewest = min(r["tokens_merged"] for r in rows)
    out = []
    for r in rows:
        repeat = r.get("repeat", 0)
        at = []
        for level in LEVELS:
            tokens = int(level * fewest)
            loss = chaos.loss_at_tokens(r["loss_curve"], tokens)
            ref = chaos.loss_at_tokens(base[repeat]["loss_curve"], tokens)
            at.append({"tokens": tokens, "eval_loss": round(loss, 4), "vs_none": round(loss / ref - 1, 4)})
        out.append({"row": r["row"], "repeat": repeat, "at": at})
    return out


def summary(table: list[dict]) -> dict:
    """Over the repeats: each row's mean, lowest and highest cost per token at every level,
    and the fault-free runs' spread at the same token counts ((highest - lowest) / lowest of
    their losses): a cost smaller than that spread is not resolved by these runs."""
    names = list(dict.fromkeys(t["row"] for t in table))
    rows = []
    for name in names:
        runs = [t for t in table if t["row"] == name]
        at = []
        for i, level in enumerate(runs[0]["at"]):
            costs = [t["at"][i]["vs_none"] for t in runs]
            at.append({"tokens": level["tokens"], "vs_none_mean": round(sum(costs) / len(costs), 4),
                       "vs_none_min": min(costs), "vs_none_max": max(costs)})
        rows.append({"row": name, "repeats": len(runs), "at": at})
    clean = [t for t in table if t["row"] == "none"]
    spread = []
    for i, level in enumerate(clean[0]["at"]):
        losses = [t["at"][i]["eval_loss"] for t in clean]
        spread.append({"tokens": level["tokens"], "lowest": min(losses), "highest": max(losses),
                       "spread": round(max(losses) / min(losses) - 1, 4)})
    return {"rows": rows, "fault_free_spread": spread}


def compare(a: dict, b: dict) -> list[dict]:
    """Results file ``b`` against ``a``, run by run: for each (row, repeat) both hold, ``b``'s
    eval loss relative to ``a``'s at ``LEVELS`` of the fewest tokens merged by any of those runs."""
    def runs(doc):
        return {(r["row"], r.get("repeat", 0)): r for r in doc["rows"]}
    ra, rb = runs(a), runs(b)
    keys = [k for k in ra if k in rb]
    if not keys:
        raise ValueError("the two results files have no (row, repeat) in common")
    fewest = min(min(ra[k]["tokens_merged"], rb[k]["tokens_merged"]) for k in keys)
    out = []
    for k in keys:
        at = []
        for level in LEVELS:
            tokens = int(level * fewest)
            la = chaos.loss_at_tokens(ra[k]["loss_curve"], tokens)
            lb = chaos.loss_at_tokens(rb[k]["loss_curve"], tokens)
            at.append({"tokens": tokens, "a": round(la, 4), "b": round(lb, 4), "b_vs_a": round(lb / la - 1, 4)})
        out.append({"row": k[0], "repeat": k[1], "at": at})
    return out


def print_compare(table: list[dict], a_name: str, b_name: str) -> None:
    print(f"B = {b_name} against A = {a_name}, same row and seed, at equal tokens merged")
    print()
    print("| row | repeat | " + " | ".join(f"at {x['tokens']:,} tokens: A, B (B vs A)" for x in table[0]["at"]) + " |")
    print("|---|---:|" + "---:|" * len(table[0]["at"]))
    for t in table:
        print(f"| {t['row']} | {t['repeat']} | " + " | ".join(
            f"{x['a']:.4f}, {x['b']:.4f} ({x['b_vs_a']:+.2%})" for x in t["at"]) + " |")


def print_tables(rows: list[dict], table: list[dict], summ: dict) -> None:
    print("| faults | repeat | final eval loss | vs none | tokens merged | goodput | waiting | restarting | refused stale |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = fault_free_by_repeat(rows)
    for r in rows:
        w = r.get("waste") or {}
        ref = base[r.get("repeat", 0)]["final_eval_loss"]
        print(f"| {r['row']} | {r.get('repeat', 0)} | {r['final_eval_loss']:.4f} | {r['final_eval_loss'] / ref - 1:+.2%} | "
              f"{r['tokens_merged']:,} | {chaos.fmt(r['goodput'])} | {chaos.fmt(w.get('waiting'))} | "
              f"{chaos.fmt(w.get('restarting'))} | {chaos.fmt(w.get('refused_stale'))} |")
    print()
    levels = table[0]["at"]
    print("| faults | repeat | " + " | ".join(f"loss at {a['tokens']:,} tokens (vs none)" for a in levels) + " |")
    print("|---|---:|" + "---:|" * len(levels))
    for t in table:
        print(f"| {t['row']} | {t['repeat']} | " + " | ".join(f"{a['eval_loss']:.4f} ({a['vs_none']:+.2%})" for a in t["at"]) + " |")
    print()
    print("| faults | repeats | " + " | ".join(f"vs none at {a['tokens']:,} tokens: mean [lowest, highest]" for a in levels) + " |")
    print("|---|---:|" + "---:|" * len(levels))
    for r in summ["rows"]:
        print(f"| {r['row']} | {r['repeats']} | " + " | ".join(
            f"{a['vs_none_mean']:+.2%} [{a['vs_none_min']:+.2%}, {a['vs_none_max']:+.2%}]" for a in r["at"]) + " |")
    print("| (fault-free spread) | | " + " | ".join(f"{a['spread']:.2%}" for a in summ["fault_free_spread"]) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 learners, 30 s, rows none and all")
    ap.add_argument("--rows", default=None, help=f"comma-separated rows to run, of {', '.join(ROWS)} (default: none, learners, outer "
                    "and all; none is always run, as the reference)")
    ap.add_argument("--seconds", type=float, default=None, help="training budget per run (outer kills move to half of it)")
    ap.add_argument("--repeats", type=int, default=1, help="run the rows this many times, interleaved; repeat r with run seed r")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="run folders (default: a new folder under /tmp)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    ap.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("A", "B"),
                    help="run nothing: print results file B against A, same row and seed, at equal tokens")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = args.compare
        print_compare(compare(json.loads(a.read_text()), json.loads(b.read_text())), str(a), str(b))
        return 0
    names = (args.rows.split(",") if args.rows else (["none", "all"] if args.quick else ["none", "learners", "outer", "all"]))
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; expected some of {list(ROWS)}")
    names = ["none"] + [n for n in names if n != "none"]
    if not 1 <= args.repeats <= 20:
        ap.error(f"--repeats {args.repeats}: expected 1 to 20 (each is a run of every row)")
    s = chaos.bench_settings(args.quick, args.device)
    if args.seconds:  # as bench/chaos.py --seconds
        s.seconds = args.seconds
        s.outer_kill_at = s.seconds / 2
        s.checkpoint_kill_at = -1.0  # 0.7 x seconds
    prov = cb.start_provenance(args.allow_dirty or args.quick, "chaos_ablation")
    out = args.out or pathlib.Path(f"/tmp/ddiloco-bench-chaos-ablation-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos ablation: M={s.learners}, T={s.seconds:g}s, step >= {s.step_seconds:g}s; rows {names}, "
          f"{args.repeats} repeat(s)", file=sys.stderr)
    rows = []
    for repeat in range(args.repeats):
        for name in names:
            print(f"[{time.strftime('%H:%M:%S')}] {name} (repeat {repeat}, seed {repeat}) ...", file=sys.stderr, flush=True)
            folder = out / name if args.repeats == 1 else out / f"{name}-{repeat}"
            row = chaos.run_ddiloco(s, folder, sync=False, chaos=bool(ROWS[name]), families=ROWS[name], seed=repeat)
            rows.append({"row": name, "repeat": repeat, "seed": repeat, **row})
    table = equal_token_table(rows)
    summ = summary(table)
    doc = {
        "command": "python bench/chaos_ablation.py" + (" --quick" if args.quick else "")
        + (f" --rows {','.join(names)}" if args.rows else "") + (f" --repeats {args.repeats}" if args.repeats > 1 else ""),
        "settings": vars(s),
        "provenance": cb.finish_provenance(prov),
        "rows": rows,
        "equal_tokens": table,
        "repeats": args.repeats,
        "summary": summ,
        "argv": shlex.join(sys.argv),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    # the rows chosen name the file, so ablations of different families do not overwrite each other
    name = ("chaos_ablation" + ("-quick" if args.quick else "") + ("-" + "-".join(names) if args.rows else "")
            + (f"-repeats{args.repeats}" if args.repeats > 1 else ""))
    path = args.results_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print_tables(rows, table, summ)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
