"""The time series of a run, from its ``metrics.jsonl`` alone (so a folder copied from
another machine, or the Compose ``run`` volume, is enough): pure functions of the events."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ddiloco.common.metrics import EVALUATOR_SOURCES

# what a person reading the plots should see marked on the time axis
FAULT_KINDS = ("fault", "learner_dead", "learner_failed", "restore", "checkpoint_failed")


@dataclass
class RunSeries:
    t0: float  # the first learner's registration (else the first event): time 0 of every plot
    evals: list[tuple[float, int, int, float]] = field(default_factory=list)  # (s, version, tokens merged, loss)
    merges: list[tuple[float, int, list[float]]] = field(default_factory=list)  # (s, version, staleness per delta)
    # learner -> [(s, cumulative bytes up, cumulative bytes down)]
    bytes: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (s, label)
    refused: int = 0


def build(events: list[dict]) -> RunSeries:
    events = sorted(events, key=lambda e: e.get("t", 0.0))
    registered = [e["t"] for e in events if e.get("event") == "learner_registered"]
    t0 = min(registered) if registered else (events[0]["t"] if events else 0.0)
    out = RunSeries(t0=t0)
    tokens_at = {0: 0}  # global version -> tokens merged when it was made
    up: dict[int, int] = collections.Counter()
    down: dict[int, int] = collections.Counter()
    for e in events:
        kind, s = e.get("event"), e.get("t", t0) - t0
        if kind in ("merge", "merge_replayed") and "tokens_merged" in e:
            tokens_at[e["version"]] = e["tokens_merged"]
        if kind == "merge":
            out.merges.append((s, e["version"], list(e.get("staleness", []))))
        elif kind in ("eval", "finalize") and e.get("source") in EVALUATOR_SOURCES and e.get("eval_loss") is not None:
            version = e["version"]
            tokens = e.get("tokens")
            if tokens is None:  # a log from before evaluations named their tokens
                # the tokens of the newest merge at or below the evaluated version
                tokens = tokens_at.get(version, max((v for k, v in tokens_at.items() if k <= version), default=0))
            out.evals.append((s, version, tokens, e["eval_loss"]))
        elif kind in ("upload_acked", "pull"):
            lid = int(e["learner"])
            if kind == "upload_acked":
                up[lid] += int(e.get("bytes", 0))
            else:
                down[lid] += int(e.get("bytes", 0))
            out.bytes.setdefault(lid, []).append((s, up[lid], down[lid]))
        elif kind in ("delta_refused", "upload_refused"):
            out.refused += 1
        if kind in FAULT_KINDS and not (kind == "fault" and e.get("phase") not in (None, "inject")):
            out.faults.append((s, _fault_label(e)))
    return out


def _fault_label(e: dict) -> str:
    kind = e["event"]
    if kind == "fault":
        return f"{e.get('fault_kind', 'fault')} {e.get('target', '')}".strip()
    if "learner" in e:
        return f"{kind.replace('_', ' ')} {e['learner']}"
    return kind.replace("_", " ")
