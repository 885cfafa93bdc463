"""Quality at scale: Decoupled DiLoCo against synchronous DiLoCo and dp at M = 4, 8, 16.

Issue 17, item 5. The tiny model, H = 20, batch 8, a token budget of 12M (total across
learners) and the eval curve all along, two seeds each:

    dp                 ddiloco dp --world-size M (gradients all-reduced every step)
    diloco-sync        ddiloco run --sync --quorum M --fragments 1 --codec fp32
    ddiloco-int8       ddiloco run --codec int8 (the run defaults otherwise)
    ddiloco-int4       ddiloco run --codec int4                    (at M = 8 only)
    ddiloco-int8-slow  ddiloco-int8 with learner M-1 three times slower (at M = 8 only)
    ddiloco-fp32       ddiloco run --codec fp32: asynchronous, unquantized (only when named in
                       --methods: a diagnostic that separates what asynchrony costs from what
                       quantization and its error feedback cost)
    ddiloco-int8-unitgain  ddiloco-int8 with --full-gain-rounds 1 (the default rule, named
                       explicitly; only when named in --methods)
    ddiloco-int8-fullgain  ddiloco-int8 with --full-gain-rounds 1.5: merges of phase-aligned
                       windows all at the full Nesterov gain (only when named); the two
                       side by side compare the merge rules (docs/algorithm.md)
    ddiloco-int8-noalign   ddiloco-int8 with --no-align-windows: every window exactly H
                       steps (only when named); beside ddiloco-int8 it separates what the
                       lengthened windows of phase alignment cost from what the overlap
                       (learners training on while a merge is in flight) costs

``--warm-start-steps W`` starts every method from one serial warm start per seed: one
learner trains W inner steps alone (``ddiloco run --warm-start-steps``, launcher/warm_start.py),
and dp, diloco-sync and the asynchronous rows all start from its model with the rest of the
budget; each row's tokens, curve and wall seconds include the phase's.

A seed sets the initial model (RunConfig.seed) and the order the shards are read in
(DataConfig.seed = 1234 + seed); the split of the corpus is the same for every seed.
Runs go one after the other, M by M, seed by seed; ddiloco-int8-slow runs right after
ddiloco-int8 of the same M and seed, whose fast learners' tokens/s it is compared with.

Targets (every M, mean over seeds; "within x%" read one-sided, at most x% higher loss):
diloco-sync <= dp + 1%; ddiloco-int8 <= diloco-sync + 1% at the budget and, after the first
10% of the budget, at no point of the curve more than 2% above it; int4 within 0.5% of int8;
the 3x-slow run within 3% of the all-fast one, with the fast learners' tokens/s >= 0.95 of
theirs.

    python bench/quality_scale.py                       # everything: run it alone on the machine
    python bench/quality_scale.py --learners 8 --seeds 0 --methods diloco-sync,ddiloco-int8
    python bench/quality_scale.py --learners 4 --methods diloco-sync,ddiloco-int8 --step-seconds 0.05
                                                        # emulated dedicated hardware (regular step times)
    python bench/quality_scale.py --quick               # smoke test: M=2, one seed, tens of thousands of tokens
    python bench/quality_scale.py --summarize bench/results/quality_scale_m4_m16.json   # targets of a result, no run

Writes ``bench/results/quality_scale.json`` (``quality_scale-quick.json`` with --quick):
``{"config": {...}, "rows": [{"method", "learners", "seed", "tokens", "final_eval_loss",
"final_eval_accuracy", "deltas_per_merge_mean", "staleness_mean", "wall_seconds", "curve":
[[tokens, loss], ...], "extra": {...}}], "targets": [...]}`` and a PNG of eval loss against
tokens, one panel per M.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import shlex
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import common_bench as cb  # noqa: E402  (also puts services/ on sys.path)

ROOT = cb.ROOT
METHODS = ["dp", "diloco-sync", "ddiloco-int8", "ddiloco-int8-slow", "ddiloco-int4", "ddiloco-fp32",
           "ddiloco-int8-unitgain", "ddiloco-int8-fullgain", "ddiloco-int8-noalign"]  # also the run order
DEFAULT_METHODS = METHODS[:5]  # the others are diagnostics, run only when asked for
# ddiloco-int8 with one setting changed, named explicitly: a merge rule each, or no phase alignment
RULE_METHODS = ("ddiloco-int8-unitgain", "ddiloco-int8-fullgain", "ddiloco-int8-noalign")
EXTRA_METHODS = ("ddiloco-int4", "ddiloco-int8-slow")  # run at --extras-at only
SLOW_FACTOR = 3.0
ROW_KEYS = ["method", "learners", "seed", "tokens", "final_eval_loss", "final_eval_accuracy", "deltas_per_merge_mean",
            "staleness_mean", "wall_seconds", "curve"]
TAIL = 0.20  # the share of the budget the tail diagnostics look at
LIMITS = {"sync_vs_dp": 0.01, "int8_vs_sync": 0.01, "int8_curve_vs_sync": 0.02, "curve_skip": 0.10,
          "int4_vs_int8": 0.005, "slow_vs_int8": 0.03, "fast_tokens_per_s_ratio": 0.95}


def method_flags(method: str, m: int) -> list[str]:
    return {
        "diloco-sync": ["--sync", "--quorum", str(m), "--fragments", "1", "--codec", "fp32"],
        "ddiloco-int8": ["--codec", "int8"],
        "ddiloco-int4": ["--codec", "int4"],
        "ddiloco-int8-slow": ["--codec", "int8"],
        "ddiloco-fp32": ["--codec", "fp32"],
        "ddiloco-int8-unitgain": ["--codec", "int8", "--full-gain-rounds", "1"],
        "ddiloco-int8-fullgain": ["--codec", "int8", "--full-gain-rounds", "1.5"],
        "ddiloco-int8-noalign": ["--codec", "int8", "--no-align-windows"],
    }.get(method, [])


# ----------------------------------------------------------------------------- one run
def learner_rates(report: dict, events: list[dict]) -> dict[str, dict]:
    slowed = {e["learner"] for e in events if e.get("event") == "learner_start" and e.get("slowdown", 1.0) > 1.0}
    out = {}
    for lr in report.get("learners", []):
        wall = lr.get("wall_seconds") or 0.0
        out[str(lr["learner_id"])] = {"tokens": lr["tokens"], "tokens_per_s": lr["tokens"] / wall if wall > 0 else None,
                                      "slow": lr["learner_id"] in slowed}
    return out


def run_warm_start(cfg, steps: int, budget: int, run_dir: pathlib.Path, cfg_path: pathlib.Path, device: str,
                   step_seconds: float = 0.0) -> dict:
    """The serial warm start of one seed, as ``ddiloco run --warm-start-steps`` trains it (the
    same flags, launcher/warm_start.py); its result and eval curve. It does not depend on M:
    one learner reads the whole corpus in the seed's order."""
    from ddiloco.launcher import warm_start

    base = ["--config", str(cfg_path), "--max-tokens", str(budget), "--max-seconds", str(cfg.max_seconds)]
    phase_plan = warm_start.plan(cfg, steps, cfg.learner.batch_size * cfg.model.context)
    cb.run_ddiloco(run_dir, warm_start.phase_flags(base, cfg, phase_plan), 1, device, step_seconds=step_seconds)
    done = warm_start.read_result(run_dir)
    curve = cb.eval_curve(cb.read_events(run_dir))
    if not curve or curve[-1][0] < done.tokens:
        curve.append((done.tokens, float(done.final_eval_loss)))
    return {"steps": phase_plan.steps, "tokens": done.tokens, "seconds": done.seconds,
            "initial_eval_loss": done.initial_eval_loss, "final_eval_loss": done.final_eval_loss,
            "folder": str(run_dir), "curve": [[int(t), round(v, 5)] for t, v in curve]}


