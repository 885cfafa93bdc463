"""Helpers shared by the benches: provenance (git revision, dirty check, load average),
reading a run folder's ``metrics.jsonl``, and running ddiloco / dp jobs by their launchers.

Benches launch with monitoring off (no /metrics exporters, no status page): every service
of a bench shares one small machine, where the exporters' threads would take CPU from the
co-located learners and shift the comparison, and results before monitoring existed had none.

Standards: a bench records the git revision when it starts and refuses to run
when ``services/`` or ``bench/`` has uncommitted changes, unless told ``--allow-dirty``,
in which case the result says ``"dirty": true`` with a hash of the diff; it records the load
average at start and end, and a run that started above ``MAX_START_LOAD`` is not to be
committed (the JSON says so in ``load_ok``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # runs from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.report.overlap import overlap_steps  # noqa: E402  (a run's overlap: ddiloco report shows it too)

WATCHED = ("services", "bench")
MAX_START_LOAD = 1.5


# ----------------------------------------------------------------------------- provenance
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout


def git_state(paths: tuple[str, ...] = WATCHED) -> dict:
    """The commit checked out, and whether ``paths`` differ from it: the files, and a sha256
    over the diff (tracked changes) and the untracked files' names and contents."""
    try:
        rev = _git("rev-parse", "HEAD").strip() or "unknown"
        status = [line for line in _git("status", "--porcelain", "--untracked-files=all", "--", *paths).splitlines() if line.strip()]
    except OSError:
        return {"git_rev": "unknown", "dirty": None, "dirty_files": [], "diff_sha256": None}
    files = [line[3:] for line in status]
    digest = None
    if status:
        h = hashlib.sha256(_git("diff", "HEAD", "--binary", "--", *paths).encode())
        for line in sorted(status):
            if line.startswith("??"):
                path = ROOT / line[3:]
                h.update(line[3:].encode())
                try:
                    h.update(path.read_bytes())
                except OSError:
                    pass
        digest = h.hexdigest()
    return {"git_rev": rev, "dirty": bool(status), "dirty_files": files, "diff_sha256": digest}


def require_clean(state: dict, allow_dirty: bool, what: str) -> None:
    """Refuse to run on uncommitted changes to services/ or bench/ unless ``allow_dirty``."""
    if state["dirty"] and not allow_dirty:
        shown = ", ".join(state["dirty_files"][:8]) + (" ..." if len(state["dirty_files"]) > 8 else "")
        raise SystemExit(
            f"{what}: services/ or bench/ has uncommitted changes ({shown}); commit them, or pass "
            "--allow-dirty to run anyway (the result is then marked dirty with the diff's hash)"
        )
    if state["dirty"]:
        print(f"{what}: WARNING: uncommitted changes in services/ or bench/; result marked dirty "
              f"(diff sha256 {state['diff_sha256'][:12]})", file=sys.stderr)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, in seconds (Linux ``/proc``)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def start_provenance(allow_dirty: bool, what: str) -> dict:
    """Git state and load average at the start of a bench; refuses a dirty tree (see above)."""
    state = git_state()
    require_clean(state, allow_dirty, what)
    load = load_average()
    ok = load is None or load[0] <= MAX_START_LOAD
    if not ok:
        print(f"{what}: WARNING: load average {load[0]} at start is above {MAX_START_LOAD}: the machine is "
              "not quiet; this result is not to be committed", file=sys.stderr)
    return {**state, "load_average_start": load, "load_ok": ok}


def finish_provenance(prov: dict) -> dict:
    return {**prov, "load_average_end": load_average()}


