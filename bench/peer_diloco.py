"""Peer cross-check: ddiloco's synchronous DiLoCo against torchft 0.2.0's DiLoCo and dp.

Issue 17, item 1. Three methods on the same model, data, shards, inner and outer
optimizers and token budget:

    torchft       torchft.local_sgd.DiLoCo (torchft==0.2.0, `pip install -e '.[bench]'`): M worker
                  processes, one replica group each, Gloo, the torchft lighthouse started
                  by this script. The inner loop is ddiloco's learner loop copied step for step
                  (learner/worker.py): AdamW (betas 0.9/0.95, the run's weight decay and lr),
                  linear warm-up over the process's own step count, gradient clipping, the same
                  ShardSampler batches of shard i for worker i; torchft does the rest (pseudo-
                  gradient, average over replicas, outer Nesterov SGD, restart from the global
                  parameters with fragment_update_alpha 0, i.e. plain DiLoCo).
    ddiloco-sync  ddiloco run --sync --quorum M --fragments 1 --codec fp32 (the launcher)
    dp            ddiloco dp --world-size M (gradients all-reduced every step)

Every run starts from the same RunConfig (written to the runs folder): the tiny model,
the built-in 4 MB corpus split into M shards, 256 held-out evaluation windows,
``ddiloco.common.model.evaluate``. torchft evaluates the global parameters after every
round (worker 0, on the same windows); ddiloco's outer optimizer evaluates every
``--eval-interval`` seconds and at the end; dp every ``--eval-interval`` seconds and at the end.

The token budget is rounded up to whole synchronous rounds (M x H x B x context tokens):
torchft trains exactly that many rounds; ddiloco and dp stop once the budget is reached
(ddiloco may overshoot by the windows flushed on drain: the JSON gives each method's tokens,
and the losses of the other methods interpolated at torchft's tokens).

Targets (issue 17): ddiloco-sync's final loss within 0.5% of torchft's (both ways: this is
an equivalence check), and its ratio to dp within 1 point of torchft's ratio to the same dp.

    python bench/peer_diloco.py                          # M=8, 12M tokens (run alone on the machine)
    python bench/peer_diloco.py --learners 4 --tokens 4000000
    python bench/peer_diloco.py --quick                  # smoke test: M=2, a few rounds
    python bench/peer_diloco.py --methods torchft,ddiloco-sync

Writes ``bench/results/peer_diloco.json`` (``peer_diloco-quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import common_bench as cb  # noqa: E402  (also puts services/ on sys.path)

ROOT = cb.ROOT
METHODS = ["torchft", "ddiloco-sync", "dp"]
TARGET_LOSS_VS_TORCHFT = 0.005
TARGET_RATIO_POINTS = 0.01
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ----------------------------------------------------------------------------- torchft
def torchft_unavailable() -> str | None:
    """Why torchft cannot run here (None: it can be imported)."""
    try:
        import torchft  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
        from torchft.manager import Manager  # noqa: F401
        from torchft.process_group import ProcessGroupGloo  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason, reported as is
        return f"torchft is not importable: {type(exc).__name__}: {exc} (pip install -e '.[bench]' installs torchft==0.2.0)"
    return None


def torchft_worker(args: argparse.Namespace) -> int:
    """One torchft replica group of one process: the inner loop of ddiloco's learner under
    torchft's DiLoCo. Worker 0 evaluates the global parameters after every round."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from ddiloco.common.config import RunConfig
    from ddiloco.common.data import ShardSampler, eval_windows, load_corpus
    from ddiloco.common.model import build_model, evaluate

    torch.set_num_threads(1)
    cfg = RunConfig.from_json(pathlib.Path(args.config).read_text())
    i, m = args.replica, cfg.learners
    lc = cfg.learner
    corpus = load_corpus(cfg.data, m)
    # the same shard and seed as ddiloco's learner i (coordinator: shard_index = learner_id % M)
    sampler = ShardSampler(corpus.shards[i], cfg.model.context, lc.batch_size, seed=cfg.data.seed + i)
    windows = eval_windows(corpus.eval_bytes, cfg.model.context, cfg.data.eval_windows) if i == 0 else None
    model = build_model(cfg.model, cfg.seed)
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.95))
    outer = torch.optim.SGD(params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)

    def state_dict():
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    long = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=m,
        use_async_quorum=False,  # DiLoCo requires it
        replica_id=f"peer{i}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="localhost",
        # every replica builds the same initial model from the run's seed: no step-0 sync
        # (with it, replicas would heal from the primary at the first quorum, after H steps)
        init_sync=False,
        timeout=long,
        quorum_timeout=long,
        connect_timeout=timedelta(seconds=120),
    )
    tokens_per_step = lc.batch_size * cfg.model.context
    round_tokens = m * lc.inner_steps * tokens_per_step
    curve: list[list[float]] = []
    t_start = time.monotonic()
    if windows is not None:
        loss, acc = evaluate(model, windows)
        curve.append([0, 0, round(loss, 5), round(acc, 5), 0.0])
    step = 0
    compute = 0.0
    failed_commits = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=lc.inner_steps, backup_device=torch.device("cpu"),
                pin_memory=False):
        while manager.current_step() < args.rounds:
            t0 = time.perf_counter()
            x, y = sampler.batch(step)
            for group in inner.param_groups:  # ddiloco's Learner._lr
                group["lr"] = lc.lr * min(1.0, (step + 1) / max(lc.warmup_steps, 1))
            _, loss = model(x, y)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
            before = manager.current_step()
            inner.step()  # torchft's post hook: every H steps, the outer step (all replicas)
            step += 1
            compute += time.perf_counter() - t0
            if step % lc.inner_steps == 0:
                committed = manager.current_step()
                if committed == before:
                    failed_commits += 1
                if windows is not None and committed > before:
                    loss_e, acc_e = evaluate(model, windows)
                    curve.append([committed, committed * round_tokens, round(loss_e, 5), round(acc_e, 5),
                                  round(time.monotonic() - t_start, 3)])
    wall = time.monotonic() - t_start
    out = {
        "replica": i,
        "rounds": manager.current_step(),
        "steps": step,
        "tokens": step * tokens_per_step,
        "failed_commits": failed_commits,
        "wall_seconds": round(wall, 3),
        "compute_seconds": round(compute, 3),
        "curve": curve,  # [round, tokens (all replicas), eval loss, eval accuracy, seconds]
    }
    pathlib.Path(args.out).write_text(json.dumps(out))
    manager.shutdown(wait=False)
    # torchft's native threads can hold the interpreter at exit; the result is written
    os._exit(0)


