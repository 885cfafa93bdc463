"""Goodput accounting: a pure function of a run's event log (``metrics.jsonl``).

goodput = learner compute time whose deltas were merged into the global model
          / learner time provisioned

Provisioned time: every learner slot (the run's M learners, plus any other id that showed
up) is provisioned from the run's start (the first ``learner_registered``) to its end (the
last ``learner_stop``, i.e. when the last learner left after the drain), whether the learner
was alive, frozen or dead meanwhile.

Every second of a slot lands in exactly one bucket:

- ``merged`` (goodput): compute time (``compute_seconds`` of ``window`` events: the inner
  steps' wall time) of windows whose delta a ``merge`` event applied. With P fragments every
  step is in P windows, one per fragment, each carrying a fragment of its work: a window
  counts 1/P of its compute seconds (P from ``learner_start``'s ``versions``), so a step
  whose P fragments all merged counts once, and one whose fragments met different fates is
  shared between their buckets.
- ``lost_in_crash``: compute of windows whose delta was never acknowledged nor refused: in
  flight or still queued when the learner died (or acknowledged but never merged, which
  ``ddiloco.chaos.audit`` reports as a violation).
- ``refused_stale``: compute of windows whose delta was refused (``upload_refused``, e.g.
  too stale after a freeze) or dropped as stale at merge time.
- ``restarting``: from a learner's death (the chaos ``fault`` event that killed it, else its
  last event) to its next ``learner_start`` (registered, data loaded, global parameters
  pulled), or to the end of the run if it never came back.
- ``waiting``: the rest: start-up before the first window, synchronous barriers, time
  frozen (SIGSTOP counts as waiting even inside a step), pulls and folds between steps,
  the drain at the end.

How windows map to deltas: the uploader sends each fragment's windows in order and may
coalesce consecutive ones of that fragment into one delta (one ``seq``). Within one learner
incarnation (from one ``learner_start`` to the next) each fragment's deltas are taken in
``seq`` order and each consumes that fragment's next windows whose compute seconds add up to
the delta's ``compute_seconds``. A delta the outer optimizer accepted whose acknowledgement
the learner never logged (it died first) consumes windows by token count instead. Matching
per fragment matters twice: a queued delta of one fragment absorbs later windows of that
fragment while other fragments' windows go out between them, and with S outer shards each
shard numbers its deltas on its own (shard I of S: I + 1, I + 1 + S, ..., so ``seq`` order
across shards is not window order) and ``learner_start`` gives each shard's first sequence
number as a list.
"""

from __future__ import annotations

import collections
import pathlib
from dataclasses import dataclass, field

from ddiloco.chaos.audit import audit_events, key
from ddiloco.common.metrics import read_events

CAUSES = ("lost_in_crash", "refused_stale", "waiting", "restarting")


@dataclass
class Window:
    t: float
    compute: float
    steps: int
    fragment: int = 0
    status: str = "lost_in_crash"  # merged | refused_stale | lost_in_crash
    frozen: float = 0.0  # part of ``compute`` spent stopped by SIGSTOP


@dataclass
class Incarnation:
    learner: int
    start: float
    first_seq: int | list[int]  # per outer shard when there are several (shard I: seq - 1 = I mod S)
    end: float | None = None  # clean stop
    windows: list[Window] = field(default_factory=list)
    fragments: int = 1  # P: each window holds 1/P of its steps' work
    last_t: float = 0.0


@dataclass
class SlotAccount:
    provisioned_s: float = 0.0
    merged_s: float = 0.0
    waste_s: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    incarnations: int = 0

    def to_dict(self) -> dict:
        p = self.provisioned_s
        return {
            "goodput": round(self.merged_s / p, 4) if p > 0 else 0.0,
            "provisioned_s": round(p, 3),
            "merged_s": round(self.merged_s, 3),
            "waste_s": {k: round(v, 3) for k, v in self.waste_s.items()},
            "incarnations": self.incarnations,
        }


