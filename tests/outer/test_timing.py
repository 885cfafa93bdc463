"""The grace window: the fastest learner's window less what must still happen after the
merge closes (upload already spent, merge, download) and its window-length jitter. A
learner's step time is the median of its own last claims, so one outlying header moves
nothing."""

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
    t.observe_push(0.0, learner=0, compute_seconds=0.6, inner_steps=20)  # 30 ms
    # step = median(20, 30) = 25 ms; deviation = median(|20 - 25|, |30 - 25|) = 5 ms
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


def honest(t: SyncTiming, learner: int, step_s: float, claims: int = 3) -> None:
    for _ in range(claims):
        t.observe_push(0.0, learner=learner, compute_seconds=step_s * 20, inner_steps=20)


def test_one_delta_claiming_no_time_does_not_close_the_window():
    """A learner that sends one delta claiming ~0 s of compute (admission takes any claim
    from 0 up) and is never heard from again: the learners with three claims each bound
    the window, as they did without it."""
    t = timing(alpha=0.2)
    honest(t, 0, 0.025)
    honest(t, 1, 0.050)
    before = t.grace_s(20, 1.0, 10.0)
    assert before == pytest.approx(0.5)
    t.observe_push(0.0, learner=2, compute_seconds=1e-300, inner_steps=20)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(before)


def test_one_outlying_claim_among_the_fastest_learners_own_leaves_its_window():
    t = timing(alpha=0.2)
    honest(t, 0, 0.025, claims=4)
    t.observe_push(0.0, learner=0, compute_seconds=1e-300, inner_steps=20)
    t.observe_push(0.0, learner=1, compute_seconds=1e300, inner_steps=20)  # nor does a huge one elsewhere
    assert t.step_s[0] == pytest.approx(0.025) and t.step_dev_s[0] == 0.0
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5)


def test_a_step_time_that_really_changes_is_followed_within_three_claims():
    t = timing()
    honest(t, 0, 0.050, claims=5)
    honest(t, 0, 0.025, claims=2)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(1.0)  # two claims are outliers
    honest(t, 0, 0.025, claims=1)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5)  # three are the majority of five


def test_a_late_learner_bounds_the_window_from_its_third_claim():
    t = timing()
    honest(t, 0, 0.050)
    honest(t, 1, 0.025, claims=2)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(1.0)
    honest(t, 1, 0.025, claims=1)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5)
