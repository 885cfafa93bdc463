"""The overlap of a run, from its events: how many of its own steps a learner trains on
after a window, from its old base, before the merged version holding that window reaches it.

Why it is reported: an asynchronous learner does not wait for the merge of its delta; it
trains on and folds the merge in when it arrives (docs/algorithm.md, "Fold rule"), and the
steps in between were computed from the old base. Measured across runs, asynchrony's cost
in quality against synchronous DiLoCo follows that share of a window (docs/quality.md, "On
emulated dedicated hardware"). The overlap is the path from a window's end to its merge
(encode, upload, the wait for the merge's last delta, the merge, the download) over the
step time, so a slow link or a short step makes it larger, and a longer window
(``--inner-steps``) makes it a smaller share. With ``--sync`` the same span is the
barrier's wait, during which the learner idles.

``overlap_steps`` and ``describe`` are pure functions of the events (``window`` and
``pull``, each with ``t``, ``learner``, ``fragment``; a window's ``steps``); ``of_run``
reads them from a run folder."""

from __future__ import annotations

import json
import pathlib
from typing import Iterable

# A share of a window beyond which the summary points at the lever: about a step of 20 met
# the 1% quality target at M = 8 on emulated dedicated hardware, 5 of 22 on shared cores did
# not (docs/quality.md)
LARGE_SHARE = 0.15
EMPTY = {"overlap_steps_median": None, "overlap_steps_mean": None, "window_steps_mean": None}


def overlap_steps(events: Iterable[dict]) -> dict:
    """For each window of a (learner, fragment): the time from the window's end to that
    learner's next pull of the fragment, divided by the window's wall time per step (the
    time since the previous window of the same fragment, over its steps). Median and mean
    over windows, beside the mean window length. A learner's first window of a fragment (no
    previous one to time it by) and a window with no pull after it are left out."""
    windows: dict[tuple, list[dict]] = {}
    pulls: dict[tuple, list[float]] = {}
    for e in events:
        key = (e.get("learner"), e.get("fragment"))
        if e.get("event") == "window":
            windows.setdefault(key, []).append(e)
        elif e.get("event") == "pull":
            pulls.setdefault(key, []).append(e["t"])
    overlaps, lengths = [], []
    for key, ws in windows.items():
        ts = sorted(pulls.get(key, []))
        for prev, w in zip(ws, ws[1:]):
            if w["steps"] <= 0 or w["t"] <= prev["t"]:
                continue
            after = next((t for t in ts if t > w["t"]), None)
            if after is None:
                continue
            overlaps.append((after - w["t"]) / ((w["t"] - prev["t"]) / w["steps"]))
            lengths.append(w["steps"])
    if not overlaps:
        return dict(EMPTY)
    overlaps.sort()
    mid = len(overlaps) // 2
    median = overlaps[mid] if len(overlaps) % 2 else (overlaps[mid - 1] + overlaps[mid]) / 2
    return {"overlap_steps_median": round(median, 2), "overlap_steps_mean": round(sum(overlaps) / len(overlaps), 2),
            "window_steps_mean": round(sum(lengths) / len(lengths), 2)}


def window_and_pull_events(path: pathlib.Path) -> Iterable[dict]:
    """The ``window`` and ``pull`` events of a metrics.jsonl, read line by line (a long run's
    log need not fit in memory); a line cut short by a process killed mid-write is skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"window"' not in line and '"pull"' not in line:
                continue  # most lines: not parsed at all
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in ("window", "pull"):
                yield e


def describe(overlap: dict, sync: bool) -> str | None:
    """One line for a run's summary, or None when the run had no timed window."""
    median, window = overlap.get("overlap_steps_median"), overlap.get("window_steps_mean")
    if median is None or not window:
        return None
    share = median / window
    if sync:
        return f"{median:.2f} steps per window of {window:.1f} waited at the barrier (median, {share:.0%})"
    line = (f"{median:.2f} of {window:.1f} steps per window trained on the old base before its merge "
            f"arrived (median, {share:.0%})")
    if share >= LARGE_SHARE:
        # the share is what asynchrony's cost follows; a longer window is the lever a user has
        line += "; a longer window (--inner-steps) makes it a smaller share"
    return line


def of_run(run_dir: pathlib.Path, sync: bool) -> str | None:
    """``describe`` for the run folder ``run_dir`` (its metrics.jsonl), or None without one."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    return describe(overlap_steps(window_and_pull_events(path)), sync)