def run_torchft(cfg_path: pathlib.Path, cfg, rounds: int, budget_rounds: int, run_dir: pathlib.Path,
                timeout_s: float) -> dict:
    """M torchft workers against one lighthouse; worker 0's curve and every worker's counters."""
    from torchft._torchft import LighthouseServer

    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    m = cfg.learners
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=m, join_timeout_ms=60_000)
    env = {**os.environ, **CHILD_ENV}
    env["PYTHONPATH"] = str(ROOT / "services") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs = []
    t0 = time.monotonic()
    try:
        for i in range(m):
            cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--torchft-worker", "--replica", str(i),
                   "--config", str(cfg_path), "--rounds", str(rounds), "--lighthouse", lighthouse.address(),
                   "--out", str(run_dir / f"replica-{i}.json"), "--timeout-s", str(int(timeout_s))]
            with open(logs / f"replica-{i}.log", "ab") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i, c = bad[0]
                raise RuntimeError(f"torchft worker {i} exited {c}; last lines of {logs}/replica-{i}.log:\n"
                                   + _tail(logs / f"replica-{i}.log"))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft workers did not finish within {timeout_s:.0f}s; see {logs}")
            time.sleep(0.5)  # polling the children's exit
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        lighthouse.shutdown()
    elapsed = time.monotonic() - t0
    reps = [json.loads((run_dir / f"replica-{i}.json").read_text()) for i in range(m)]
    curve = reps[0]["curve"]
    at_budget = next((c for c in curve if c[0] == budget_rounds), curve[-1])
    return {
        "method": "torchft",
        # the row's final figures are those at the budget (round ``budget_rounds``); the
        # curve goes on for the extra rounds, to read torchft's loss at ddiloco's tokens
        "rounds": at_budget[0],
        "rounds_trained": min(r["rounds"] for r in reps),
        "failed_commits": sum(r["failed_commits"] for r in reps),
        "tokens": at_budget[1],
        "tokens_trained": sum(r["tokens"] for r in reps),
        "final_eval_loss": at_budget[2],
        "final_eval_accuracy": at_budget[3],
        "initial_eval_loss": curve[0][2],
        "wall_seconds": max(r["wall_seconds"] for r in reps),
        "compute_seconds": round(sum(r["compute_seconds"] for r in reps), 3),
        "elapsed_seconds": round(elapsed, 1),
        "curve": [[c[1], c[2]] for c in curve],
        "curve_rounds": [[c[0], c[2]] for c in curve],
        "run_dir": str(run_dir),
    }


