"""Quality benchmark: Decoupled DiLoCo against its baselines at equal tokens, in one invocation.

Methods (M = 4 learners or ranks; every DiLoCo row uses the same H):

    dp                 synchronous data-parallel, gradients all-reduced every step (gloo), global batch 4B
    diloco-sync        synchronous DiLoCo: ddiloco run --sync --quorum 4 --fragments 1
    single             one learner with the per-learner batch B (dp with world size 1)
    ddiloco-int8       Decoupled DiLoCo, int8 pseudo-gradients, the run defaults otherwise
    ddiloco-int4       the same with int4
    ddiloco-int8-slow  ddiloco-int8 with learner 3 three times slower (ddiloco run --slow 3:3)

Each method runs at two token budgets, N and 4N (total tokens across learners), one run
after the other. Output: a markdown table on stdout, ``<results>/quality[-quick|-gpu].json``
and a PNG of eval loss against tokens. Run from the repository root:

    python bench/quality.py              # CPU, ~6 minutes on 2 cores (see docs/quality.md)
    python bench/quality.py --quick      # smoke test of all six methods, ~3-5 minutes
    python bench/quality.py --device cuda

Every number comes from the runs' own ``report.json`` and ``metrics.jsonl``. Like every
bench it refuses uncommitted changes in services/ or bench/ (``--allow-dirty`` marks the
result instead) and records the load average at start and end (``provenance``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import shlex
import sys
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # runs from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.common.config import ModelConfig, RunConfig  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import common_bench as cb  # noqa: E402

METHODS = ["dp", "diloco-sync", "single", "ddiloco-int8", "ddiloco-int4", "ddiloco-int8-slow"]
# ddiloco-int8-slow runs right after ddiloco-int8, which its tokens/s are divided by, so that
# the two see as similar a machine as one after the other can
RUN_ORDER = ["dp", "diloco-sync", "single", "ddiloco-int8", "ddiloco-int8-slow", "ddiloco-int4"]
M = 4
SLOW_LEARNER, SLOW_FACTOR = 3, 3.0


@dataclass(frozen=True)
class Preset:
    """One benchmark size. ``budget_tokens`` is N; the second budget is 4N."""

    name: str
    model: ModelConfig
    batch_size: int
    inner_steps: int  # H, the same for every DiLoCo row
    budget_tokens: int
    data_bytes: int
    eval_windows: int
    eval_interval_s: float


# Why these sizes (docs/quality.md has the measurements): on 2 CPU cores the `tiny` model
# (2 layers, width 64, context 64, 0.12M parameters) trains at ~20k tokens/s summed over 4
# processes, so 6 methods x (N + 4N) = 30N tokens plus ~25 s of process start-up per run
# fit in under 30 minutes with N = 665,600 = 13 synchronous rounds of 4 learners x H = 25
# steps x 512 tokens (52 rounds at 4N). The 4 MB corpus holds ~3.8M training bytes, so
# even `single` at 4N (2.7M tokens) sees every byte at most once.
PRESETS = {
    "cpu": Preset("cpu", ModelConfig(n_layer=2, n_head=2, d_model=64, context=64), batch_size=8, inner_steps=25,
                  budget_tokens=665_600, data_bytes=4_000_000, eval_windows=256, eval_interval_s=3.0),
    "quick": Preset("quick", ModelConfig(n_layer=2, n_head=2, d_model=64, context=64), batch_size=4, inner_steps=5,
                    budget_tokens=20_480, data_bytes=600_000, eval_windows=32, eval_interval_s=1.0),
    # The reference setting of docs/quality.md (4 layers, width 256, context 256, H = 50):
    # 500 inner steps per learner at N, 2,000 at 4N. Not run here (no GPU on the machine
    # that produced the committed results).
    "gpu": Preset("gpu", ModelConfig(n_layer=4, n_head=4, d_model=256, context=256), batch_size=8, inner_steps=50,
                  budget_tokens=4_096_000, data_bytes=40_000_000, eval_windows=256, eval_interval_s=5.0),
}


# ----------------------------------------------------------------------------- configuration
def run_config(preset: Preset) -> RunConfig:
    """The RunConfig every method starts from: the code's defaults plus the preset's size."""
    cfg = RunConfig()
    cfg.run_id = f"quality-{preset.name}"
    cfg.learners = M
    cfg.model = dataclasses.replace(preset.model)
    cfg.learner.batch_size = preset.batch_size
    cfg.learner.inner_steps = preset.inner_steps
    cfg.data.max_bytes = preset.data_bytes
    cfg.data.eval_windows = preset.eval_windows
    cfg.outer.eval_interval_s = preset.eval_interval_s
    cfg.max_seconds = 4 * 3600.0  # the token budget ends every run; this only stops a wedged one
    # learners report tokens in heartbeats, and a ddiloco run stops once the reported total
    # reaches the budget: a short interval keeps the overshoot past the budget small
    cfg.heartbeat_interval_s = 0.25
    return cfg


def method_flags(method: str, learners: int = M) -> list[str]:
    """``learners``: the run's M (synchronous DiLoCo's quorum is every learner; a quorum
    above M is refused)."""
    return {
        "diloco-sync": ["--sync", "--quorum", str(learners), "--fragments", "1", "--codec", "fp32"],
        "ddiloco-int8": ["--codec", "int8"],
        "ddiloco-int4": ["--codec", "int4"],
        "ddiloco-int8-slow": ["--codec", "int8"],
    }.get(method, [])


# ----------------------------------------------------------------------------- running
def run_method(method: str, budget: int, cfg_path: pathlib.Path, run_dir: pathlib.Path, device: str) -> dict:
    """Run one method to its token budget; return its report (raises on failure)."""
    flags = ["--config", str(cfg_path), "--max-tokens", str(budget)]
    if method in ("dp", "single"):
        from ddiloco.baselines.launch import launch_dp

        return launch_dp(run_dir, M if method == "dp" else 1, flags, extra_flags=["--device", device])
    from ddiloco.launcher.run import LaunchOptions, launch

    result = launch(
        LaunchOptions(
            out=run_dir,
            run_flags=flags + method_flags(method),
            learners=M,
            device=device,
            slowdown={SLOW_LEARNER: SLOW_FACTOR} if method == "ddiloco-int8-slow" else {},
            progress=False,
            monitoring=False,
        )
    )
    if not result.ok:
        raise RuntimeError(f"{method} failed: {result.failures or 'no report'}; see {run_dir}/logs")
    return result.report


# ----------------------------------------------------------------------------- reading runs
def read_events(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_curve(events: list[dict]) -> list[tuple[int, float]]:
    """(tokens, eval loss) of every evaluation. dp/single eval events carry tokens; ddiloco
    eval events carry the global version, mapped to tokens by the merge that made it."""
    tokens_at = {0: 0}
    for e in events:
        if e["event"] == "merge":
            tokens_at[e["version"]] = max(tokens_at.get(e["version"], 0), e["tokens_merged"])
    points = []
    for e in events:
        if e["event"] != "eval":
            continue
        tokens = e.get("tokens", tokens_at.get(e["version"]))
        if tokens is not None:
            points.append((int(tokens), float(e["eval_loss"])))
    return sorted(set(points))


def learner_rates(report: dict, events: list[dict]) -> dict[int, dict]:
    """Per learner: tokens per wall second and per compute second, and whether it was slowed."""
    slowed = {e["learner"] for e in events if e["event"] == "learner_start" and e.get("slowdown", 1.0) > 1.0}
    out = {}
    for lr in report.get("learners", []):
        wall, compute = lr.get("wall_seconds") or 0.0, lr.get("compute_seconds") or 0.0
        out[lr["learner_id"]] = {
            "tokens": lr["tokens"],
            "tokens_per_s": lr["tokens"] / wall if wall > 0 else None,
            "tokens_per_compute_s": lr["tokens"] / compute if compute > 0 else None,
            # share of its training span spent computing: 1 means it never waited for anyone
            "busy_fraction": round(compute / wall, 4) if wall > 0 else None,
            "slow": lr["learner_id"] in slowed,
        }
    return out


def merge_stats(events: list[dict]) -> dict:
    merges = [e for e in events if e["event"] == "merge"]
    if not merges:
        return {"merges": 0}
    sizes = [len(e["deltas"]) for e in merges]
    drain_t = next((e["t"] for e in events if e["event"] == "draining"), math.inf)
    return {"merges": len(merges), "deltas_per_merge_mean": round(sum(sizes) / len(sizes), 3),
            "deltas_per_merge_min": min(sizes), "deltas_per_merge_max": max(sizes),
            # synchronous DiLoCo merges every learner's window each round; before the drain,
            # a merge of fewer than M distinct learners means the barrier did not hold
            "merges_before_drain_short_of_m": sum(
                1 for e in merges if e["t"] < drain_t and len({lid for lid, _ in e["deltas"]}) < M)}


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def make_row(method: str, budget_name: str, budget: int, report: dict, events: list[dict], elapsed: float) -> dict:
    """One table row from a run's report and events (the same keys for every method)."""
    is_dp = method in ("dp", "single")
    if is_dp:
        bytes_exchanged, bytes_total = report["bytes_exchanged"], report["bytes_total"]
        compute = report["compute_seconds"]
    else:
        n = max(1, len(report["learners"]))
        bytes_total = report["bytes_uploaded"] + report["bytes_downloaded"]
        bytes_exchanged = bytes_total // n  # per learner, uploaded + downloaded
        compute = round(sum(lr.get("compute_seconds", 0.0) for lr in report["learners"]), 3)
    final = report["final_eval_loss"]
    row = {
        "method": method,
        "budget": budget_name,
        "budget_tokens": budget,
        "final_eval_loss": final,
        "final_eval_accuracy": report["final_eval_accuracy"],
        "initial_eval_loss": report["initial_eval_loss"],
        "tokens": report["tokens_trained"],
        "bytes_exchanged": int(bytes_exchanged),
        "bytes_total": int(bytes_total),
        "wall_seconds": report["wall_seconds"],
        "compute_seconds": compute,
        "elapsed_seconds": round(elapsed, 1),  # including process start-up and shutdown
        "diverged": not (isinstance(final, float) and math.isfinite(final) and final < report["initial_eval_loss"]),
    }
    if is_dp:
        row["optimizer_steps"] = report["optimizer_steps"]
        row["bytes_source"] = report["bytes_exchanged_source"]
    else:
        row["outer_steps"] = report.get("outer_steps")
        row["tokens_merged"] = report.get("tokens_merged")
        row["bytes_source"] = "learner upload/download counters"
        row.update(merge_stats(events))
        rates = learner_rates(report, events)
        row["learners"] = {str(k): v for k, v in sorted(rates.items())}
    return row