def with_warm_start(row: dict, warm: dict) -> dict:
    """``row`` of a run started from ``warm``, counted from the seed's initialisation: the
    phase's tokens, time and curve first, the run's curve after them."""
    shift = warm["tokens"]
    row["tokens"] += shift
    row["wall_seconds"] = round(row["wall_seconds"] + warm["seconds"], 3)
    row["curve"] = warm["curve"] + [[t + shift, v] for t, v in row["curve"] if t > 0]
    row["extra"]["initial_eval_loss"] = warm["initial_eval_loss"]
    row["extra"]["warm_start"] = {k: warm[k] for k in ("steps", "tokens", "seconds", "final_eval_loss", "folder")}
    return row


def run_one(method: str, m: int, seed: int, budget: int, cfg_path: pathlib.Path, run_dir: pathlib.Path,
            device: str, step_seconds: float = 0.0) -> dict:
    flags = ["--config", str(cfg_path), "--max-tokens", str(budget)]
    t0 = time.monotonic()
    if method == "dp":
        report = cb.run_dp(run_dir, flags, m, device, step_seconds=step_seconds)
    else:
        slow = {m - 1: SLOW_FACTOR} if method == "ddiloco-int8-slow" else {}
        report = cb.run_ddiloco(run_dir, flags + method_flags(method, m), m, device, slowdown=slow,
                                step_seconds=step_seconds)
    events = cb.read_events(run_dir)
    curve = cb.eval_curve(events)
    final_tokens = report.get("tokens_merged") or report["tokens_trained"]
    if not curve or curve[-1][0] < final_tokens:
        curve.append((int(final_tokens), float(report["final_eval_loss"])))
    stats = cb.merge_stats(events, m) if method != "dp" else {}
    row = {
        "method": method,
        "learners": m,
        "seed": seed,
        "tokens": report["tokens_trained"],
        "final_eval_loss": report["final_eval_loss"],
        "final_eval_accuracy": report["final_eval_accuracy"],
        "deltas_per_merge_mean": stats.get("deltas_per_merge_mean"),
        "staleness_mean": stats.get("staleness_mean"),
        "wall_seconds": report["wall_seconds"],
        "curve": [[int(t), round(v, 5)] for t, v in curve],
    }
    extra = {"initial_eval_loss": report.get("initial_eval_loss"), "elapsed_seconds": round(time.monotonic() - t0, 1),
             "run_dir": str(run_dir), "flags": method_flags(method, m), "eval_swing": eval_swing(row["curve"], budget)}
    if method == "dp":
        extra["optimizer_steps"] = report.get("optimizer_steps")
    else:
        extra.update({k: v for k, v in stats.items() if k not in ("deltas_per_merge_mean", "staleness_mean")})
        extra["tokens_merged"] = report.get("tokens_merged")
        extra["outer_steps"] = report.get("outer_steps")
        extra["learners"] = learner_rates(report, events)
    row["extra"] = extra
    return row


