"""Chaos benchmark: what faults cost Decoupled DiLoCo, synchronous DiLoCo and data-parallel
training, under one fault schedule and one time budget, in one invocation.

Rows (M learners or ranks, budget T seconds, the same model, data and batch everywhere):

    ddiloco       Decoupled DiLoCo, no faults
    ddiloco       Decoupled DiLoCo under the schedule
    diloco-sync   synchronous DiLoCo (ddiloco run --sync --quorum M) under the schedule
    dp            data-parallel (gloo all-reduce every step) under the schedule: MODELLED,
                  see below
    dp            data-parallel, no faults (the measured run the model starts from)

The schedule (full run): a learner killed (SIGKILL) every 60 s and started again 20 s later,
and the outer optimizer killed once (at T/2) and started again 5 s later. The ddiloco and
diloco-sync rows are real runs with those faults injected by ``ddiloco.chaos``; goodput,
waste, ``acked_deltas_lost`` and ``deltas_applied_twice`` come from the runs' own event logs
(``ddiloco.chaos.goodput`` and ``ddiloco.chaos.audit``).

DP is modelled, not run under faults: the data-parallel baseline has no checkpoint/restart,
and a synchronous job that loses a rank stops as a whole. The model is the standard one, with
assumptions that favour DP: a checkpoint every ``--dp-checkpoint-s`` seconds that costs
nothing; each learner kill stops all M ranks, loses on average half a checkpoint interval of
progress, and the job resumes once the killed rank is back (the same 20 s) plus DP's own
measured start-up; the outer-optimizer kill does not apply (DP has none). Its goodput is
``compute share x productive time / T`` and its final loss is the fault-free DP run's loss
at the step the productive time reaches (interpolated between its evaluations).

    python bench/chaos.py            # full: M=8, T=300 s, tiny model; ~30 minutes on 2 cores
    python bench/chaos.py --quick    # smoke test: M=2, T=30 s, faults every 10 s; ~4 minutes

Writes ``bench/results/chaos.json`` (``chaos-quick.json`` with --quick) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # runs from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.chaos.audit import audit_run  # noqa: E402
from ddiloco.chaos.faults import Fault, Schedule, periodic  # noqa: E402
from ddiloco.common.config import MODEL_PRESETS  # noqa: E402
from ddiloco.common.metrics import read_events  # noqa: E402

TARGETS = {"goodput": 0.88, "loss_gap": 0.02}


@dataclass
class Settings:
    learners: int
    seconds: float
    kill_every: float
    restart_after: float
    outer_kill_at: float
    outer_restart_after: float
    model: str
    inner_steps: int
    batch_size: int
    dp_checkpoint_s: float
    device: str

    def run_flags(self) -> list[str]:
        return [
            "--model", self.model, "--inner-steps", str(self.inner_steps), "--batch-size", str(self.batch_size),
            "--learners", str(self.learners), "--max-seconds", str(self.seconds),
        ]

    def schedule(self) -> Schedule:
        faults = periodic("kill", "learner", self.kill_every, self.restart_after, self.seconds)
        faults.append(Fault(self.outer_kill_at, "kill", "outer", self.outer_restart_after))
        return Schedule(faults, seed=0)

    def describe_faults(self) -> str:
        n = len(periodic("kill", "learner", self.kill_every, self.restart_after, self.seconds))
        return (
            f"learner SIGKILL every {self.kill_every:g}s, restarted {self.restart_after:g}s later (x{n}); "
            f"outer SIGKILL at {self.outer_kill_at:g}s, restarted {self.outer_restart_after:g}s later (x1)"
        )


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "services", "bench"], cwd=ROOT, capture_output=True, text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------- ddiloco
def run_ddiloco(s: Settings, out: pathlib.Path, sync: bool, chaos: bool) -> dict:
    from ddiloco.chaos.run import run_with_chaos
    from ddiloco.launcher.run import LaunchOptions

    flags = s.run_flags() + (["--sync", "--quorum", str(s.learners)] if sync else [])
    schedule = s.schedule() if chaos else Schedule([])
    t0 = time.monotonic()
    result = run_with_chaos(
        LaunchOptions(out=out, run_flags=flags, learners=s.learners, device=s.device, progress=False,
                      timeout_s=s.seconds * 4 + 600),
        schedule,
    )
    if result.report is None:
        raise RuntimeError(f"run in {out} produced no report; failures {result.failures}; see {out}/logs")
    report = result.report
    audit = audit_run(out).summary()
    events = read_events(out / "metrics.jsonl")
    evals = [e for e in events if e["event"] == "eval"]
    injected = [e for e in events if e["event"] == "fault" and e["phase"] == "inject"]
    return {
        "method": "diloco-sync" if sync else "ddiloco",
        "faults": s.describe_faults() if chaos else "none",
        "goodput": report.get("goodput"),
        "final_eval_loss": round(report["final_eval_loss"], 4),
        "acked_deltas_lost": audit["acked_deltas_lost"],
        "deltas_applied_twice": audit["deltas_applied_twice"],
        "waste": report.get("waste"),
        "initial_eval_loss": round(evals[0]["eval_loss"], 4) if evals else None,
        "tokens_trained": report["tokens_trained"],
        "tokens_merged": report.get("tokens_merged"),
        "outer_steps": report["outer_steps"],
        "versions_monotonic": audit["versions_monotonic"],
        "faults_injected": len(injected),
        "resume": resume_stats(events, s.inner_steps, s.batch_size * MODEL_PRESETS[s.model].context),
        "loss_curve": loss_curve(events),
        "fault_errors": result.fault_errors,
        "failures": result.failures,
        "notes": result.notes,
        "modelled": False,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "run_dir": str(out),
    }


def loss_curve(events: list[dict]) -> list[tuple[int, float]]:
    """(tokens merged into the evaluated version, eval loss), in order."""
    tokens_at = {0: 0}
    for e in events:
        if e["event"] == "merge" and "tokens_merged" in e:
            tokens_at[e["version"]] = e["tokens_merged"]
    out = []
    for e in events:
        if e["event"] == "eval":
            known = [v for v in tokens_at if v <= e["version"]]
            out.append((tokens_at[max(known)], e["eval_loss"]))
    return out


def loss_at_tokens(curve: list[tuple[int, float]], tokens: float) -> float:
    """Eval loss at ``tokens`` merged, interpolated; the mean of the evaluations around it
    (within 5% of the tokens) damps the eval set's noise."""
    near = [l for t, l in curve if abs(t - tokens) <= 0.05 * tokens]
    if near:
        return sum(near) / len(near)
    return loss_at_step(curve, tokens)


