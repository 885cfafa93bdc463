"""Bandwidth benchmark: every method behind the same shaped datacenter links, bytes counted by
the kernel, in one invocation.

Each method trains the same model on the same data to the same token budget with M learners
(or ranks), each in its own network namespace behind a veth link shaped with tc to the
profile's rate in both directions (``ddiloco run --topology netns``; see docs/wan.md):

    dp                      synchronous data-parallel, gradients all-reduced every step (gloo
                            ring across the namespaces, forwarded by the hub)
    diloco-sync             synchronous DiLoCo (the quality bench's flags)
    ddiloco-int8            Decoupled DiLoCo, int8 pseudo-gradients (the quality bench's flags)
    ddiloco-int4            the same with int4
    ddiloco-int4-fragments  int4 with P fragments on staggered schedules (--fragments P)
    ddiloco-int4-fragments-paced
                            the same with paced transfers (--pace-transfers): each upload
                            and download spread over most of a fragment slot

Size, H and every other setting come from bench/quality.py (its ``cpu`` preset, ``quick``
with --quick, its N budget), so quality and bandwidth describe the same runs. ``--model
small`` trains the model ``ddiloco run`` trains by default instead (batch and H as before, a
budget and evaluation interval of its own, below).

The H sweep (``--sweep 50,100``) adds, for each H listed and each of ``--sweep-methods``
(default ``ddiloco-int4,ddiloco-int4-fragments``), a row ``<method>-h<H>``: the same run
with ``--inner-steps H``, at the same token budget. Every row records its H, and a second
PNG (``bandwidth[...]-frontier.png``) plots final eval loss against bytes per token: the
bandwidth-quality frontier a user picks H and codec from. The bytes target is read at the
largest H whose int4 loss is within 1% of the preset H's.

Per row: ``bytes_per_token`` (kernel-counted bytes over all datacenter links, both
directions, divided by tokens trained), ``peak_mbps`` and ``avg_mbps`` (the busiest
datacenter's, busier direction, 1-second windows over the training span),
``compute_utilization`` (learner compute seconds / learner wall seconds, summed over
learners), ``seconds_to_target_loss`` and ``final_eval_loss``. Output: a markdown table,
``<results>/bandwidth[-quick].json`` and ``bandwidth[-quick].png`` (link use over time per
datacenter). Needs root. Run from the repository root:

    sudo python bench/bandwidth.py                  # profile wan, M=4, the quality bench's N
    sudo python bench/bandwidth.py --quick          # smoke test, M=2, about a minute
    sudo python bench/bandwidth.py --profile wan-slow --dp-steps 40
    sudo python bench/bandwidth.py --model small --sweep 50,100 --dp-steps 20

With --dp-steps K, dp trains only K steps behind the shaped links (bytes, link use and time
per step are measured there) and its loss curve comes from an unshaped local run of the full
budget; its time to the target is then (steps to the target) x (shaped seconds per step),
and the row says ``extrapolated: true``.
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
for p in (ROOT / "services", ROOT / "bench"):
    if str(p) not in sys.path:  # runs from a plain checkout too
        sys.path.insert(0, str(p))

import quality  # noqa: E402  (the quality bench: its presets and ddiloco flags are ours)
from common_bench import finish_provenance, start_provenance  # noqa: E402
from ddiloco.common.config import MODEL_PRESETS  # noqa: E402

METHODS = ["dp", "diloco-sync", "ddiloco-int8", "ddiloco-int4", "ddiloco-int4-fragments", "ddiloco-int4-fragments-paced"]
DDILOCO = [m for m in METHODS if m.startswith("ddiloco")]
DEFAULT_FRAGMENTS = 8  # P: several fragment messages per learner in each 1 s window at this model size
DP_PORT = 29500  # the rendezvous port inside datacenter 0's fresh namespace: always free there
SWEEP_METHODS = ["ddiloco-int4", "ddiloco-int4-fragments"]  # the sweep's default
SWEEPABLE = [*SWEEP_METHODS, "ddiloco-int4-fragments-paced"]
LOSS_TOLERANCE = 0.01  # a larger H "keeps the quality" while its loss is within 1% of the preset H's

# --model small: the quality preset's batch and H, with a budget and an evaluation interval
# of its own. 300 steps per learner (4 x 300 x 8 x 128 = 1,228,800 tokens) give H = 100 three
# windows and H = 25 twelve; a step of this model costs ~15x the tiny one's, so the outer
# optimizer evaluates (256 windows of 128 bytes) every 15 s instead of every 3 s, or its
# evaluations would take a core from the learners.
MODEL_SETTINGS = {"small": {"budget_tokens": 1_228_800, "eval_interval_s": 15.0}}


def sweep_name(method: str, h: int) -> str:
    return f"{method}-h{h}"


# ----------------------------------------------------------------------------- methods
def swept_from(method: str) -> str | None:
    """The method a sweep row ``<method>-h<H>`` varies, or None for any other row."""
    base, _, h = method.rpartition("-h")
    return base if base in SWEEPABLE and h.isdigit() else None


def method_flags(method: str, fragments: int, learners: int) -> list[str]:
    base = swept_from(method)
    if base is not None:  # a row of the H sweep
        return [*method_flags(base, fragments, learners), "--inner-steps", method.rpartition("-h")[2]]
    if method == "ddiloco-int4-fragments":
        return [*quality.method_flags("ddiloco-int4", learners), "--fragments", str(fragments)]
    if method == "ddiloco-int4-fragments-paced":
        return [*method_flags("ddiloco-int4-fragments", fragments, learners), "--pace-transfers"]
    return quality.method_flags(method, learners)


def fragments_supported() -> bool:
    """``ddiloco run --fragments`` exists (the core added it with delta downloads)."""
    from ddiloco.common.runflags import add_run_flags

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    return any("--fragments" in a.option_strings for a in parser._actions)


def run_ddiloco(method: str, flags: list[str], run_dir: pathlib.Path, learners: int, profile: str,
                step_seconds: float = 0.0) -> tuple[dict, dict]:
    from ddiloco.launcher.run import LaunchOptions, launch
    from ddiloco.launcher.topology import TopologyOptions

    result = launch(LaunchOptions(out=run_dir, run_flags=flags, learners=learners, device="cpu", progress=False, monitoring=False,
                                  topology=TopologyOptions("netns", profile), step_seconds=step_seconds))
    if not result.ok or "links" not in (result.report or {}):
        raise RuntimeError(f"{method} failed: {result.failures or 'no report'}; see {run_dir}/logs")
    return result.report, result.report["links"]


def run_dp(flags: list[str], run_dir: pathlib.Path, ranks: int, profile: str) -> tuple[dict, dict]:
    """The data-parallel baseline with rank r in datacenter r's namespace."""
    from ddiloco.baselines.launch import launch_dp
    from ddiloco.common.durable import write_json
    from ddiloco.launcher.topology import add_application_counts
    from ddiloco.netns.session import NetnsSession

    run_dir.mkdir(parents=True, exist_ok=True)
    with NetnsSession(profile, ranks, out=run_dir) as s:
        # gloo picks its interface by hostname by default, which names nothing inside a namespace
        def wrap(rank: int) -> list[str]:
            return [*s.dc_wrap(rank), "env", "GLOO_SOCKET_IFNAME=wan0"]

        s.start_sampling(run_dir / "metrics.jsonl")
        try:
            report = launch_dp(run_dir, ranks, flags, wrap_for_rank=wrap, master_addr=s.dc_address(0),
                               master_port=DP_PORT, extra_flags=["--device", "cpu"])
        finally:
            s.stop_sampling()
        events = read_events(run_dir)
        links = s.links(dp_span(events))
    add_application_counts(links, None, events)
    # what the ranks' own sockets sent and received (tcp_info): each all-reduce byte leaves one
    # datacenter and enters another, so it crosses two links, as in the kernel's link count
    ranks = report.get("ranks") or []
    if ranks and all(r.get("bytes_sent") is not None for r in ranks):
        links["app_bytes_total"] = sum(r["bytes_sent"] + r["bytes_received"] for r in ranks)
    report["links"] = links
    write_json(run_dir / "report.json", report)
    return report, links