# ----------------------------------------------------------------------------- targets
def _rows(rows: list[dict], method: str, m: int) -> list[dict]:
    return [r for r in rows if r["method"] == method and r["learners"] == m]


def _mean_final(rows: list[dict], method: str, m: int) -> float | None:
    return cb.mean([r["final_eval_loss"] for r in _rows(rows, method, m)])


def curve_gap_max(rows: list[dict], m: int, budget: int, method: str = "ddiloco-int8", base: str = "diloco-sync",
                  skip: float = LIMITS["curve_skip"]) -> float | None:
    """Largest relative excess of ``method``'s curve over ``base``'s after the first ``skip``
    of the budget, both curves averaged over the seeds that ran both (interpolated on the
    union of their evaluation points, up to where both curves end)."""
    seeds = sorted({r["seed"] for r in _rows(rows, method, m)} & {r["seed"] for r in _rows(rows, base, m)})
    if not seeds:
        return None
    pairs = []
    for s in seeds:
        a = next(r for r in _rows(rows, method, m) if r["seed"] == s)
        b = next(r for r in _rows(rows, base, m) if r["seed"] == s)
        pairs.append(([tuple(p) for p in a["curve"]], [tuple(p) for p in b["curve"]]))
    end = min(min(a[-1][0], b[-1][0]) for a, b in pairs)
    xs = sorted({x for a, b in pairs for x, _ in a + b if skip * budget <= x <= end})
    if not xs:
        return None
    gaps = []
    for x in xs:
        la = cb.mean([cb.interpolate(a, x) for a, _ in pairs])
        lb = cb.mean([cb.interpolate(b, x) for _, b in pairs])
        gaps.append(la / lb - 1)
    return round(max(gaps), 5)


def _seed_pairs(rows: list[dict], m: int, method: str, base: str) -> list[tuple[list, list]]:
    seeds = sorted({r["seed"] for r in _rows(rows, method, m)} & {r["seed"] for r in _rows(rows, base, m)})
    return [([tuple(p) for p in next(r for r in _rows(rows, method, m) if r["seed"] == s)["curve"]],
             [tuple(p) for p in next(r for r in _rows(rows, base, m) if r["seed"] == s)["curve"]]) for s in seeds]