def _first_seq_for(first: int | list[int], seq: int) -> int:
    """The incarnation's first sequence number on the outer shard that numbered ``seq``."""
    if isinstance(first, list):
        return first[(seq - 1) % len(first)] if first else 1
    return first


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def account(events: list[dict], learners: int = 0) -> dict:
    """Goodput and waste of one run. ``learners``: the M slots the run was planned for."""
    registered = [e["t"] for e in events if e.get("event") == "learner_registered"]
    if not registered:
        return {"goodput": 0.0, "waste": {c: 0.0 for c in CAUSES}, "goodput_accounting": {"note": "no learner registered"}}
    t_start = min(registered)
    stops = [e["t"] for e in events if e.get("event") == "learner_stop"]
    fallback = [e["t"] for e in events if e.get("event") in ("draining", "finished")]
    t_end = max(stops) if stops else (min(fallback) if fallback else max(e["t"] for e in events))
    span = max(0.0, t_end - t_start)

    audit = audit_events(events)
    refused: set[tuple[int, int]] = set(audit.dropped_stale)
    acked_compute: dict[tuple[int, int], float] = {}
    accepted_tokens: dict[tuple[int, int], int] = {}
    kills: dict[int, list[float]] = collections.defaultdict(list)
    freezes: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    frozen_since: dict[int, float] = {}
    incs: dict[int, list[Incarnation]] = collections.defaultdict(list)
    fragment_of: dict[tuple[int, int], int] = {}  # (learner, seq) -> the fragment the delta carried
    for e in events:
        kind = e.get("event")
        lid = e.get("learner")
        if kind == "learner_start":
            first = e.get("first_seq", 1)
            first = [int(x) for x in first] if isinstance(first, list) else int(first)
            incs[lid].append(Incarnation(lid, e["t"], first, last_t=e["t"], fragments=max(1, len(e.get("versions") or [0]))))
            continue
        if kind == "fault" and lid is not None:
            if e.get("fault_kind") == "kill" and e.get("phase") == "inject":
                kills[lid].append(e["t"])
            elif e.get("fault_kind") == "freeze" and e.get("phase") == "inject":
                frozen_since[lid] = e["t"]
            elif e.get("fault_kind") == "freeze" and e.get("phase") == "recover" and lid in frozen_since:
                freezes[lid].append((frozen_since.pop(lid), e["t"]))
            continue
        if kind == "delta_accepted":
            accepted_tokens[key(lid, e["seq"])] = int(e.get("tokens", 0))
            fragment_of.setdefault(key(lid, e["seq"]), int(e.get("fragment", 0)))
            continue
        if not str(e.get("source", "")).startswith("learner") or lid is None or not incs.get(lid):
            continue
        inc = incs[lid][-1]
        inc.last_t = e["t"]
        if kind == "window":
            inc.windows.append(
                Window(e["t"], float(e.get("compute_seconds", 0.0)), int(e.get("steps", 0)), int(e.get("fragment", 0)))
            )
        elif kind == "upload_acked":
            acked_compute.setdefault(key(lid, e["seq"]), float(e.get("compute_seconds", 0.0)))
            fragment_of.setdefault(key(lid, e["seq"]), int(e.get("fragment", 0)))
        elif kind == "upload_refused":
            refused.add(key(lid, e["seq"]))
            acked_compute.setdefault(key(lid, e["seq"]), float(e.get("compute_seconds", 0.0)))
            fragment_of.setdefault(key(lid, e["seq"]), int(e.get("fragment", 0)))
        elif kind == "learner_stop":
            inc.end = e["t"]
    for lid, since in frozen_since.items():  # never thawed: frozen to the end
        freezes[lid].append((since, t_end))

    # how many tokens one inner step is, per learner: from any window/upload pair
    tps = _tokens_per_step(events)

    slots = set(range(learners)) | set(incs)
    accounts: dict[int, SlotAccount] = {}
    for lid in sorted(slots):
        acc = SlotAccount(provisioned_s=span, incarnations=len(incs.get(lid, [])))
        accounts[lid] = acc
        seqs_all = sorted({s for (l, s) in (set(acked_compute) | set(accepted_tokens) | set(audit.merged)) if l == lid})
        lst = incs.get(lid, [])
        starts = [inc.start for inc in lst]
        down: list[tuple[float, float]] = []  # dead or starting up: from a death to the next start
        for t in kills.get(lid, []):  # a kill may hit an incarnation that had not started yet
            down.append((t, min([s for s in starts if s > t], default=t_end)))
        for i, inc in enumerate(lst):
            next_inc = lst[i + 1] if i + 1 < len(lst) else None
            seqs = [
                s for s in seqs_all
                if _first_seq_for(inc.first_seq, s) <= s
                and (next_inc is None or s < _first_seq_for(next_inc.first_seq, s))
            ]
            _assign(inc, lid, seqs, acked_compute, accepted_tokens, refused, audit.merged, tps.get(lid), fragment_of)
            back = next_inc.start if next_inc else t_end
            if inc.end is None and not any(inc.start <= t <= back for t in kills.get(lid, [])):
                down.append((inc.last_t, back))  # died without an injected fault: from its last sign of life
            for w in inc.windows:
                w.frozen = min(w.compute, _overlap(w.t - w.compute, w.t, freezes.get(lid, [])))
                useful = (w.compute - w.frozen) / inc.fragments
                if w.status == "merged":
                    acc.merged_s += useful
                else:
                    acc.waste_s[w.status] += useful
        acc.waste_s["restarting"] = _union_length(down, t_start, t_end)
        rest = span - acc.merged_s - sum(acc.waste_s[c] for c in CAUSES if c != "waiting")
        acc.waste_s["waiting"] = max(0.0, rest)

    provisioned = sum(a.provisioned_s for a in accounts.values())
    merged = sum(a.merged_s for a in accounts.values())
    waste = {c: sum(a.waste_s[c] for a in accounts.values()) for c in CAUSES}
    return {
        "goodput": round(min(1.0, merged / provisioned), 4) if provisioned > 0 else 0.0,
        "waste": {c: round(v / provisioned, 4) if provisioned > 0 else 0.0 for c, v in waste.items()},
        "goodput_accounting": {
            "start_t": t_start,
            "end_t": t_end,
            "provisioned_s": round(provisioned, 3),
            "merged_s": round(merged, 3),
            "waste_s": {c: round(v, 3) for c, v in waste.items()},
            "learners": {str(k): a.to_dict() for k, a in accounts.items()},
        },
    }