def _tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- ddiloco, dp
def run_ddiloco_sync(cfg_path: pathlib.Path, m: int, budget: int, run_dir: pathlib.Path, device: str) -> dict:
    flags = ["--config", str(cfg_path), "--max-tokens", str(budget),
             "--sync", "--quorum", str(m), "--fragments", "1", "--codec", "fp32"]
    t0 = time.monotonic()
    report = cb.run_ddiloco(run_dir, flags, m, device)
    events = cb.read_events(run_dir)
    curve = cb.eval_curve(events)
    final = (int(report.get("tokens_merged") or report["tokens_trained"]), float(report["final_eval_loss"]))
    if not curve or curve[-1] != final:
        curve.append(final)
    # per round: version v is round v while every merge holds all M learners' full windows
    # (a whole outer step, fraction 1); merges on the drain may hold partial windows: not rounds
    full = {0} | {e["version"] for e in events if e.get("event") == "merge" and e.get("fraction", 1.0) >= 1.0 - 1e-9
                  and len({d[0] for d in e.get("deltas", [])}) == m}
    rounds = sorted({(e["version"], float(e["eval_loss"])) for e in events
                     if e.get("event") == "eval" and e["version"] in full and e["version"] == _rank(full, e["version"])})
    return {
        "method": "ddiloco-sync",
        "flags": flags[4:],
        "rounds": report.get("outer_steps"),
        "tokens": report["tokens_trained"],
        "tokens_merged": report.get("tokens_merged"),
        "final_eval_loss": report["final_eval_loss"],
        "final_eval_accuracy": report["final_eval_accuracy"],
        "initial_eval_loss": report.get("initial_eval_loss"),
        "wall_seconds": report["wall_seconds"],
        "elapsed_seconds": round(time.monotonic() - t0, 1),
        **cb.merge_stats(events, m),
        "curve": [[t, round(v, 5)] for t, v in curve],
        "curve_rounds": [[v, round(x, 5)] for v, x in rounds],
        "run_dir": str(run_dir),
    }


def _rank(full: set[int], v: int) -> int:
    """The round a full-round version stands for: how many full merges precede it (equal to
    the version itself as long as no merge before it was partial)."""
    return sum(1 for x in full if 0 < x <= v)


