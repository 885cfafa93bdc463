"""When a fragment merges (``outer/decision.py``): quorum, grace window and restart hold as
pure functions of what is pending and of made-up times; no threads, no gRPC."""

from __future__ import annotations

from ddiloco.outer import decision


def test_below_the_quorum_nothing_is_due_and_no_grace_window_runs():
    assert decision.grace_window(1, None, quorum=2, live=4, grace_s=5.0, now=10.0) == (False, None)


def test_losing_the_quorum_forgets_the_grace_window():
    assert decision.grace_window(1, 3.0, quorum=2, live=4, grace_s=5.0, now=10.0) == (False, None)


def test_the_grace_window_starts_when_the_quorum_is_first_met():
    assert decision.grace_window(2, None, quorum=2, live=4, grace_s=5.0, now=10.0) == (False, 10.0)
    assert decision.grace_window(3, 10.0, quorum=2, live=4, grace_s=5.0, now=14.9) == (False, 10.0)


def test_the_merge_is_due_once_the_grace_window_is_over():
    assert decision.grace_window(2, 10.0, quorum=2, live=4, grace_s=5.0, now=15.0) == (True, 10.0)


def test_the_merge_is_due_at_once_when_every_live_learner_is_in():
    assert decision.grace_window(4, None, quorum=2, live=4, grace_s=5.0, now=10.0) == (True, 10.0)


def test_a_quorum_above_the_live_learners_is_the_live_learners():
    """A run whose learners died keeps merging: K = 3 with one learner alive."""
    assert decision.grace_window(1, None, quorum=3, live=1, grace_s=5.0, now=0.0) == (True, 0.0)


def test_no_grace_window_merges_as_soon_as_the_quorum_is_met():
    assert decision.grace_window(1, None, quorum=1, live=4, grace_s=0.0, now=7.0) == (True, 7.0)


def test_due_fragments_decides_each_fragment_on_its_own():
    pending = [{0, 1}, {0}, {0, 1, 2}, set()]
    since = [1.0, 1.0, None, 2.0]
    due, started = decision.due_fragments(pending, since, quorum=2, live=3, grace_s=5.0, now=6.0)
    assert due == [0, 2]  # 0: grace over; 2: everyone is in
    assert started == [1.0, None, 6.0, None]


def test_the_restart_hold_ends_once_every_fragment_has_every_live_learner():
    assert decision.everyone_in([{0, 1}, {1, 0}], live=2)
    assert not decision.everyone_in([{0, 1}, {1}], live=2)
    assert decision.everyone_in([], live=2)