def resume_stats(events: list[dict], inner_steps: int, tokens_per_step: int) -> dict:
    """Per learner restart: steps the dead incarnation trained whose deltas were neither
    acknowledged nor refused, which the new incarnation trains again (it resumes where the
    acknowledged work ended); steps of refused deltas, read again too; steps skipped (must be 0)."""
    trained: dict[int, int] = {}
    refused: dict[int, int] = {}
    last_start: dict[int, dict] = {}
    retrained, reread, skipped = [], 0, []
    for e in events:
        lid = e.get("learner")
        if e["event"] == "learner_start":
            if lid in last_start:
                advanced = e["batch_index"] - last_start[lid]["batch_index"]
                lost = trained.get(lid, 0) - refused.get(lid, 0) - advanced
                retrained.append(max(0, lost))
                skipped.append(max(0, -lost))
                reread += refused.get(lid, 0)
            last_start[lid] = e
            trained[lid] = refused[lid] = 0
        elif e["event"] == "window" and lid in trained:
            trained[lid] += e["steps"]
        elif e["event"] == "upload_refused" and lid in refused:
            refused[lid] += e.get("tokens", 0) // tokens_per_step
    return {
        "restarts": len(retrained),
        "retrained_windows_max": round(max(retrained, default=0) / inner_steps, 2),
        "retrained_windows_mean": round(sum(retrained) / len(retrained) / inner_steps, 2) if retrained else 0.0,
        "refused_windows_read_again": round(reread / inner_steps, 2),
        "skipped_steps": sum(skipped),
    }


