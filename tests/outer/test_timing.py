"""The grace window: the fastest learner's window less what must still happen after the
merge closes (upload already spent, merge, download) and its window-length jitter."""

import pytest

from ddiloco.outer.timing import SyncTiming


def timing(alpha: float = 1.0) -> SyncTiming:
    # alpha 1: each estimate is the last observation, so the rule reads as a closed form
    return SyncTiming(alpha=alpha)


def test_no_window_until_a_step_time_is_known():
    t = timing()
    t.observe_merge(0.01)
    t.observe_pull(0.02)
    assert t.grace_s(overlap_steps=20, gamma=1.0, cap=10.0) == 0.0


def test_window_is_the_slack_left_after_upload_merge_and_download():
    t = timing()
    t.observe_push(0.03, learner=0, compute_seconds=0.5, inner_steps=20)  # 25 ms / step
    t.observe_merge(0.01)
    t.observe_pull(0.02)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5 - (0.03 + 0.01 + 0.02))
    assert t.grace_s(20, 0.5, 10.0) == pytest.approx(0.5 * (0.5 - 0.06))
    assert t.grace_s(10, 1.0, 10.0) == pytest.approx(0.25 - 0.06)  # overlap shorter than H


def test_the_fastest_learner_bounds_the_window():
    t = timing()
    t.observe_push(0.0, learner=0, compute_seconds=0.5, inner_steps=20)
    t.observe_push(0.0, learner=1, compute_seconds=1.5, inner_steps=20)  # a 3x slower learner
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5)


def test_window_length_jitter_is_kept_free():
    t = timing(alpha=0.5)
    t.observe_push(0.0, learner=0, compute_seconds=0.4, inner_steps=20)  # 20 ms
    t.observe_push(0.0, learner=0, compute_seconds=0.6, inner_steps=20)  # 30 ms: |dev| 10 ms
    # step = 0.5 * 20 + 0.5 * 30 = 25 ms; deviation = 0.5 * 0 + 0.5 * 10 = 5 ms
    assert t.step_s[0] == pytest.approx(0.025)
    assert t.step_dev_s[0] == pytest.approx(0.005)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(20 * 0.025 - 20 * 0.005)


def test_cap_and_floor():
    t = timing()
    t.observe_push(0.0, learner=0, compute_seconds=20.0, inner_steps=20)
    assert t.grace_s(20, 1.0, cap=3.0) == 3.0
    t.observe_push(5.0, learner=0, compute_seconds=20.0, inner_steps=20)  # upload longer than the window
    assert t.grace_s(1, 1.0, cap=3.0) == 0.0


def test_a_header_without_work_leaves_the_step_estimate_alone():
    t = timing()
    t.observe_push(0.0, learner=0, compute_seconds=0.5, inner_steps=20)
    t.observe_push(0.0, learner=0, compute_seconds=0.0, inner_steps=0)
    assert t.step_s == {0: pytest.approx(0.025)}