# ----------------------------------------------------------------------------- reading runs
def read_events(run_dir: pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed process
                continue
    return out


def eval_curve(events: list[dict]) -> list[tuple[int, float]]:
    """(tokens, eval loss) of every evaluation, sorted. dp eval events carry tokens; ddiloco
    eval events carry the global version, mapped to the tokens merged into it."""
    tokens_at = {0: 0}
    for e in events:
        if e.get("event") == "merge" and "tokens_merged" in e:
            tokens_at[e["version"]] = max(tokens_at.get(e["version"], 0), e["tokens_merged"])
    points = []
    for e in events:
        if e.get("event") != "eval":
            continue
        tokens = e.get("tokens")
        if tokens is None:
            known = [v for v in tokens_at if v <= e["version"]]
            tokens = tokens_at[max(known)] if known else None
        if tokens is not None:
            points.append((int(tokens), float(e["eval_loss"])))
    return sorted(set(points))


def timed_eval_curve(events: list[dict]) -> list[tuple[float, float]]:
    """(seconds since the run's first event, eval loss) of every evaluation."""
    ts = [e["t"] for e in events if "t" in e]
    if not ts:
        return []
    t0 = min(ts)
    return [(round(e["t"] - t0, 3), float(e["eval_loss"])) for e in events if e.get("event") == "eval" and "t" in e]


def merge_stats(events: list[dict], learners: int | None = None) -> dict:
    """Deltas per merge and staleness (rounds) over every merge of a ddiloco run."""
    merges = [e for e in events if e.get("event") == "merge"]
    if not merges:
        return {"merges": 0, "deltas_per_merge_mean": None, "staleness_mean": None}
    sizes = [len(e.get("deltas", [])) for e in merges]
    stale = [float(s) for e in merges for s in e.get("staleness", [])]
    out = {
        "merges": len(merges),
        "deltas_per_merge_mean": round(sum(sizes) / len(sizes), 3),
        "deltas_per_merge_min": min(sizes),
        "deltas_per_merge_max": max(sizes),
        "staleness_mean": round(sum(stale) / len(stale), 4) if stale else None,
        "staleness_max": round(max(stale), 3) if stale else None,
    }
    out.update(overlap_steps(events))
    if learners:
        drain_t = next((e["t"] for e in events if e.get("event") == "draining"), math.inf)
        out["merges_before_drain_short_of_m"] = sum(
            1 for e in merges if e.get("t", 0) < drain_t and len({d[0] for d in e.get("deltas", [])}) < learners)
    return out


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of a sorted (x, y) curve at x; clamped at the ends."""
    if not curve:
        return None
    curve = sorted(curve)
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def first_below(curve: list[tuple[float, float]], level: float) -> float | None:
    """The first x at which the curve is at or below ``level`` (None: never)."""
    for x, y in curve:
        if y <= level:
            return x
    return None


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else round(a / b - 1, 5)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- running
def run_ddiloco(run_dir: pathlib.Path, flags: list[str], learners: int, device: str = "cpu",
                slowdown: dict[int, float] | None = None, timeout_s: float = 4 * 3600.0, insecure: bool = False,
                step_seconds: float = 0.0) -> dict:
    """``ddiloco run`` with ``flags`` through the launcher; its report (raises on failure).
    Mutual TLS is on, as in any run, unless ``insecure``. ``step_seconds`` > 0 emulates
    dedicated hardware (every learner step at least that long; common/pacing.py)."""
    from ddiloco.launcher.run import LaunchOptions, launch

    result = launch(LaunchOptions(out=run_dir, run_flags=flags, learners=learners, device=device,
                                  slowdown=slowdown or {}, progress=False, monitoring=False,
                                  timeout_s=timeout_s, insecure=insecure, step_seconds=step_seconds))
    if not result.ok:
        raise RuntimeError(f"ddiloco run in {run_dir} failed: {result.failures or 'no report'}; see {run_dir}/logs")
    return result.report


def run_dp(run_dir: pathlib.Path, flags: list[str], world_size: int, device: str = "cpu",
           timeout_s: float = 4 * 3600.0, step_seconds: float = 0.0) -> dict:
    """``ddiloco dp`` with ``world_size`` ranks; rank 0's report. ``step_seconds`` as in
    ``run_ddiloco`` (every rank's step compute at least that long)."""
    from ddiloco.baselines.launch import launch_dp

    extra = ["--device", device] + (["--step-seconds", str(step_seconds)] if step_seconds > 0 else [])
    return launch_dp(run_dir, world_size, flags, extra_flags=extra, timeout_s=timeout_s)


def base_run_config(learners: int, inner_steps: int, batch_size: int, data_bytes: int = 4_000_000,
                    eval_windows: int = 256, eval_interval_s: float = 2.0, run_id: str = "bench"):
    """The RunConfig the scale and peer benches start from: the code's defaults, the tiny
    model, and a short heartbeat so that a token budget is overshot little."""
    import copy

    from ddiloco.common.config import MODEL_PRESETS, RunConfig

    cfg = RunConfig()
    cfg.run_id = run_id
    cfg.learners = learners
    cfg.model = copy.deepcopy(MODEL_PRESETS["tiny"])
    cfg.learner.batch_size = batch_size
    cfg.learner.inner_steps = inner_steps
    cfg.data.max_bytes = data_bytes
    cfg.data.eval_windows = eval_windows
    cfg.outer.eval_interval_s = eval_interval_s
    cfg.max_seconds = 8 * 3600.0  # the token budget ends every run; this only stops a wedged one
    cfg.heartbeat_interval_s = 0.25
    return cfg


def markdown_targets(items: list[dict], title: str = "target") -> str:
    lines = [f"| {title} | value | limit | met | note |", "|---|---:|---:|---|---|"]
    for t in items:
        v = t.get("value")
        shown = "-" if v is None else (f"{v:+.2%}" if t.get("kind", "rel") == "rel" else f"{v:.4g}")
        met = {True: "yes", False: "**no**", None: "n/a"}[t.get("met")]
        lines.append(f"| {t['target']} | {shown} | {t['limit']} | {met} | {t.get('note', '')} |")
    return "\n".join(lines)