def run_dp(cfg_path: pathlib.Path, m: int, budget: int, run_dir: pathlib.Path, device: str) -> dict:
    t0 = time.monotonic()
    report = cb.run_dp(run_dir, ["--config", str(cfg_path), "--max-tokens", str(budget)], m, device)
    curve = cb.eval_curve(cb.read_events(run_dir))
    return {
        "method": "dp",
        "tokens": report["tokens_trained"],
        "optimizer_steps": report["optimizer_steps"],
        "final_eval_loss": report["final_eval_loss"],
        "final_eval_accuracy": report["final_eval_accuracy"],
        "initial_eval_loss": report["initial_eval_loss"],
        "wall_seconds": report["wall_seconds"],
        "elapsed_seconds": round(time.monotonic() - t0, 1),
        "ranks_in_sync": report.get("ranks_in_sync"),
        "curve": [[t, round(v, 5)] for t, v in curve],
        "run_dir": str(run_dir),
    }


# ----------------------------------------------------------------------------- comparison
def compare(rows: dict[str, dict]) -> tuple[dict, list[dict]]:
    """Ratios to dp, gaps to torchft, and the targets.

    ddiloco ends a little past the budget (see main); torchft's per-round curve goes beyond
    it, so the targets compare ddiloco's final loss with torchft's at ddiloco's final tokens
    merged (interpolated between two rounds), and the ratios to dp use those same two
    losses over dp's final loss. The raw finals at each method's own tokens are given too."""
    tf, dd, dp = rows.get("torchft"), rows.get("ddiloco-sync"), rows.get("dp")
    loss = lambda r: r["final_eval_loss"] if r and r.get("final_eval_loss") is not None else None  # noqa: E731
    cmp: dict = {}
    for r in rows.values():
        if dp and r is not dp and loss(r) is not None:
            r["ratio_to_dp"] = round(loss(r) / loss(dp), 5)
    cmp["ddiloco_sync_vs_torchft_final"] = cb.rel(loss(dd), loss(tf))
    equal = None
    if tf and dd and loss(dd) is not None:
        at = dd.get("tokens_merged") or dd["tokens"]
        tf_curve = [tuple(p) for p in tf["curve"]]
        tf_at = cb.interpolate(tf_curve, at)
        cmp["equal_tokens"] = at
        cmp["torchft_loss_at_equal_tokens"] = round(tf_at, 5)
        cmp["torchft_curve_covers_equal_tokens"] = bool(tf_curve) and tf_curve[-1][0] >= at
        equal = cb.rel(loss(dd), tf_at)
    cmp["ddiloco_sync_vs_torchft_at_equal_tokens"] = equal
    ratio_points = None
    if equal is not None and dp and loss(dp):
        ratio_points = round((loss(dd) - cmp["torchft_loss_at_equal_tokens"]) / loss(dp), 5)
        cmp["ratio_to_dp_ddiloco_sync"] = round(loss(dd) / loss(dp), 5)
        cmp["ratio_to_dp_torchft_at_equal_tokens"] = round(cmp["torchft_loss_at_equal_tokens"] / loss(dp), 5)
    cmp["ratio_points_ddiloco_minus_torchft"] = ratio_points
    # round by round: ddiloco's global version v is its v-th synchronous round, torchft's
    # curve has every round; where ddiloco evaluated the same round, the two should agree
    if tf and dd and dd.get("curve_rounds"):
        tf_round = {int(r): l for r, l in tf["curve_rounds"]}
        pairs = [[int(v), l, tf_round[int(v)], round(l / tf_round[int(v)] - 1, 6)]
                 for v, l in dd["curve_rounds"] if int(v) in tf_round and v > 0]
        cmp["same_round_losses"] = pairs  # [round, ddiloco-sync, torchft, relative difference]
        cmp["same_round_max_abs_rel_diff"] = max((abs(p[3]) for p in pairs), default=None)
    note = "" if cmp.get("torchft_curve_covers_equal_tokens", True) else "torchft's curve ends before ddiloco's tokens: clamped"
    targets = [
        {"target": "ddiloco-sync final loss vs torchft's at equal tokens (|relative|)", "value": equal,
         "limit": TARGET_LOSS_VS_TORCHFT, "met": None if equal is None else abs(equal) <= TARGET_LOSS_VS_TORCHFT,
         "note": ("two-sided: an equivalence check. " + note).strip()},
        {"target": "ddiloco-sync ratio to dp minus torchft's (|points|)", "value": ratio_points,
         "limit": TARGET_RATIO_POINTS, "met": None if ratio_points is None else abs(ratio_points) <= TARGET_RATIO_POINTS,
         "note": "the same dp run for both, losses at equal tokens"},
    ]
    return cmp, targets