def tail_gap(rows: list[dict], m: int, budget: int, method: str = "ddiloco-int8", base: str = "diloco-sync",
             tail: float = TAIL, points: int = 50) -> float | None:
    """Relative gap of the mean eval loss over the last ``tail`` of the budget: each curve
    interpolated on one grid of ``points`` token counts (evaluations come every few seconds,
    so the methods' points sit at different tokens), averaged over the seeds that ran both.

    Why beside the final point: with a constant inner learning rate the model's eval loss
    swings from one evaluation to the next (``eval_swing`` of each row); at M = 4 the swing
    of a single point is about the size of the 1% target, so one final point per seed cannot
    tell a 1% gap from a lucky or unlucky last evaluation. The tail mean can."""
    pairs = _seed_pairs(rows, m, method, base)
    if not pairs:
        return None
    end = min(min(a[-1][0], b[-1][0]) for a, b in pairs)
    start = (1 - tail) * budget
    if end <= start:
        return None
    xs = [start + (end - start) * i / (points - 1) for i in range(points)]
    la = cb.mean([cb.mean([cb.interpolate(a, x) for x in xs]) for a, _ in pairs])
    lb = cb.mean([cb.mean([cb.interpolate(b, x) for x in xs]) for _, b in pairs])
    return round(la / lb - 1, 5)


def eval_swing(curve: list, budget: int, tail: float = TAIL) -> float | None:
    """Standard deviation of the change between successive evaluations over the last ``tail``
    of the budget (the training trend there is a small part of it): how far one eval point
    may sit from its neighbours."""
    ys = [y for x, y in curve if x >= (1 - tail) * budget]
    if len(ys) < 3:
        return None
    steps = [b - a for a, b in zip(ys, ys[1:])]
    mu = sum(steps) / len(steps)
    return round((sum((d - mu) ** 2 for d in steps) / len(steps)) ** 0.5, 5)


def fast_ratio(rows: list[dict], m: int) -> float | None:
    """Fast learners' tokens/s in the slow run over the same learners' in ddiloco-int8 (same
    M and seed), mean over seeds."""
    ratios = []
    for slow in _rows(rows, "ddiloco-int8-slow", m):
        base = next((r for r in _rows(rows, "ddiloco-int8", m) if r["seed"] == slow["seed"]), None)
        if base is None:
            continue
        fast = [k for k, v in slow["extra"]["learners"].items() if not v["slow"]]
        mine = cb.mean([slow["extra"]["learners"][k]["tokens_per_s"] for k in fast])
        theirs = cb.mean([base["extra"]["learners"][k]["tokens_per_s"] for k in fast if k in base["extra"]["learners"]])
        if mine is not None and theirs:
            ratios.append(mine / theirs)
    return round(cb.mean(ratios), 4) if ratios else None


