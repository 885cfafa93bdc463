"""bench/common_bench.py's run-folder diagnostics on events whose answers are known."""

from __future__ import annotations

from support import load_bench


def _load():
    return load_bench("common_bench", "common_bench_t")


def window(t, learner, steps, fragment=0):
    return {"event": "window", "t": t, "learner": learner, "fragment": fragment, "steps": steps}


def pull(t, learner, fragment=0):
    return {"event": "pull", "t": t, "learner": learner, "fragment": fragment, "full": False}


def test_overlap_is_the_time_to_the_next_pull_of_that_fragment_in_the_windows_own_steps():
    cb = _load()
    events = [
        window(0.0, 0, 10), pull(1.0, 0),
        window(10.0, 0, 10), pull(12.5, 0, fragment=1),  # another fragment's pull does not end the wait
        pull(13.0, 0),                                   # 3 s at 1 s per step: 3 steps
        window(20.0, 0, 20), pull(21.0, 0),              # 1 s at 0.5 s per step: 2 steps
        window(0.0, 1, 10), window(10.0, 1, 10),         # no pull after: left out
    ]
    got = cb.overlap_steps(events)
    assert got == {"overlap_steps_median": 2.5, "overlap_steps_mean": 2.5, "window_steps_mean": 15.0}
    # the first window of each (learner, fragment) has no step time: alone, nothing to report
    assert cb.overlap_steps([window(0.0, 0, 10), pull(1.0, 0)])["overlap_steps_median"] is None
    # beside the merge statistics of a run that merged
    merged = events + [{"event": "merge", "t": 5.0, "deltas": [[0, 1], [1, 1]], "staleness": [0.0, 0.5]}]
    assert cb.merge_stats(merged)["overlap_steps_median"] == 2.5