# ---------------------------------------------------------------------------------- dp
def run_dp_fault_free(s: Settings, out: pathlib.Path) -> tuple[dict, dict]:
    from ddiloco.baselines.launch import launch_dp

    t_launch = time.time()
    report = launch_dp(out, s.learners, s.run_flags(), extra_flags=["--device", s.device], timeout_s=s.seconds * 4 + 600)
    events = read_events(out / "metrics.jsonl")
    starts = [e["t"] for e in events if e["event"] == "dp_start"]
    # start-up: launch to the moment the last rank is ready to train
    startup = (max(starts) - t_launch) if starts else 0.0
    evals = [(e["version"], e["eval_loss"]) for e in events if e["event"] == "eval"]
    provisioned = s.learners * (report["wall_seconds"] + startup)
    measured = {
        "startup_s": round(startup, 2),
        "steps": report["optimizer_steps"],
        "wall_s": report["wall_seconds"],
        "compute_share": report["compute_seconds"] / (s.learners * report["wall_seconds"]),
        "evals": evals,
    }
    row = {
        "method": "dp",
        "faults": "none",
        "goodput": round(report["compute_seconds"] / provisioned, 4),
        "final_eval_loss": round(report["final_eval_loss"], 4),
        "acked_deltas_lost": None,
        "deltas_applied_twice": None,
        "waste": None,
        "initial_eval_loss": round(report["initial_eval_loss"], 4),
        "tokens_trained": report["tokens_trained"],
        "modelled": False,
        "run_dir": str(out),
    }
    return row, measured