def _union_length(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b <= a:
            continue
        if a < end:
            a = end
        if b > a:
            total += b - a
            end = b
    return total


def _tokens_per_step(events: list[dict]) -> dict[int, float]:
    """Tokens per inner step for each learner, from an upload of a single window."""
    out: dict[int, float] = {}
    last_window: dict[int, dict] = {}
    for e in events:
        lid = e.get("learner")
        if e.get("event") == "window":
            last_window[lid] = e
        elif e.get("event") == "upload_acked" and lid not in out and lid in last_window:
            w = last_window[lid]
            if w.get("steps") and abs(float(w.get("compute_seconds", 0)) - float(e.get("compute_seconds", -1))) < 1e-3:
                out[lid] = int(e["tokens"]) / int(w["steps"])
    return out


def _assign(
    inc: Incarnation,
    lid: int,
    seqs: list[int],
    compute: dict[tuple[int, int], float],
    accepted_tokens: dict[tuple[int, int], int],
    refused: set[tuple[int, int]],
    merged: dict[tuple[int, int], int],
    tokens_per_step: float | None,
    fragment_of: dict[tuple[int, int], int] | None = None,
) -> None:
    """Give each window of ``inc`` the fate of the delta that carried it: each fragment's
    deltas, in ``seq`` order, take that fragment's windows in order."""
    queues: dict[int, collections.deque[Window]] = collections.defaultdict(collections.deque)
    for w in inc.windows:
        queues[w.fragment].append(w)
    for seq in seqs:
        k = (lid, seq)
        queue = queues[(fragment_of or {}).get(k, 0)]
        status = "merged" if k in merged else ("refused_stale" if k in refused else "lost_in_crash")
        taken = []
        if k in compute:
            target, total = compute[k], 0.0
            while queue and total < target - 1e-3 - 1e-4 * len(taken):
                w = queue.popleft()
                total += w.compute
                taken.append(w)
        elif k in accepted_tokens and tokens_per_step:
            steps_left = accepted_tokens[k] / tokens_per_step
            while queue and steps_left > 0.5:
                w = queue.popleft()
                steps_left -= w.steps
                taken.append(w)
        for w in taken:
            w.status = status


def account_run(run_dir: pathlib.Path, learners: int = 0) -> dict:
    return account(read_events(pathlib.Path(run_dir) / "metrics.jsonl"), learners)


def report_fields(run_dir: pathlib.Path, learners: int) -> dict:
    """The fields ``build_report`` adds to report.json: goodput, waste, goodput_accounting."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    return account(read_events(path), learners)