def add_comparisons(rows: list[dict]) -> None:
    """Relative gaps that need two rows of the same budget (done once all rows exist)."""
    by = {(r["method"], r["budget"]): r for r in rows}
    for r in rows:
        dp = by.get(("dp", r["budget"]))
        if dp is not None and r is not dp:
            r["loss_vs_dp"] = round(r["final_eval_loss"] / dp["final_eval_loss"] - 1, 5)
        if r["method"] != "ddiloco-int8-slow":
            continue
        base = by.get(("ddiloco-int8", r["budget"]))
        r["fast_learner_tokens_per_s_ratio"] = None
        r["fast_learner_tokens_per_compute_s_ratio"] = None
        fast = [k for k, v in r["learners"].items() if not v["slow"]]
        busy = _mean([r["learners"][k].get("busy_fraction") for k in fast])
        r["fast_learner_busy_fraction"] = None if busy is None else round(busy, 4)
        if base is None:
            continue
        for key, field in (("tokens_per_s", "fast_learner_tokens_per_s_ratio"),
                           ("tokens_per_compute_s", "fast_learner_tokens_per_compute_s_ratio")):
            mine = _mean([r["learners"][k][key] for k in fast])
            theirs = _mean([base["learners"][k][key] for k in fast if k in base["learners"]])
            if mine is not None and theirs:
                r[field] = round(mine / theirs, 4)
        slow_tokens = sum(v["tokens"] for v in r["learners"].values() if v["slow"])
        r["slow_learner_token_share"] = round(slow_tokens / max(1, r["tokens"]), 4)


