"""The grace window: the fastest learner's window less what must still happen after the
merge closes (its upload already spent, the merge, its download) and its window-length
jitter. Times are passed in: nothing here reads a clock."""

import pytest

from ddiloco.outer.timing import TRANSFERS_KEPT, SyncTiming


def timing(alpha: float = 1.0) -> SyncTiming:
    # alpha 1: each estimate is the last observation, so the rule reads as a closed form
    return SyncTiming(alpha=alpha)


def test_no_window_until_a_step_time_is_known():
    t = timing()
    t.observe_merge(0.01)
    t.observe_pull(0.02, learner=0)
    assert t.grace_s(overlap_steps=20, gamma=1.0, cap=10.0) == 0.0


def test_window_is_the_slack_left_after_upload_merge_and_download():
    t = timing()
    t.observe_push(0.03, learner=0, compute_seconds=0.5, inner_steps=20)  # 25 ms / step
    t.observe_merge(0.01)
    t.observe_pull(0.02, learner=0)
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
    t.observe_push(5.0, learner=0, compute_seconds=20.0, inner_steps=20)
    assert t.grace_s(20, 1.0, cap=3.0) == 3.0
    assert t.grace_s(1, 1.0, cap=3.0) == 0.0  # an upload longer than the window


def test_a_header_without_work_leaves_the_step_estimate_alone():
    t = timing()
    t.observe_push(0.0, learner=0, compute_seconds=0.5, inner_steps=20)
    t.observe_push(0.0, learner=0, compute_seconds=0.0, inner_steps=0)
    assert t.step_s == {0: pytest.approx(0.025)}


# The claim's floor: what the server measures between a learner's accepted deltas.

def _pushes(t, learner, claim_s, steps, every_s, n, fragment=0, start=0.0):
    """``n`` deltas of ``steps`` steps each claiming ``claim_s``, accepted ``every_s`` apart."""
    for i in range(n):
        t.observe_push(0.0, learner, claim_s, steps, fragment=fragment, arrived=start + i * every_s)


def test_a_learner_claiming_no_compute_cannot_close_every_grace_window():
    """One learner says each window took 1 us while it really uploads every 0.5 s: it used
    to be the fastest for the whole run, and every grace window closed at the quorum (0 s).
    Now its step time is at least half of what the server measured (12.5 ms, not 0)."""
    t = timing()
    _pushes(t, learner=0, claim_s=0.5, steps=20, every_s=0.5, n=5)  # honest: 25 ms a step
    _pushes(t, learner=1, claim_s=1e-6, steps=20, every_s=0.5, n=5)
    assert t.step_s[1] == pytest.approx(0.5 * 0.025)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(20 * 0.5 * 0.025)  # half the window, not 0


def test_an_honest_claim_is_taken_as_it_is_even_after_a_restart():
    t = timing()
    _pushes(t, learner=0, claim_s=0.4, steps=20, every_s=0.5, n=3)  # 20 ms claimed, 25 ms between uploads
    t.observe_push(0.0, 0, 0.4, 20, arrived=1.0 + 30.0)  # restarted: one interval of 30 s
    t.observe_push(0.0, 0, 0.4, 20, arrived=31.5)
    assert t.step_s[0] == pytest.approx(0.020)
    assert t.step_dev_s[0] == pytest.approx(0.0)


def test_the_floor_is_the_shortest_of_the_recent_intervals_per_step():
    t = timing()
    t.observe_push(0.0, 0, 1e-6, 20, arrived=0.0)  # no interval yet: the claim counts as made
    assert t.step_s[0] == pytest.approx(1e-6 / 20)
    t.observe_push(0.0, 0, 1e-6, 20, arrived=10.0)  # 0.5 s a step
    assert t.step_s[0] == pytest.approx(0.25)
    t.observe_push(0.0, 0, 1e-6, 40, arrived=12.0)  # two windows in one delta: 50 ms a step
    assert t.step_s[0] == pytest.approx(0.025)
    _pushes(t, learner=0, claim_s=1e-6, steps=20, every_s=20.0, n=4, start=32.0)  # 4 slow intervals push the 50 ms out
    assert t.step_s[0] == pytest.approx(0.5)