def loss_at_step(evals: list[tuple[int, float]], step: float) -> float:
    evals = sorted(evals)
    if step <= evals[0][0]:
        return evals[0][1]
    for (s0, l0), (s1, l1) in zip(evals, evals[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / max(s1 - s0, 1)
    return evals[-1][1]


def model_dp_under_faults(s: Settings, measured: dict) -> dict:
    """DP under the learner-kill schedule, from its measured fault-free run (see module doc)."""
    kills = [f.at_s for f in s.schedule().faults if f.target == "learner"]
    budget = s.seconds + measured["startup_s"]  # the same span ddiloco's slots are provisioned
    productive = s.seconds  # training seconds of the fault-free run
    for _ in kills:
        productive -= s.dp_checkpoint_s / 2 + s.restart_after + measured["startup_s"]
    productive = max(0.0, productive)
    steps_per_s = measured["steps"] / measured["wall_s"]
    step = steps_per_s * productive
    return {
        "method": "dp",
        "faults": f"{s.describe_faults()} (modelled; outer kill n/a)",
        "goodput": round(measured["compute_share"] * productive / budget, 4),
        "final_eval_loss": round(loss_at_step(measured["evals"], step), 4),
        "acked_deltas_lost": None,
        "deltas_applied_twice": None,
        "waste": None,
        "modelled": True,
        "model": {
            "checkpoint_every_s": s.dp_checkpoint_s,
            "lost_per_kill_s": s.dp_checkpoint_s / 2,
            "down_per_kill_s": s.restart_after + measured["startup_s"],
            "kills": len(kills),
            "productive_s": round(productive, 2),
            "steps": round(step),
            "compute_share": round(measured["compute_share"], 4),
        },
    }


# ---------------------------------------------------------------------------------- main
def fmt(x, spec=".3f") -> str:
    if x is None:
        return "n/a"
    return format(x, spec) if isinstance(x, float) else str(x)


def print_table(rows: list[dict]) -> None:
    print("\n| method | faults | goodput | final eval loss | acked deltas lost | deltas applied twice |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        faults = "none" if r["faults"] == "none" else ("schedule, modelled" if r.get("modelled") else "schedule")
        print(
            f"| {r['method']} | {faults} | {fmt(r['goodput'])} | {fmt(r['final_eval_loss'], '.4f')} | "
            f"{fmt(r['acked_deltas_lost'])} | {fmt(r['deltas_applied_twice'])} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 learners, 30 s, faults every 10 s")
    ap.add_argument("--learners", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--dp-checkpoint-s", type=float, default=30.0, help="DP model: seconds between its (free) checkpoints")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="run folders (default: /tmp/ddiloco-bench-chaos-<time>)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        s = Settings(learners=2, seconds=30, kill_every=10, restart_after=3, outer_kill_at=15, outer_restart_after=2,
                     model="tiny", inner_steps=5, batch_size=4, dp_checkpoint_s=4, device=args.device)
    else:
        s = Settings(learners=8, seconds=300, kill_every=60, restart_after=20, outer_kill_at=150, outer_restart_after=5,
                     model="tiny", inner_steps=20, batch_size=8, dp_checkpoint_s=args.dp_checkpoint_s, device=args.device)
    if args.learners:
        s.learners = args.learners
    if args.seconds:
        s.seconds = args.seconds
        s.outer_kill_at = s.seconds / 2
    out = args.out or pathlib.Path(f"/tmp/ddiloco-bench-chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos bench: M={s.learners}, T={s.seconds:g}s, model {s.model}; faults: {s.describe_faults()}", file=sys.stderr)

    rows = []
    for name, sync, chaos in (("ddiloco-clean", False, False), ("ddiloco-chaos", False, True), ("sync-chaos", True, True)):
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_ddiloco(s, out / name, sync=sync, chaos=chaos))
    print(f"[{time.strftime('%H:%M:%S')}] dp (fault-free, measured) ...", file=sys.stderr, flush=True)
    dp_clean, measured = run_dp_fault_free(s, out / "dp-clean")
    rows.append(model_dp_under_faults(s, measured))
    rows.append(dp_clean)

    clean, chaos_row = rows[0], rows[1]
    gap = chaos_row["final_eval_loss"] / clean["final_eval_loss"] - 1
    # the same comparison at equal work merged: on a shared machine the time budget buys
    # different amounts of compute from run to run
    equal = min(clean["tokens_merged"], chaos_row["tokens_merged"])
    gap_tokens = loss_at_tokens(chaos_row["loss_curve"], equal) / loss_at_tokens(clean["loss_curve"], equal) - 1
    checks = {
        "ddiloco_goodput_under_chaos": chaos_row["goodput"],
        "goodput_target": TARGETS["goodput"],
        "goodput_met": chaos_row["goodput"] is not None and chaos_row["goodput"] >= TARGETS["goodput"],
        "loss_gap_vs_fault_free": round(gap, 4),
        "loss_gap_target": TARGETS["loss_gap"],
        "loss_gap_met": gap <= TARGETS["loss_gap"],
        "equal_tokens_merged": equal,
        "loss_gap_at_equal_tokens_merged": round(gap_tokens, 4),
        "acked_deltas_lost_zero": all(r["acked_deltas_lost"] == 0 for r in rows[:3]),
        "deltas_applied_twice_zero": all(r["deltas_applied_twice"] == 0 for r in rows[:3]),
        "versions_monotonic": all(r["versions_monotonic"] for r in rows[:3]),
    }
    doc = {
        "command": "python bench/chaos.py" + (" --quick" if args.quick else ""),
        "git_rev": git_rev(),
        "host": f"{platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'})",
        "settings": vars(s),
        "checks": checks,
        "rows": rows,
        "argv": shlex.join(sys.argv),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("chaos-quick.json" if args.quick else "chaos.json")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(rows)
    print(f"\nddiloco under chaos: goodput {fmt(chaos_row['goodput'])} (target >= {TARGETS['goodput']}), "
          f"final loss {gap:+.2%} vs fault-free (target <= +{TARGETS['loss_gap']:.0%}); "
          f"at equal tokens merged ({equal:,}): {gap_tokens:+.2%}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