def targets(rows: list[dict], budget: str = "4N") -> list[dict]:
    """The issue's targets, evaluated at the larger budget. "Within x%" is read one-sided:
    at most x% higher loss (doing better is never a miss)."""
    by = {(r["method"], r["budget"]): r for r in rows}

    def loss(method: str, b: str = budget) -> float | None:
        r = by.get((method, b))
        return r["final_eval_loss"] if r else None

    def rel(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b - 1, 5)

    out = []

    def add(name: str, value: float | None, limit: float, higher_is_ok: bool = False) -> None:
        met = None if value is None else (value >= limit if higher_is_ok else value <= limit)
        out.append({"target": name, "value": value, "limit": limit, "met": met})

    add("ddiloco-int8 vs diloco-sync (relative loss)", rel(loss("ddiloco-int8"), loss("diloco-sync")), 0.02)
    add("ddiloco-int4 vs ddiloco-int8 (relative loss)", rel(loss("ddiloco-int4"), loss("ddiloco-int8")), 0.005)
    add("ddiloco-int8-slow vs ddiloco-int8 (relative loss)", rel(loss("ddiloco-int8-slow"), loss("ddiloco-int8")), 0.03)
    slow = by.get(("ddiloco-int8-slow", budget))
    add("fast_learner_tokens_per_s_ratio", slow.get("fast_learner_tokens_per_s_ratio") if slow else None, 0.95, True)
    gap_n, gap_4n = rel(loss("ddiloco-int8", "N"), loss("dp", "N")), rel(loss("ddiloco-int8"), loss("dp"))
    add("ddiloco-int8 vs dp at 4N (relative loss)", gap_4n, 0.05)
    add("gap to dp shrinks from N to 4N (gap 4N - gap N)",
        None if gap_n is None or gap_4n is None else round(gap_4n - gap_n, 5), 0.0)
    # not one of the targets: the same question ("do fast learners wait?") asked
    # within one run, so it does not depend on how busy the shared machine was in another
    out.append({"target": "(extra) fast learners' busy fraction in ddiloco-int8-slow",
                "value": slow.get("fast_learner_busy_fraction") if slow else None, "limit": 0.95,
                "met": None if not slow or slow.get("fast_learner_busy_fraction") is None
                else slow["fast_learner_busy_fraction"] >= 0.95})
    ddl = [r for r in rows if r["method"].startswith("ddiloco")]
    out.append({"target": "no ddiloco run diverged", "value": sum(r["diverged"] for r in ddl), "limit": 0,
                "met": (not any(r["diverged"] for r in ddl)) if ddl else None})
    return out