def test_intervals_are_measured_per_fragment():
    """With two fragments a learner uploads twice per window, one fragment at a time: the
    interval between its uploads of any fragment is half a window, of the same fragment a
    whole one."""
    t = timing()
    for i in range(4):
        t.observe_push(0.0, 0, 1e-6, 20, fragment=0, arrived=i * 0.5)
        t.observe_push(0.0, 0, 1e-6, 20, fragment=1, arrived=i * 0.5 + 0.25)
    assert t.step_s[0] == pytest.approx(0.5 * 0.025)


def test_without_arrival_times_there_is_no_floor():
    t = timing()
    t.observe_push(0.0, 0, 1e-6, 20)
    t.observe_push(0.0, 0, 1e-6, 20)
    assert t.step_s[0] == pytest.approx(1e-6 / 20)


def test_the_fastest_live_learner_bounds_the_window():
    """A fast learner that died (its lease lapsed) no longer bounds the window: the merges
    left wait for the slower learners still training, as long as their windows allow."""
    t = timing()
    t.observe_push(0.0, learner=0, compute_seconds=0.5, inner_steps=20)  # 25 ms a step
    t.observe_push(0.0, learner=1, compute_seconds=1.5, inner_steps=20)  # 75 ms a step
    assert t.grace_s(20, 1.0, 10.0, live={0, 1}) == pytest.approx(0.5)
    assert t.grace_s(20, 1.0, 10.0, live={1, 2}) == pytest.approx(1.5)  # learner 0 is gone
    assert t.grace_s(20, 1.0, 10.0, live={2}) == 0.0  # no live learner has a step time yet
    assert t.grace_s(20, 1.0, 10.0, live=None) == pytest.approx(0.5)  # membership not known yet


# Transfers: the fastest learner's own, the shortest of its recent ones.

def _fast_learner(t, learner=0):
    """25 ms a step over 20 steps (a 0.5 s window), uploads of 30 ms, downloads of 20 ms."""
    t.observe_push(0.03, learner=learner, compute_seconds=0.5, inner_steps=20)
    t.observe_pull(0.02, learner=learner)
    t.observe_merge(0.01)


def test_another_learners_slow_transfers_take_nothing_from_the_window():
    """A learner that asks for the longest pace the run admits on every download (or reads
    its downloads slowly), and streams its uploads slowly, is not the fastest: the window is
    the fastest learner's, less its own transfers. Pooled into one running average of every
    learner's transfers, that one learner closed every window."""
    t = timing()
    _fast_learner(t)
    window = 0.5 - (0.03 + 0.01 + 0.02)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(window)
    for _ in range(10):
        t.observe_push(9.0, learner=1, compute_seconds=1.5, inner_steps=20)
        t.observe_pull(12.0, learner=1)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(window)
    assert (t.push_s(1), t.pull_s(1)) == (9.0, 12.0)  # they count for its own windows


def test_one_slow_transfer_of_the_fastest_learner_leaves_its_window_a_link_that_stays_slow_shortens_it():
    t = timing()
    _fast_learner(t)
    t.observe_pull(5.0, learner=0)  # one download read slowly (or retried after a break)
    t.observe_push(3.0, learner=0, compute_seconds=0.5, inner_steps=20)  # one upload sent slowly
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5 - (0.03 + 0.01 + 0.02))
    for _ in range(TRANSFERS_KEPT):  # its link slowed down: every recent transfer takes longer
        t.observe_pull(0.2, learner=0)
        t.observe_push(0.1, learner=0, compute_seconds=0.5, inner_steps=20)
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5 - (0.1 + 0.01 + 0.2))


def test_the_fastest_learners_paced_downloads_count_their_span():
    """A paced download reaches its learner over its span: when that learner is the fastest,
    the window leaves the span for it (docs/wan.md, pacing)."""
    t = timing()
    _fast_learner(t)
    for _ in range(TRANSFERS_KEPT):
        t.observe_pull(0.125, learner=0)  # paced over a quarter of its window
    assert t.grace_s(20, 1.0, 10.0) == pytest.approx(0.5 - (0.03 + 0.01 + 0.125))
