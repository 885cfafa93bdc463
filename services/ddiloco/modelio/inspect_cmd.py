"""``ddiloco inspect``: what a checkpoint (or a run's newest one, or an export) holds.

Versions, tokens merged, fragments, learners, and per tensor its shape, parameter norm and
momentum norm: enough to see whether a checkpoint is the one you expect and whether the
model or the outer momentum blew up. Given a run folder, each learner's group size and
datacenter come from the coordinator's saved state (``RUN/coordinator/state.json``): a
checkpoint holds only what the outer optimizer knows, and group sizes are the coordinator's.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from ddiloco.coordinator.membership import MemberRecord, saved_members
from ddiloco.modelio.source import GlobalModel, SourceError, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=pathlib.Path, help="a checkpoint folder, a run folder (its newest checkpoint) or an exported file")
    parser.add_argument("--version", type=int, default=None, help="with a run folder: one of its kept checkpoint versions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run_members(source: pathlib.Path) -> tuple[dict[int, MemberRecord] | None, str | None]:
    """(each learner's record in the run's saved coordinator state, why there is none): a
    run folder whose coordinator saved its state gives the records; a checkpoint folder or
    an export gives (None, None); a state file that cannot be read gives (None, the reason),
    and the model is still inspected."""
    path = source / "coordinator" / "state.json"
    if not path.is_file():
        return None, None
    try:
        return saved_members(path), None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{path}: unreadable ({type(exc).__name__}: {exc})"


def summary(g: GlobalModel, members: dict[int, MemberRecord] | None = None, members_error: str | None = None) -> dict:
    tensors = []
    for name, t in g.params.items():
        m = g.momentum.get(name)
        tensors.append({
            "name": name, "shape": list(t.shape), "norm": float(t.float().norm()),
            "max_abs": float(t.abs().max()) if t.numel() else 0.0,
            "momentum_norm": float(m.float().norm()) if m is not None else None,
            "finite": bool(t.isfinite().all()),
        })
    st = g.state
    fragments = [
        {"index": f["index"], "version": f["version"], "tokens_merged": f["tokens_merged"], "tensors": len(f["tensors"])}
        for f in st.get("fragments", [])
    ]
    learners = {
        k: {"merged": v.get("merged"), "tokens_merged": sum((v.get("tokens_merged") or {}).values())}
        for k, v in st.get("learners", {}).items()
    }
    for learner_id, rec in (members or {}).items():
        # a member that has merged nothing yet is listed too: it holds a place in the run
        entry = learners.setdefault(str(learner_id), {"merged": 0, "tokens_merged": 0})
        entry.update(ranks=rec.ranks, datacenter=rec.datacenter)
    return {
        "source": g.origin,
        "run_id": g.run_id,
        "version": g.version,
        "outer_steps": st.get("outer_steps"),
        "tokens_merged": sum(f["tokens_merged"] for f in fragments) if fragments else None,
        "pending_deltas": len(st.get("pending", [])),
        "parameters": sum(t.numel() for t in g.params.values()),
        "param_norm": math.sqrt(sum(x["norm"] ** 2 for x in tensors)),
        "momentum_norm": math.sqrt(sum(x["momentum_norm"] ** 2 for x in tensors if x["momentum_norm"] is not None))
        if g.momentum else None,
        "all_finite": all(x["finite"] for x in tensors),
        "fragments": fragments,
        "learners": learners,
        "membership": "coordinator state" if members is not None else None,
        "membership_error": members_error,
        "tensors": tensors,
    }


def _text(s: dict) -> str:
    out = [
        f"source         {s['source']}",
        f"run            {s['run_id'] or '?'}",
        f"version        {s['version']}   outer steps {s['outer_steps']}   tokens merged {s['tokens_merged']}",
        f"parameters     {s['parameters']:,}   norm {s['param_norm']:.4f}   momentum norm "
        + (f"{s['momentum_norm']:.4f}" if s["momentum_norm"] is not None else "-")
        + f"   finite {'yes' if s['all_finite'] else 'NO'}",
        f"pending deltas {s['pending_deltas']}",
    ]
    if s["fragments"]:
        out.append("fragments      " + "  ".join(f"#{f['index']}: v{f['version']}, {f['tokens_merged']:,} tok" for f in s["fragments"]))
    if s["learners"]:
        out.append("learners       " + "  ".join(_learner(k, v) for k, v in sorted(s["learners"].items(), key=lambda kv: int(kv[0]))))
    if s.get("membership_error"):
        out.append(f"membership     {s['membership_error']}")
    width = max(len(t["name"]) for t in s["tensors"]) if s["tensors"] else 4
    out.append("")
    out.append(f"{'tensor'.ljust(width)}  {'shape':>14}  {'norm':>10}  {'max |x|':>9}  {'momentum':>10}")
    for t in s["tensors"]:
        mom = f"{t['momentum_norm']:.4f}" if t["momentum_norm"] is not None else "-"
        out.append(f"{t['name'].ljust(width)}  {'x'.join(map(str, t['shape'])):>14}  {t['norm']:>10.4f}  {t['max_abs']:>9.4f}  {mom:>10}")
    return "\n".join(out)


def _learner(k: str, v: dict) -> str:
    text = f"{k}: {v['merged']} merged"
    if "ranks" in v:
        text += f" ({v['ranks']} rank{'s' if v['ranks'] != 1 else ''}" + (f", {v['datacenter']}" if v["datacenter"] else "") + ")"
    return text


def main(args: argparse.Namespace) -> int:
    members, members_error = run_members(args.source) if args.source.is_dir() else (None, None)
    try:
        g = load(args.source, args.version)
        s = summary(g, members, members_error)
    except SourceError as exc:
        print(f"ddiloco inspect: error: {exc}", file=sys.stderr)
        return 2
    for reason in g.skipped:  # an older version than the run's newest: say so, and why
        print(f"ddiloco inspect: warning: passed over a newer checkpoint that is not usable: {reason}", file=sys.stderr)
    print(json.dumps(s, indent=2) if args.json else _text(s))
    return 0
