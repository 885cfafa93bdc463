"""A run's overlap (ddiloco.report.overlap): how many of its own steps a learner trains on
after a window before the merge holding it arrives, on events whose answers are known."""

from __future__ import annotations

import json

from ddiloco.report.overlap import describe, of_run, overlap_steps, window_and_pull_events


def window(t, learner, steps, fragment=0):
    return {"event": "window", "t": t, "learner": learner, "fragment": fragment, "steps": steps}


def pull(t, learner, fragment=0):
    return {"event": "pull", "t": t, "learner": learner, "fragment": fragment, "full": False}


EVENTS = [
    window(0.0, 0, 10), pull(1.0, 0),
    window(10.0, 0, 10), pull(12.5, 0, fragment=1),  # another fragment's pull does not end the wait
    pull(13.0, 0),                                   # 3 s at 1 s per step: 3 steps
    window(20.0, 0, 20), pull(21.0, 0),              # 1 s at 0.5 s per step: 2 steps
    window(0.0, 1, 10), window(10.0, 1, 10),         # no pull after: left out
]


def test_overlap_is_the_time_to_the_next_pull_of_that_fragment_in_the_windows_own_steps():
    assert overlap_steps(EVENTS) == {"overlap_steps_median": 2.5, "overlap_steps_mean": 2.5, "window_steps_mean": 15.0}


def test_a_first_window_alone_has_no_step_time_and_nothing_is_reported():
    assert overlap_steps([window(0.0, 0, 10), pull(1.0, 0)])["overlap_steps_median"] is None
    assert describe(overlap_steps([]), sync=False) is None


def test_the_summary_line_names_what_the_steps_were():
    small = {"overlap_steps_median": 1.13, "overlap_steps_mean": 1.2, "window_steps_mean": 20.03}
    assert describe(small, sync=False) == (
        "1.13 of 20.0 steps per window trained on the old base before its merge arrived (median, 6%)")
    # with --sync the learner idles instead: the same span is the barrier's wait
    assert describe(small, sync=True) == "1.13 steps per window of 20.0 waited at the barrier (median, 6%)"


def test_a_large_share_of_the_window_points_at_the_lever():
    large = {"overlap_steps_median": 5.0, "overlap_steps_mean": 5.2, "window_steps_mean": 22.0}
    assert describe(large, sync=False).endswith("(median, 23%); a longer window (--inner-steps) makes it a smaller share")


def test_a_run_folder_is_read_line_by_line_keeping_windows_and_pulls(tmp_path):
    lines = [json.dumps(e) for e in EVENTS]
    lines.insert(1, json.dumps({"event": "merge", "t": 0.5, "deltas": [[0, 1]], "note": "window"}))
    lines.append('{"event": "window", "t": 30.0, "learn')  # cut short by a process killed mid-write
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    kept = list(window_and_pull_events(tmp_path / "metrics.jsonl"))
    assert kept == EVENTS
    assert of_run(tmp_path, sync=False) == describe(overlap_steps(EVENTS), sync=False)
    assert of_run(tmp_path / "absent", sync=False) is None