def summary_table(rows: dict[str, dict]) -> str:
    lines = ["| method | tokens | rounds | final eval loss | ratio to dp | wall s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in METHODS:
        r = rows.get(name)
        if not r:
            continue
        if r.get("error"):
            lines.append(f"| {name} | - | - | failed: {r['error'][:80]} | - | - |")
            continue
        f = lambda k, spec=".4f": "-" if r.get(k) is None else format(r[k], spec)  # noqa: E731
        lines.append(f"| {name} | {r['tokens']:,} | {r.get('rounds', '-')} | {f('final_eval_loss')} | "
                     f"{f('ratio_to_dp')} | {f('wall_seconds', '.0f')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: M=2, H=5, batch 4, a few rounds")
    p.add_argument("--learners", type=int, default=None, help="M (default 8; 2 with --quick)")
    p.add_argument("--tokens", type=int, default=None, help="budget across learners, rounded up to whole rounds (default 12M)")
    p.add_argument("--inner-steps", type=int, default=None, help="H (default 20)")
    p.add_argument("--batch-size", type=int, default=None, help="B (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial model")
    p.add_argument("--eval-interval", type=float, default=None, help="seconds between ddiloco/dp evaluations (default 2)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="ddiloco and dp only; torchft runs on CPU (Gloo)")
    p.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    p.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--runs-dir", type=pathlib.Path, default=None, help="run folders (default: runs/peer_diloco-<time>)")
    p.add_argument("--timeout-s", type=float, default=6 * 3600.0, help="hard limit per method")
    # internal: one torchft worker
    p.add_argument("--torchft-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.method_list = [x.strip() for x in args.methods.split(",") if x.strip()]
    unknown = [x for x in args.method_list if x not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torchft's native side (lighthouse, manager) logs every quorum at INFO through RUST_LOG
    os.environ.setdefault("RUST_LOG", "warn")
    if args.torchft_worker:
        return torchft_worker(args)
    quick = args.quick
    m = args.learners or (2 if quick else 8)
    h = args.inner_steps or (5 if quick else 20)
    b = args.batch_size or (4 if quick else 8)
    cfg = cb.base_run_config(m, h, b, data_bytes=600_000 if quick else 4_000_000, eval_windows=32 if quick else 256,
                             eval_interval_s=args.eval_interval or (1.0 if quick else 2.0), run_id="peer-diloco")
    cfg.seed = args.seed
    round_tokens = cfg.round_tokens()
    budget_asked = args.tokens or (8 * round_tokens if quick else 12_000_000)
    rounds = max(1, math.ceil(budget_asked / round_tokens))
    budget = rounds * round_tokens
    # ddiloco stops once the learners' heartbeats report the budget, and merges the windows
    # flushed on the way out: it ends a little past the budget. torchft trains on for these
    # extra rounds so that its loss at ddiloco's final tokens is read off its curve, not guessed
    extra_rounds = max(6, math.ceil(0.05 * rounds)) if "ddiloco-sync" in args.method_list else 0
    prov = cb.start_provenance(args.allow_dirty or quick, "peer_diloco")
    suffix = "-quick" if quick else ""
    runs = args.runs_dir or ROOT / "runs" / time.strftime(f"peer_diloco{suffix}-%Y%m%d-%H%M%S")
    runs.mkdir(parents=True, exist_ok=True)
    cfg_path = runs / "config.json"
    cfg_path.write_text(cfg.to_json())
    print(f"peer_diloco: M={m}, H={h}, batch {b}, {rounds} rounds = {budget:,} tokens; runs in {runs}", file=sys.stderr)
    rows: dict[str, dict] = {}
    t_start = time.monotonic()
    for method in [x for x in METHODS if x in args.method_list]:
        print(f"[{time.monotonic() - t_start:6.0f}s] {method} ...", file=sys.stderr, flush=True)
        try:
            if method == "torchft":
                why = torchft_unavailable()
                if why:
                    raise RuntimeError(why)
                rows[method] = run_torchft(cfg_path, cfg, rounds + extra_rounds, rounds, runs / "torchft", args.timeout_s)
            elif method == "ddiloco-sync":
                rows[method] = run_ddiloco_sync(cfg_path, m, budget, runs / "ddiloco-sync", args.device)
            else:
                rows[method] = run_dp(cfg_path, m, budget, runs / "dp", args.device)
            r = rows[method]
            print(f"         final eval loss {r['final_eval_loss']:.4f}, {r['tokens']:,} tokens, "
                  f"{r['elapsed_seconds']:.0f}s", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - one method's failure is reported, the others still run
            reason = f"{type(exc).__name__}: {exc}"
            print(f"         {method} FAILED: {reason}", file=sys.stderr, flush=True)
            rows[method] = {"method": method, "error": reason, "traceback": traceback.format_exc()[-4000:]}
    ok_rows = {k: v for k, v in rows.items() if not v.get("error")}
    comparison, targets = compare(ok_rows)
    prov = cb.finish_provenance(prov)
    import torch

    doc = {
        "config": {
            "command": "python bench/peer_diloco.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "learners": m, "inner_steps": h, "batch_size": b, "rounds": rounds, "budget_tokens": budget, "torchft_extra_rounds": extra_rounds,
            "budget_asked": budget_asked, "model": "tiny", "seed": cfg.seed,
            "inner": {"optimizer": "AdamW", "lr": cfg.learner.lr, "betas": [0.9, 0.95], "weight_decay": cfg.learner.weight_decay,
                      "warmup_steps": cfg.learner.warmup_steps, "grad_clip": cfg.learner.grad_clip},
            "outer": {"optimizer": "SGD nesterov", "lr": cfg.outer.lr, "momentum": cfg.outer.momentum},
            "methods": [x for x in METHODS if x in args.method_list],
            "run_config": json.loads(cfg.to_json()),
            "git_rev": prov["git_rev"], "dirty": prov["dirty"], "dirty_files": prov["dirty_files"],
            "diff_sha256": prov["diff_sha256"],
            "load_average_start": prov["load_average_start"], "load_average_end": prov["load_average_end"],
            "load_ok": prov["load_ok"],
            "python": platform.python_version(), "torch": torch.__version__,
            "torchft": _version("torchft"), "cpus": os.cpu_count(),
            "total_seconds": round(time.monotonic() - t_start, 1),
            "runs_dir": str(runs),
        },
        "rows": [rows[k] for k in METHODS if k in rows],
        "comparison": comparison,
        "targets": targets,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"peer_diloco{suffix}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(summary_table(rows))
    if comparison.get("same_round_max_abs_rel_diff") is not None:
        print(f"\nsame rounds evaluated by both ({len(comparison['same_round_losses'])}): largest relative difference "
              f"{comparison['same_round_max_abs_rel_diff']:.2e}")
    if comparison.get("equal_tokens") is not None:
        print(f"\nat ddiloco-sync's final tokens merged ({comparison['equal_tokens']:,}): torchft "
              f"{comparison['torchft_loss_at_equal_tokens']:.4f}, ddiloco-sync {rows['ddiloco-sync']['final_eval_loss']:.4f}")
    print()
    print(cb.markdown_targets(targets))
    for k, r in rows.items():
        if r.get("error"):
            print(f"\n{k} did not run: {r['error']}")
    print(f"\n{path}  ({doc['config']['total_seconds']:.0f}s)")
    return 0 if all(not r.get("error") for r in rows.values()) else 1


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