# ----------------------------------------------------------------------------- output
def markdown_table(rows: list[dict]) -> str:
    head = ("| method | budget | tokens | final eval loss | vs dp | accuracy | bytes / participant | wall s | "
            "fast tok/s ratio |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['loss_vs_dp']:+.2%}" if "loss_vs_dp" in r else "-"
        ratio = r.get("fast_learner_tokens_per_s_ratio")
        lines.append(
            f"| {r['method']} | {r['budget']} | {r['tokens']:,} | {r['final_eval_loss']:.4f} | {vs} | "
            f"{r['final_eval_accuracy']:.2%} | {_mb(r['bytes_exchanged'])} | {r['wall_seconds']:.0f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def targets_table(items: list[dict]) -> str:
    lines = ["| target (at 4N) | value | limit | met |", "|---|---:|---:|---|"]
    for t in items:
        v = t["value"]
        plain = "ratio" in t["target"] or "fraction" in t["target"]
        shown = "-" if v is None else (f"{v:+.2%}" if isinstance(v, float) and not plain else str(v))
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {shown} | {t['limit']} | {met} |")
    return "\n".join(lines)


def _mb(b: int) -> str:
    return f"{b / 1e6:.1f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def plot(curves: dict[str, list], rows: list[dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", file=sys.stderr)
        return False
    budgets = sorted({r["budget"] for r in rows}, key=lambda b: b != "N")
    fig, axes = plt.subplots(1, len(budgets), figsize=(6.5 * len(budgets), 4.8), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for method in METHODS:
            pts = curves.get(f"{method}/{budget}")
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=method, lw=1.4, ls="--" if method in ("dp", "single") else "-")
        finals = [r["final_eval_loss"] for r in rows if r["budget"] == budget]
        if finals:
            ax.set_ylim(min(finals) * 0.97, min(finals) * 1.6)
        ax.set_title(f"budget {budget}")
        ax.set_xlabel("tokens (all learners)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run of the same code paths (CI); minutes, dominated by process start-up")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the larger GPU preset")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--budget", type=int, default=0, help="N in tokens (default: the preset's); 4N is also run")
    p.add_argument("--one-budget", action="store_true", help="run budget N only (for calibration; the targets need both)")
    p.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    p.add_argument("--runs-dir", type=pathlib.Path, default=None, help="run folders (default: runs/quality-<time>)")
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    if args.quick and args.device == "cuda":
        p.error("--quick is the CPU smoke test; use --device cuda without --quick")
    if args.budget < 0:
        p.error("--budget must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS["quick" if args.quick else ("gpu" if args.device == "cuda" else "cpu")]
    if args.budget:
        preset = dataclasses.replace(preset, budget_tokens=args.budget)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    suffix = {"quick": "-quick", "gpu": "-gpu", "cpu": ""}[preset.name]
    runs = args.runs_dir or ROOT / "runs" / time.strftime(f"quality{suffix}-%Y%m%d-%H%M%S")
    runs.mkdir(parents=True, exist_ok=True)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_config(preset)
    cfg_path = runs / "config.json"
    cfg_path.write_text(cfg.to_json())
    budgets = [("N", preset.budget_tokens), ("4N", 4 * preset.budget_tokens)][: 1 if args.one_budget else 2]
    order = [m for m in RUN_ORDER if m in args.method_list]
    taken = [d.name for b, _ in budgets for m in order if (d := runs / f"{m}-{b}").exists()]
    if taken:
        raise SystemExit(f"{runs} already holds run folders {taken}; choose another --runs-dir")
    # at the start: the code that runs is the code of this moment (refuses a dirty tree)
    prov = cb.start_provenance(args.allow_dirty or args.quick, "quality")
    rows, curves = [], {}
    t_start = time.monotonic()
    for budget_name, budget in budgets:
        for method in order:
            run_dir = runs / f"{method}-{budget_name}"
            t0 = time.monotonic()
            print(f"[{time.monotonic() - t_start:7.0f}s] {method} at {budget_name} = {budget:,} tokens ...",
                  file=sys.stderr, flush=True)
            report = run_method(method, budget, cfg_path, run_dir, args.device)
            events = read_events(run_dir)
            row = make_row(method, budget_name, budget, report, events, time.monotonic() - t0)
            row["run_dir"] = str(run_dir)
            if method == "diloco-sync" and row.get("merges_before_drain_short_of_m"):
                print(f"          WARNING: {row['merges_before_drain_short_of_m']} merges before the drain held fewer "
                      f"than {M} learners: not synchronous DiLoCo (see docs/quality.md)", file=sys.stderr)
            rows.append(row)
            curves[f"{method}/{budget_name}"] = eval_curve(events)
            print(f"          final eval loss {row['final_eval_loss']:.4f}, {row['tokens']:,} tokens, "
                  f"{row['elapsed_seconds']:.0f}s", file=sys.stderr, flush=True)
    add_comparisons(rows)
    checks = targets(rows)
    result = {
        "config": {
            "command": "python bench/quality.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "preset": preset.name,
            "device": args.device,
            "learners": M,
            "inner_steps": preset.inner_steps,
            "budgets": {name: tokens for name, tokens in budgets},
            "slow": {"learner": SLOW_LEARNER, "factor": SLOW_FACTOR},
            "method_flags": {m: method_flags(m) for m in order},
            "run_config": json.loads(cfg.to_json()),
            "git_rev": prov["git_rev"],
            "dirty": prov["dirty"],
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
            "cpus": __import__("os").cpu_count(),
            "total_seconds": round(time.monotonic() - t_start, 1),
            "bytes_exchanged": "per participant (rank or learner): bytes sent + received, mean over participants",
        },
        "provenance": cb.finish_provenance(prov),
        "rows": rows,
        "targets": checks,
        "curves": {k: [[t, round(loss, 5)] for t, loss in v] for k, v in curves.items()},
    }
    json_path = args.results_dir / f"quality{suffix}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.results_dir / f"quality{suffix}.png"
    plotted = plot(curves, rows, png_path)
    print(markdown_table(rows))
    print()
    print(targets_table(checks))
    print(f"\n{json_path}" + (f"\n{png_path}" if plotted else "") + f"\nrun folders: {runs}  ({result['config']['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
