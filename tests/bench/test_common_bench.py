"""bench/common_bench.py's run-folder diagnostics on events whose answers are known."""

from __future__ import annotations

from support import load_bench


def _load():
    return load_bench("common_bench", "common_bench_t")


def window(t, learner, steps, fragment=0):
    return {"event": "window", "t": t, "learner": learner, "fragment": fragment, "steps": steps}


def pull(t, learner, fragment=0):
    return {"event": "pull", "t": t, "learner": learner, "fragment": fragment, "full": False}


def test_the_merge_statistics_carry_the_runs_overlap():
    cb = _load()
    events = [window(0.0, 0, 10), window(10.0, 0, 10), pull(13.0, 0)]  # 3 s at 1 s per step
    merged = events + [{"event": "merge", "t": 5.0, "deltas": [[0, 1], [1, 1]], "staleness": [0.0, 0.5]}]
    assert cb.merge_stats(merged)["overlap_steps_median"] == 3.0