def run_dp_local(flags: list[str], run_dir: pathlib.Path, ranks: int) -> dict:
    from ddiloco.baselines.launch import launch_dp

    return launch_dp(run_dir, ranks, flags, extra_flags=["--device", "cpu"])


# ----------------------------------------------------------------------------- reading runs
def read_events(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a process killed mid-write
    return out


def dp_span(events: list[dict]) -> tuple[float, float] | None:
    """dp trains from rank 0's initial evaluation (version 0) until its ranks stop
    (``dp_stop``; the final evaluation after it moves nothing over the links)."""
    start = [e["t"] for e in events if e["event"] == "eval" and e.get("version") == 0]
    end = [e["t"] for e in events if e["event"] == "dp_stop"] or [e["t"] for e in events if e["event"] == "finished"]
    return (min(start), min(end)) if start and end else None


def training_start(method: str, events: list[dict]) -> float | None:
    if method == "dp":
        span = dp_span(events)
        return span[0] if span else None
    # the first learner's first step: after its start-up (data, model, first pull), like dp's
    ts = [e["t"] for e in events if e["event"] == "learner_start"]
    return min(ts) if ts else None


def loss_timeline(events: list[dict]) -> list[tuple[float, float]]:
    """(wall time, eval loss) of every evaluation of the global model, the final one included."""
    pts = [(e["t"], float(e["eval_loss"])) for e in events if e["event"] in ("eval", "finalize")
           and e.get("eval_loss") is not None]
    return sorted(pts)


def seconds_to(target: float, start: float | None, timeline: list[tuple[float, float]]) -> float | None:
    if start is None:
        return None
    for t, loss in timeline:
        if loss <= target:
            return round(max(0.0, t - start), 2)
    return None


def compute_utilization(method: str, report: dict) -> tuple[float | None, float | None]:
    """(sum of compute seconds / sum of wall seconds over learners or ranks, the lowest one)."""
    people = report.get("ranks") if method == "dp" else report.get("learners")
    pairs = [(p.get("compute_seconds") or 0.0, p.get("wall_seconds") or 0.0) for p in people or []]
    pairs = [(c, w) for c, w in pairs if w > 0]
    if not pairs:
        return None, None
    return (round(sum(c for c, _ in pairs) / sum(w for _, w in pairs), 4),
            round(min(c / w for c, w in pairs), 4))


def busiest(links: dict) -> dict:
    """The datacenter whose link carried the most (highest average use)."""
    return max(links["datacenters"], key=lambda d: (d["avg_mbps"], d["peak_mbps"]))


def link_series(events: list[dict], start: float | None) -> dict[int, dict[str, list[float]]]:
    """Per datacenter: seconds since the training start, up and down Mbit/s (link_sample events)."""
    out: dict[int, dict[str, list[float]]] = {}
    t0 = start if start is not None else min((e["t"] for e in events), default=0.0)
    for e in events:
        if e["event"] != "link_sample":
            continue
        s = out.setdefault(int(e["datacenter"]), {"t": [], "up": [], "down": []})
        s["t"].append(round(e["t"] - t0, 3))
        s["up"].append(e["up_mbps"])
        s["down"].append(e["down_mbps"])
    return out


def make_row(method: str, profile: str, report: dict, links: dict, events: list[dict], elapsed: float,
             inner_steps: int | None = None, fragments: int | None = None) -> dict:
    tokens = int(report["tokens_trained"])
    worst = busiest(links)
    util, util_min = compute_utilization(method, report)
    return {
        "method": method,
        "profile": profile,
        "inner_steps": inner_steps,  # H (None for dp, which syncs every step)
        "fragments": fragments,
        "bytes_per_token": round(links["bytes_total"] / tokens, 4) if tokens else None,
        "bytes_up_per_token": round(sum(d["bytes_up"] for d in links["datacenters"]) / tokens, 4) if tokens else None,
        "bytes_down_per_token": round(sum(d["bytes_down"] for d in links["datacenters"]) / tokens, 4) if tokens else None,
        "peak_mbps": worst["peak_mbps"],
        "avg_mbps": worst["avg_mbps"],
        "peak_over_avg": round(worst["peak_mbps"] / worst["avg_mbps"], 3) if worst["avg_mbps"] else None,
        "compute_utilization": util,
        "compute_utilization_min_learner": util_min,
        "seconds_to_target_loss": None,  # filled once every row's final loss is known
        "final_eval_loss": report["final_eval_loss"],
        "extrapolated": False,
        "tokens": tokens,
        "kernel_bytes": links["bytes_total"],
        "app_bytes": links.get("app_bytes_total"),
        "wall_seconds": report["wall_seconds"],
        "elapsed_seconds": round(elapsed, 1),
        "busiest_datacenter": worst["datacenter"],
        "datacenters": [{k: d[k] for k in ("datacenter", "rate_mbit", "bytes_up", "bytes_down", "avg_mbps", "peak_mbps",
                                            "avg_up_mbps", "avg_down_mbps", "peak_up_mbps", "peak_down_mbps")}
                        for d in links["datacenters"]],
        "span_seconds": links["span_seconds"],
    }


# ----------------------------------------------------------------------------- targets
def largest_h_keeping_quality(rows: list[dict], method: str = "ddiloco-int4",
                              tolerance: float = LOSS_TOLERANCE) -> dict | None:
    """Of ``method``'s row at the preset H and its sweep rows, the one with the largest H whose
    final eval loss is within ``tolerance`` (relative) of the preset H's; None without the
    preset row. The preset row itself always qualifies."""
    base = next((r for r in rows if r["method"] == method), None)
    if base is None or base.get("final_eval_loss") is None:
        return base
    limit = base["final_eval_loss"] * (1 + tolerance)
    ok = [r for r in rows if (r is base or swept_from(r["method"]) == method)
          and r.get("inner_steps") is not None and r.get("final_eval_loss") is not None
          and r["final_eval_loss"] <= limit]
    return max(ok, key=lambda r: r["inner_steps"], default=base)


def targets(rows: list[dict], profile: str) -> list[dict]:
    by = {r["method"]: r for r in rows}
    out = []

    def add(name: str, value, limit, ok) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": None if value is None else ok(value)})

    dp, i4, frag = by.get("dp"), largest_h_keeping_quality(rows), by.get("ddiloco-int4-fragments")
    ratio = (round(dp["bytes_per_token"] / i4["bytes_per_token"], 1)
             if dp and i4 and dp["bytes_per_token"] and i4["bytes_per_token"] else None)
    base_h = by["ddiloco-int4"].get("inner_steps") if "ddiloco-int4" in by else None
    chosen = (f" at H = {i4['inner_steps']} (the largest H whose loss is within "
              f"{LOSS_TOLERANCE:.0%} of H = {base_h}'s)") if i4 and i4.get("inner_steps") is not None else ""
    add(f"dp / ddiloco-int4 bytes per token{chosen}", ratio, 500, lambda v: v >= 500)
    if i4 is not None:
        out[-1]["row"] = i4["method"]
    add("ddiloco-int4-fragments peak / avg Mbit/s", frag["peak_over_avg"] if frag else None, 1.5, lambda v: v <= 1.5)
    paced = by.get("ddiloco-int4-fragments-paced")
    if paced is not None:
        add("ddiloco-int4-fragments-paced peak / avg Mbit/s", paced["peak_over_avg"], 1.5, lambda v: v <= 1.5)
    ddl = [r for r in rows if r["method"] in DDILOCO]
    add(f"min compute_utilization of ddiloco rows ({profile})",
        min((r["compute_utilization"] for r in ddl if r["compute_utilization"] is not None), default=None), 0.95,
        lambda v: v >= 0.95)
    speedups = [dp["seconds_to_target_loss"] / r["seconds_to_target_loss"]
                for r in ddl if dp and dp["seconds_to_target_loss"] and r["seconds_to_target_loss"]]
    add(f"min over ddiloco rows of dp seconds_to_target_loss / theirs ({profile})",
        round(min(speedups), 2) if speedups else None, 20, lambda v: v >= 20)
    if profile != "wan":
        for t in out[3 if paced is not None else 2:]:
            t["note"] = "the issue states this target under the wan profile"
    return out


# ----------------------------------------------------------------------------- output
def markdown_table(rows: list[dict], target_loss: float | None) -> str:
    to = f"s to loss {target_loss:.3f}" if target_loss is not None else "s to target"
    lines = [
        f"| method | profile | H | bytes/token | peak Mbit/s | avg Mbit/s | compute util. | {to} | final eval loss | tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        st = r["seconds_to_target_loss"]
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(
            f"| {r['method']}{mark} | {r['profile']} | {_f(r.get('inner_steps'), 'd')} | {r['bytes_per_token']:.2f} | "
            f"{r['peak_mbps']:.2f} | "
            f"{r['avg_mbps']:.2f} | {_f(r['compute_utilization'], '.3f')} | {_f(st, '.1f')} | "
            f"{_f(r['final_eval_loss'], '.4f')} | {r['tokens']:,} |"
        )
    return "\n".join(lines)


def targets_table(items: list[dict]) -> str:
    lines = ["| target | value | limit | met |", "|---|---:|---:|---|"]
    for t in items:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {'-' if t['value'] is None else t['value']} | {t['limit']} | {met} |")
    return "\n".join(lines)


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def plot(series: dict[str, dict], rates: dict[str, list], path: pathlib.Path, profile: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", file=sys.stderr)
        return False
    methods = [m for m in series if series[m]]
    if not methods:
        return False
    fig, axes = plt.subplots(len(methods), 1, figsize=(10, 2.4 * len(methods)), squeeze=False, sharex=False)
    for ax, method in zip(axes[:, 0], methods):
        for dc, s in sorted(series[method].items()):
            line, = ax.plot(s["t"], s["up"], lw=1.1, label=f"dc{dc} up")
            ax.plot(s["t"], s["down"], lw=0.9, ls="--", color=line.get_color(), label=f"dc{dc} down")
        for r in sorted({x for x in rates.get(method, []) if x}):
            ax.axhline(r, color="k", lw=0.6, alpha=0.5)
        ax.set_xlim(left=-2.0)  # start-up before training carries nothing of interest
        ax.set_title(f"{method} ({profile})", fontsize=9)
        ax.set_ylabel("Mbit/s")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since training start (1 s windows, kernel counters at the hub)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_frontier(rows: list[dict], path: pathlib.Path, profile: str, preset) -> bool:
    """Final eval loss against bytes per token, one point per row, labelled with its H: the
    bandwidth-quality frontier. Rows of one method family share a colour and are joined in
    order of H."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pts = [r for r in rows if r.get("bytes_per_token") and r.get("final_eval_loss") is not None]
    if not pts:
        return False
    families: dict[str, list[dict]] = {}
    for r in pts:
        families.setdefault(swept_from(r["method"]) or r["method"], []).append(r)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for family, rs in families.items():
        rs = sorted(rs, key=lambda r: r.get("inner_steps") or 0)
        xs, ys = [r["bytes_per_token"] for r in rs], [r["final_eval_loss"] for r in rs]
        line, = ax.plot(xs, ys, marker="o", lw=1.0, label=family)
        for r in rs:
            h = r.get("inner_steps")
            ax.annotate("dp" if h is None else f"H={h}", (r["bytes_per_token"], r["final_eval_loss"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token (kernel-counted, every datacenter link, both directions)")
    ax.set_ylabel("final eval loss (equal tokens)")
    ax.set_title(f"bandwidth-quality frontier ({profile}, {preset.name}, {preset.budget_tokens:,} tokens)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def model_parameters(cfg) -> int:
    from ddiloco.common.model import build_model, parameter_count

    return parameter_count(build_model(cfg.model, 0))


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ddiloco.wan.profiles import profile_names

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="wan", choices=profile_names(), help="WAN profile of every datacenter link")
    p.add_argument("--quick", action="store_true", help="smoke test: quality's quick preset, M=2")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--fragments", type=int, default=DEFAULT_FRAGMENTS, help="P for ddiloco-int4-fragments")
    p.add_argument("--model", default=None, choices=sorted(MODEL_PRESETS),
                   help="model size preset (default: the quality preset's, 2 layers of width 64)")
    p.add_argument("--sweep", default="", help="comma-separated H values beyond the preset's, e.g. 50,100 (the H sweep)")
    p.add_argument("--sweep-methods", default=",".join(SWEEP_METHODS),
                   help="methods the H sweep repeats, a subset of " + ", ".join(SWEEPABLE))
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="every learner's step at least this long (ddiloco run --step-seconds: slower hardware, "
                        "longer fragment slots); DiLoCo rows only")
    p.add_argument("--tag", default="", help="appended to the result files' names (a run of a subset of the methods)")
    p.add_argument("--budget", type=int, default=0, help="tokens (default: the quality preset's N)")
    p.add_argument("--learners", type=int, default=0, help=f"M (default: {quality.M}, 2 with --quick)")
    p.add_argument("--dp-steps", type=int, default=0,
                   help="measure dp behind the shaped links over this many steps only and extrapolate (see above)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="loss for seconds_to_target_loss (default: the highest final eval loss of the measured rows)")
    p.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--runs-dir", type=pathlib.Path, default=None, help="run folders (default: runs/bandwidth-<time>)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run with uncommitted changes in services/ or bench/ (marked dirty; --quick implies it)")
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    if args.fragments < 2:
        p.error("--fragments must be at least 2 (P = 1 is ddiloco-int4)")
    if args.budget < 0 or args.dp_steps < 0 or args.learners < 0:
        p.error("--budget, --dp-steps and --learners must be positive")
    try:
        args.sweep_h = sorted({int(h) for h in args.sweep.split(",") if h.strip()})
    except ValueError:
        p.error(f"--sweep: expected comma-separated whole numbers, got {args.sweep!r}")
    if any(h < 1 for h in args.sweep_h):
        p.error("--sweep: every H must be at least 1")
    if not 0 <= args.step_seconds <= 5:
        p.error(f"--step-seconds must be between 0 and 5 (a lease is 10 s), got {args.step_seconds}")
    if args.step_seconds and "dp" in args.method_list:
        p.error("--step-seconds applies to the DiLoCo rows only: leave dp out (--methods)")
    if args.tag and not all(c.isalnum() or c == "-" for c in args.tag):
        p.error(f"--tag: letters, digits and '-' only (it names files), got {args.tag!r}")
    args.sweep_method_list = [m.strip() for m in args.sweep_methods.split(",") if m.strip()]
    if [m for m in args.sweep_method_list if m not in SWEEPABLE] or (args.sweep_h and not args.sweep_method_list):
        p.error(f"--sweep-methods: choose from {SWEEPABLE}")
    if args.model and args.model not in MODEL_SETTINGS and not args.quick and not args.budget:
        p.error(f"--model {args.model}: give --budget (a token budget is set only for {sorted(MODEL_SETTINGS)})")
    return args


def bench_preset(args: argparse.Namespace) -> "quality.Preset":
    """The quality preset, with --model's size (and that model's budget and evaluation
    interval) and --budget applied."""
    preset = quality.PRESETS["quick" if args.quick else "cpu"]
    if args.model:
        extra = {} if args.quick else MODEL_SETTINGS.get(args.model, {})
        preset = dataclasses.replace(preset, name=f"{preset.name}-{args.model}",
                                     model=dataclasses.replace(MODEL_PRESETS[args.model]), **extra)
    if args.budget:
        preset = dataclasses.replace(preset, budget_tokens=args.budget)
    return preset


def result_suffix(args: argparse.Namespace) -> str:
    """bandwidth[-quick][-<model>][-<profile> unless wan][-<tag>]: the committed files stay apart."""
    parts = (["quick"] if args.quick else []) + ([args.model] if args.model else [])
    if not args.quick and args.profile != "wan":
        parts.append(args.profile)
    if getattr(args, "tag", ""):
        parts.append(args.tag)
    return "".join(f"-{x}" for x in parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ddiloco.netns.topology import NetnsError, require_root

    try:
        require_root()
    except NetnsError as exc:
        print(f"bench/bandwidth.py: {exc}", file=sys.stderr)
        return 2
    prov = start_provenance(args.allow_dirty or args.quick, "bandwidth")  # before anything runs
    preset = bench_preset(args)
    learners = args.learners or (2 if args.quick else quality.M)
    suffix = result_suffix(args)
    runs = args.runs_dir or ROOT / "runs" / time.strftime(f"bandwidth{suffix}-%Y%m%d-%H%M%S")
    runs.mkdir(parents=True, exist_ok=True)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    cfg = quality.run_config(preset)
    cfg.run_id = f"bandwidth-{preset.name}"
    cfg.learners = learners
    cfg_path = runs / "config.json"
    cfg_path.write_text(cfg.to_json())
    base = ["--config", str(cfg_path), "--max-tokens", str(preset.budget_tokens)]
    methods = list(args.method_list)
    skipped = {}
    if "ddiloco-int4-fragments" in methods and not fragments_supported():
        methods.remove("ddiloco-int4-fragments")
        skipped["ddiloco-int4-fragments"] = "this build of ddiloco run has no --fragments flag"
    methods += [sweep_name(m, h) for h in args.sweep_h if h != preset.inner_steps
                for m in args.sweep_method_list]
    rows, series, rates = [], {}, {}
    timelines: dict[str, tuple[float | None, list]] = {}
    t_start = time.monotonic()
    for method in methods:
        run_dir = runs / method
        t0 = time.monotonic()
        print(f"[{time.monotonic() - t_start:6.0f}s] {method} ({args.profile}, M={learners}, "
              f"{preset.budget_tokens:,} tokens) ...", file=sys.stderr, flush=True)
        extrapolation = None
        flags = method_flags(method, args.fragments, learners)
        if method == "dp":
            if args.dp_steps:
                row, extrapolation = measure_dp_extrapolated(args, cfg, base, runs, learners)
                rows.append(row)
                events = read_events(run_dir)
                series[method] = link_series(events, training_start(method, events))
                rates[method] = [d["rate_mbit"] for d in row["datacenters"]]
                timelines[method] = extrapolation.pop("_timeline")
                print(f"        extrapolated from {args.dp_steps} shaped steps", file=sys.stderr, flush=True)
                continue
            report, links = run_dp(base, run_dir, learners, args.profile)
        else:
            report, links = run_ddiloco(method, base + flags, run_dir, learners, args.profile, args.step_seconds)
        events = read_events(run_dir)
        h = int(flags[flags.index("--inner-steps") + 1]) if "--inner-steps" in flags else preset.inner_steps
        p = int(flags[flags.index("--fragments") + 1]) if "--fragments" in flags else cfg.fragments
        if method == "dp":  # all-reduces every step: no H, no fragments
            h = p = None
        row = make_row(method, args.profile, report, links, events, time.monotonic() - t0, inner_steps=h, fragments=p)
        row["run_dir"] = str(run_dir)
        rows.append(row)
        start = training_start(method, events)
        timelines[method] = (start, loss_timeline(events))
        series[method] = link_series(events, start)
        rates[method] = [d["rate_mbit"] for d in links["datacenters"]]
        print(f"        {row['bytes_per_token']:.2f} B/token, peak {row['peak_mbps']:.2f} Mbit/s, final loss "
              f"{row['final_eval_loss']:.4f}, {row['elapsed_seconds']:.0f}s", file=sys.stderr, flush=True)
    # the sweep rows are not part of the target's rule: it stays the preset H's rows' worst loss
    measured = [r["final_eval_loss"] for r in rows if r["final_eval_loss"] is not None and swept_from(r["method"]) is None]
    target = args.target_loss if args.target_loss is not None else (max(measured) if measured else None)
    for r in rows:
        if target is None:
            continue
        start, timeline = timelines[r["method"]]
        if r.get("_seconds_per_step") is not None:  # extrapolated dp: steps to the target x shaped step time
            steps = next((s for s, loss in timeline if loss <= target), None)
            r["seconds_to_target_loss"] = round(steps * r["_seconds_per_step"], 2) if steps is not None else None
            r["extrapolation"]["steps_to_target"] = steps
        else:
            r["seconds_to_target_loss"] = seconds_to(target, start, timeline)
        r["target_loss"] = target
    for r in rows:
        r.pop("_seconds_per_step", None)
    checks = targets(rows, args.profile)
    result = {
        "config": {
            "command": "python bench/bandwidth.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "profile": args.profile,
            "step_seconds": args.step_seconds,
            "preset": preset.name,
            "learners": learners,
            "budget_tokens": preset.budget_tokens,
            "inner_steps": cfg.learner.inner_steps,
            "fragments": args.fragments,
            "model": dataclasses.asdict(cfg.model),
            "parameters": model_parameters(cfg),
            "sweep_h": args.sweep_h,
            "sweep_methods": args.sweep_method_list if args.sweep_h else [],
            "target_loss": target,
            "target_loss_rule": "given" if args.target_loss is not None
            else "highest final eval loss of the measured rows at the preset H (the sweep rows excluded)",
            "method_flags": {m: method_flags(m, args.fragments, learners) for m in methods if m != "dp"},
            "skipped": skipped,
            "run_config": json.loads(cfg.to_json()),
            "definitions": {
                "bytes_per_token": "kernel-counted bytes over every datacenter link, both directions, / tokens trained",
                "peak_mbps/avg_mbps": "the busiest datacenter's (highest average), busier direction, 1 s windows wholly "
                                      "inside the training span (first step until draining; dp: until its ranks stop)",
                "compute_utilization": "sum of learners' (ranks') compute seconds / sum of their wall seconds",
                "seconds_to_target_loss": "from training start to the first evaluation at or below target_loss",
            },
            **finish_provenance(prov),
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
            "cpus": os.cpu_count(),
            "total_seconds": round(time.monotonic() - t_start, 1),
        },
        "rows": rows,
        "targets": checks,
    }
    json_path = args.results_dir / f"bandwidth{suffix}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.results_dir / f"bandwidth{suffix}.png"
    plotted = plot(series, rates, png_path, args.profile)
    frontier_path = args.results_dir / f"bandwidth{suffix}-frontier.png"
    plotted_frontier = plot_frontier(rows, frontier_path, args.profile, preset)
    print(markdown_table(rows, target))
    print()
    print(targets_table(checks))
    for m, why in skipped.items():
        print(f"\n{m}: not run: {why}")
    print(f"\n{json_path}" + (f"\n{png_path}" if plotted else "") + (f"\n{frontier_path}" if plotted_frontier else "")
          + f"\nrun folders: {runs}  "
          f"({result['config']['total_seconds']:.0f}s)")
    return 0


def measure_dp_extrapolated(args, cfg, base: list[str], runs: pathlib.Path, learners: int) -> tuple[dict, dict]:
    """dp for --dp-steps steps behind the shaped links, and its loss per step from an
    unshaped local run of the full budget (synchronous DP's loss per step does not depend on
    the link; only its time per step does)."""
    steps = args.dp_steps
    tokens_per_step = learners * cfg.learner.batch_size * cfg.model.context
    short = [a for a in base]
    short[short.index("--max-tokens") + 1] = str(steps * tokens_per_step)
    t0 = time.monotonic()
    report, links = run_dp(short, runs / "dp", learners, args.profile)
    events = read_events(runs / "dp")
    row = make_row("dp", args.profile, report, links, events, time.monotonic() - t0)
    seconds_per_step = report["wall_seconds"] / max(1, report["optimizer_steps"])
    local_dir = runs / "dp-local"
    local = run_dp_local(base, local_dir, learners)
    local_events = read_events(local_dir)
    per_step = [(int(e["version"]), float(e["eval_loss"])) for e in local_events if e["event"] == "eval"]
    row.update({
        "extrapolated": True,
        "final_eval_loss": local["final_eval_loss"],
        "_seconds_per_step": seconds_per_step,
        "run_dir": str(runs / "dp"),
        "extrapolation": {
            "shaped_steps": report["optimizer_steps"],
            "shaped_seconds_per_step": round(seconds_per_step, 4),
            "loss_curve_from": str(local_dir),
            "tokens_full_budget": local["tokens_trained"],
            "rule": "seconds_to_target_loss = steps to the target (unshaped run) x shaped seconds per step; "
                    "tokens, bytes_per_token, link use and compute_utilization from the shaped steps; "
                    "final_eval_loss from the unshaped run of the full budget",
            "_timeline": (None, sorted(per_step)),
        },
    })
    return row, row["extrapolation"]


if __name__ == "__main__":
    sys.exit(main())
