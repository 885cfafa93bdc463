"""Invariants of a run, read back from its event log (``metrics.jsonl``).

- ``deltas_applied_twice``: (learner, seq) pairs that appear in more than one merge of the
  same fragment.
- ``acked_deltas_lost``: (learner, seq) pairs a learner logged as acknowledged
  (``upload_acked``) that no merge ever applied and no merge dropped as stale.
- ``versions_monotonic``: each fragment's global version strictly increases from one merge
  event to the next, across restarts of the outer optimizer.

Merges that an outer optimizer re-applied from its merge journal after a crash are logged as
``merge_replayed``; they count as applied only when the original ``merge`` event is missing
(the crash fell between making the merge durable and logging it), and once per fragment
version: a record replayed again after a second crash before any new checkpoint rebuilds
the same version from the same checkpoint.
"""

from __future__ import annotations

import collections
import pathlib
from dataclasses import dataclass, field

from ddiloco.common.metrics import read_events


def key(learner, seq) -> tuple[int, int]:
    return int(learner), int(seq)


@dataclass
class Audit:
    merges: int = 0
    versions: dict[int, list[int]] = field(default_factory=dict)  # fragment -> versions in log order
    merged: dict[tuple[int, int], int] = field(default_factory=dict)  # (learner, seq) -> times applied (max over fragments)
    acked: set[tuple[int, int]] = field(default_factory=set)
    dropped_stale: set[tuple[int, int]] = field(default_factory=set)

    @property
    def applied_twice(self) -> list[tuple[int, int]]:
        return sorted(k for k, n in self.merged.items() if n > 1)

    @property
    def acked_lost(self) -> list[tuple[int, int]]:
        return sorted(k for k in self.acked if k not in self.merged and k not in self.dropped_stale)

    @property
    def versions_monotonic(self) -> bool:
        return all(all(b > a for a, b in zip(v, v[1:])) for v in self.versions.values())

    def summary(self) -> dict:
        return {
            "merges": self.merges,
            "deltas_merged": len(self.merged),
            "deltas_acked": len(self.acked),
            "acked_deltas_lost": len(self.acked_lost),
            "deltas_applied_twice": len(self.applied_twice),
            "acked_dropped_stale": len(self.dropped_stale & self.acked),
            "versions_monotonic": self.versions_monotonic,
        }


def audit_events(events: list[dict]) -> Audit:
    a = Audit()
    per_fragment: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    logged_versions: set[tuple[int, int]] = set()
    replayed = []
    for e in events:
        kind = e.get("event")
        if kind == "merge":
            frag = int(e.get("fragment", 0))
            a.merges += 1
            a.versions.setdefault(frag, []).append(int(e["version"]))
            logged_versions.add((frag, int(e["version"])))
            for lid, seq in e.get("deltas", []):
                per_fragment[frag][key(lid, seq)] += 1
        elif kind == "merge_replayed":
            replayed.append(e)
        elif kind == "upload_acked":
            a.acked.add(key(e["learner"], e["seq"]))
        elif kind == "delta_dropped_stale":
            a.dropped_stale.add(key(e["learner"], e["seq"]))
    for e in replayed:
        frag = int(e.get("fragment", 0))
        if (frag, int(e["version"])) in logged_versions:
            continue
        # one merge record replayed after each of several crashes (no checkpoint between
        # them) rebuilds the same version each time: one merge, counted once
        logged_versions.add((frag, int(e["version"])))
        for lid, seq in e.get("deltas", []):
            per_fragment[frag][key(lid, seq)] += 1
    for counts in per_fragment.values():
        for k, n in counts.items():
            a.merged[k] = max(a.merged.get(k, 0), n)
    return a


def audit_run(run_dir: pathlib.Path) -> Audit:
    return audit_events(read_events(pathlib.Path(run_dir) / "metrics.jsonl"))