def targets(rows: list[dict], budget: int) -> list[dict]:
    out = []

    def add(name: str, m: int, value: float | None, limit: float, higher_ok: bool = False, kind: str = "rel") -> None:
        met = None if value is None else (value >= limit if higher_ok else value <= limit)
        if kind == "diagnostic":  # reported beside the targets, judged by none
            met, kind = None, "rel"
            name = name if name.startswith("(diagnostic)") else f"(diagnostic) {name}"
        out.append({"target": name, "learners": m, "value": value, "limit": limit, "met": met, "kind": kind,
                    "seeds": sorted({r["seed"] for r in rows if r["learners"] == m})})

    for m in sorted({r["learners"] for r in rows}):
        fin = lambda method: _mean_final(rows, method, m)  # noqa: E731
        add("diloco-sync vs dp (final)", m, cb.rel(fin("diloco-sync"), fin("dp")), LIMITS["sync_vs_dp"])
        add("ddiloco-int8 vs diloco-sync (final)", m, cb.rel(fin("ddiloco-int8"), fin("diloco-sync")), LIMITS["int8_vs_sync"])
        add("ddiloco-int8 vs diloco-sync (curve max after 10%)", m, curve_gap_max(rows, m, budget), LIMITS["int8_curve_vs_sync"])
        # diagnostics, not targets: the same comparison over the tail of the budget, and the
        # asynchronous run without quantization where it ran (what asynchrony alone costs)
        add(f"(diagnostic) ddiloco-int8 vs diloco-sync (mean over the last {TAIL:.0%})", m, tail_gap(rows, m, budget),
            LIMITS["int8_vs_sync"], kind="diagnostic")
        if _rows(rows, "ddiloco-fp32", m):
            add("(diagnostic) ddiloco-fp32 vs diloco-sync (final)", m, cb.rel(fin("ddiloco-fp32"), fin("diloco-sync")),
                LIMITS["int8_vs_sync"], kind="diagnostic")
            add(f"(diagnostic) ddiloco-fp32 vs diloco-sync (mean over the last {TAIL:.0%})", m,
                tail_gap(rows, m, budget, method="ddiloco-fp32"), LIMITS["int8_vs_sync"], kind="diagnostic")
        for rule in RULE_METHODS:  # one setting changed, named explicitly, beside the defaults' run
            if not _rows(rows, rule, m):
                continue
            add(f"(diagnostic) {rule} vs diloco-sync (final)", m, cb.rel(fin(rule), fin("diloco-sync")),
                LIMITS["int8_vs_sync"], kind="diagnostic")
            add(f"(diagnostic) {rule} vs diloco-sync (mean over the last {TAIL:.0%})", m,
                tail_gap(rows, m, budget, method=rule), LIMITS["int8_vs_sync"], kind="diagnostic")
            add(f"(diagnostic) ddiloco-int8 vs {rule} (final)", m, cb.rel(fin("ddiloco-int8"), fin(rule)), 0.0,
                kind="diagnostic")
        if _rows(rows, "ddiloco-int4", m):
            add("ddiloco-int4 vs ddiloco-int8 (final)", m, cb.rel(fin("ddiloco-int4"), fin("ddiloco-int8")), LIMITS["int4_vs_int8"])
        if _rows(rows, "ddiloco-int8-slow", m):
            add("ddiloco-int8-slow vs ddiloco-int8 (final)", m, cb.rel(fin("ddiloco-int8-slow"), fin("ddiloco-int8")),
                LIMITS["slow_vs_int8"])
            add("fast learners' tokens/s, slow run / all-fast run", m, fast_ratio(rows, m),
                LIMITS["fast_tokens_per_s_ratio"], higher_ok=True, kind="ratio")
    diverged = [f"{r['method']}@M={r['learners']}/seed {r['seed']}" for r in rows
                if not (r["final_eval_loss"] < (r["extra"].get("initial_eval_loss") or float("inf")))]
    out.append({"target": "no run diverged", "learners": None, "value": len(diverged), "limit": 0,
                "met": not diverged if rows else None, "kind": "count", "note": ", ".join(diverged)})
    return out


def targets_table(items: list[dict]) -> str:
    lines = ["| M | target | value | limit | met |", "|---:|---|---:|---:|---|"]
    for t in items:
        v = t["value"]
        shown = "-" if v is None else (f"{v:+.2%}" if t["kind"] == "rel" else f"{v:.4g}")
        met = {True: "yes", False: "**no**", None: "n/a (not run)"}[t["met"]]
        if t["target"].startswith("(diagnostic)"):
            met = "(not a target)"
        lines.append(f"| {t['learners'] or '-'} | {t['target']} | {shown} | {t['limit']} | {met} |")
    return "\n".join(lines)


def results_table(rows: list[dict]) -> str:
    lines = ["| M | method | seed | tokens | final eval loss | accuracy | deltas/merge | staleness | eval swing | wall s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['learners']} | {r['method']} | {r['seed']} | {r['tokens']:,} | {r['final_eval_loss']:.4f} | "
                     f"{r['final_eval_accuracy']:.2%} | {f(r['deltas_per_merge_mean'], '.2f')} | "
                     f"{f(r['staleness_mean'], '.3f')} | {f(r.get('extra', {}).get('eval_swing'), '.4f')} | "
                     f"{r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", file=sys.stderr)
        return False
    ms = sorted({r["learners"] for r in rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(6.0 * len(ms), 4.6), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for ax, m in zip(axes[0], ms):
        seen = set()
        for r in [r for r in rows if r["learners"] == m]:
            xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
            label = r["method"] if r["method"] not in seen else None
            seen.add(r["method"])
            ax.plot(xs, ys, color=colors[r["method"]], lw=1.2, label=label,
                    ls="--" if r["method"] == "dp" else ("-" if r["seed"] == min(x["seed"] for x in rows) else ":"))
        finals = [r["final_eval_loss"] for r in rows if r["learners"] == m]
        if finals:
            ax.set_ylim(min(finals) * 0.97, min(finals) * 1.5)
        ax.set_title(f"M = {m} (solid/dotted: seeds)")
        ax.set_xlabel("tokens (all learners)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: M=2, one seed, H=5, batch 4, a few rounds")
    p.add_argument("--learners", type=_ints, default=None, help="comma-separated M values (default 4,8,16; quick: 2)")
    p.add_argument("--seeds", type=_ints, default=None, help="comma-separated seeds (default 0,1; quick: 0)")
    p.add_argument("--tokens", type=int, default=None, help="budget across learners (default 12,000,000)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--extras-at", type=int, default=None,
                   help="the M at which ddiloco-int4 and ddiloco-int8-slow run (default 8; quick: 2)")
    p.add_argument("--inner-steps", type=int, default=None, help="H (default 20; quick 5)")
    p.add_argument("--batch-size", type=int, default=None, help="B (default 8; quick 4)")
    p.add_argument("--eval-interval", type=float, default=None, help="seconds between evaluations (default 5; quick 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--warm-start-steps", type=int, default=0, metavar="W",
                   help="every method starts from one serial warm start of W inner steps per seed, counted in the "
                        "budget (default 0: from the seed's initialisation)")
    p.add_argument("--step-seconds", type=float, default=0.0, metavar="T",
                   help="emulated dedicated hardware: every learner's (and dp rank's) step takes at least T s, so "
                        "that step times are regular instead of set by M processes sharing the cores (default 0: off)")
    p.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    p.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--runs-dir", type=pathlib.Path, default=None, help="run folders (default: runs/quality_scale-<time>)")
    p.add_argument("--summarize", type=pathlib.Path, default=None, metavar="JSON",
                   help="print the targets and diagnostics of an existing results file, recomputed from its rows; run nothing")
    args = p.parse_args(argv)
    args.method_list = [x.strip() for x in args.methods.split(",") if x.strip()]
    unknown = [x for x in args.method_list if x not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    q = args.quick
    args.learners = args.learners or ([2] if q else [4, 8, 16])
    args.seeds = args.seeds if args.seeds is not None else ([0] if q else [0, 1])
    args.extras_at = args.extras_at or (2 if q else 8)
    args.inner_steps = args.inner_steps or (5 if q else 20)
    args.batch_size = args.batch_size or (4 if q else 8)
    args.tokens = args.tokens or (20_480 if q else 12_000_000)
    args.eval_interval = args.eval_interval or (1.0 if q else 5.0)
    if any(m < 1 for m in args.learners) or not args.seeds:
        p.error("--learners must be positive and --seeds non-empty")
    if args.warm_start_steps < 0:
        p.error(f"--warm-start-steps must be at least 0, got {args.warm_start_steps}")
    if not (0.0 <= args.step_seconds < 10.0):
        p.error(f"--step-seconds must be in [0, 10), got {args.step_seconds}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    out = []
    for m in args.learners:
        for seed in args.seeds:
            for method in METHODS:
                if method in args.method_list and (method not in EXTRA_METHODS or m == args.extras_at):
                    out.append((m, seed, method))
    return out


def summarize(path: pathlib.Path) -> int:
    """Targets and diagnostics of a results file, recomputed from its rows (no run): how the
    tail diagnostics are read off a committed result. Prints; writes nothing."""
    doc = json.loads(path.read_text())
    rows, budget = doc["rows"], doc["config"]["tokens"]
    for r in rows:  # rows written before the swing was recorded
        r.setdefault("extra", {}).setdefault("eval_swing", eval_swing(r["curve"], budget))
    step = doc['config'].get('step_seconds') or 0
    paced = f", every step >= {step:g} s (emulated dedicated hardware)" if step else ""
    print(f"{path} (git {doc['config'].get('git_rev', '?')[:9]}, {budget:,} tokens{paced})\n")
    print(results_table(rows) + "\n\n" + targets_table(targets(rows, budget)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        return summarize(args.summarize)
    runs_plan = plan(args)
    if not runs_plan:
        raise SystemExit("nothing to run: the extras (int4, slow) run only at --extras-at")
    prov = cb.start_provenance(args.allow_dirty or args.quick, "quality_scale")
    suffix = "-quick" if args.quick else ""
    runs = args.runs_dir or ROOT / "runs" / time.strftime(f"quality_scale{suffix}-%Y%m%d-%H%M%S")
    runs.mkdir(parents=True, exist_ok=True)
    taken = [f"{m}-{s}-{x}" for m, s, x in runs_plan if (runs / f"M{m}-seed{s}-{x}").exists()]
    if taken:
        raise SystemExit(f"{runs} already holds run folders {taken}; choose another --runs-dir")
    configs = {}
    for m in args.learners:
        for seed in args.seeds:
            cfg = cb.base_run_config(m, args.inner_steps, args.batch_size,
                                     data_bytes=600_000 if args.quick else 4_000_000,
                                     eval_windows=32 if args.quick else 256, eval_interval_s=args.eval_interval,
                                     run_id=f"quality-scale-m{m}-s{seed}")
            cfg.seed = seed
            cfg.data.seed = 1234 + seed
            path = runs / f"config-M{m}-seed{seed}.json"
            path.write_text(cfg.to_json())
            configs[(m, seed)] = (cfg, path)
    print(f"quality_scale: {len(runs_plan)} runs of {args.tokens:,} tokens; runs in {runs}", file=sys.stderr)
    rows = []
    warm: dict[int, dict] = {}  # seed -> its warm start, shared by every M and method
    t_start = time.monotonic()
    for m, seed, method in runs_plan:
        cfg_path, budget = configs[(m, seed)][1], args.tokens
        if args.warm_start_steps:
            if seed not in warm:
                print(f"[{time.monotonic() - t_start:7.0f}s] seed {seed} warm start ...", file=sys.stderr, flush=True)
                warm[seed] = run_warm_start(configs[(m, seed)][0], args.warm_start_steps, args.tokens,
                                            runs / f"warm-start-seed{seed}", cfg_path, args.device, args.step_seconds)
            cfg_path = runs / f"config-M{m}-seed{seed}-warm.json"
            cfg_path.write_text(dataclasses.replace(configs[(m, seed)][0], init_from=warm[seed]["folder"]).to_json())
            budget = args.tokens - warm[seed]["tokens"]
        print(f"[{time.monotonic() - t_start:7.0f}s] M={m} seed {seed} {method} ...", file=sys.stderr, flush=True)
        row = run_one(method, m, seed, budget, cfg_path, runs / f"M{m}-seed{seed}-{method}", args.device,
                      args.step_seconds)
        if args.warm_start_steps:
            row = with_warm_start(row, warm[seed])
        rows.append(row)
        print(f"          final eval loss {row['final_eval_loss']:.4f}, {row['tokens']:,} tokens, "
              f"{row['extra']['elapsed_seconds']:.0f}s", file=sys.stderr, flush=True)
    checks = targets(rows, args.tokens)
    prov = cb.finish_provenance(prov)
    import torch

    first_cfg = next(iter(configs.values()))[0]
    doc = {
        "config": {
            "command": "python bench/quality_scale.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "quick": args.quick, "learners": args.learners, "seeds": args.seeds, "tokens": args.tokens,
            "methods": [x for x in METHODS if x in args.method_list], "extras_at": args.extras_at,
            "model": "tiny", "inner_steps": args.inner_steps, "batch_size": args.batch_size,
            "eval_interval_s": args.eval_interval, "slow": {"learner": "M-1", "factor": SLOW_FACTOR},
            "warm_start_steps": args.warm_start_steps,
            "warm_starts": {str(s): {k: w[k] for k in ("steps", "tokens", "seconds", "final_eval_loss")} for s, w in warm.items()},
            "seed_meaning": "RunConfig.seed = seed (initial model), DataConfig.seed = 1234 + seed (shard reading order)",
            "method_flags": {x: method_flags(x, "M") for x in METHODS},  # type: ignore[arg-type]
            "run_config_example": json.loads(first_cfg.to_json()),
            "limits": LIMITS,
            "git_rev": prov["git_rev"], "dirty": prov["dirty"], "dirty_files": prov["dirty_files"],
            "diff_sha256": prov["diff_sha256"], "load_average_start": prov["load_average_start"],
            "load_average_end": prov["load_average_end"], "load_ok": prov["load_ok"],
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "device": args.device, "step_seconds": args.step_seconds, "total_seconds": round(time.monotonic() - t_start, 1), "runs_dir": str(runs),
        },
        "rows": rows,
        "targets": checks,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"quality_scale{suffix}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    png_path = args.results_dir / f"quality_scale{suffix}.png"
    plotted = plot(rows, png_path)
    print(results_table(rows))
    print()
    print(targets_table(checks))
    print(f"\n{json_path}" + (f"\n{png_path}" if plotted else "") + f"\nrun folders: {runs}  ({doc['config']['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
