"""Coalescing when the link is slower than compute: windows queued behind an upload are summed
per fragment, never more than ``max_coalesce_windows`` into one delta; beyond that the
training loop waits (bounded memory) and no work is dropped.

The outer optimizer is a fake on a real gRPC socket (tests/learner/outer_fake.py) that holds
the first upload until released, as a slow link or an outer optimizer that is away would.
"""

from __future__ import annotations

import threading

import numpy as np

from learner_fixtures import H, outer, rig, window  # noqa: F401 - fixtures
from outer_fake import HOLD
from support import wait_until


def _submit_in_background(up, windows, outer):
    """The first window goes straight up (and is held there); the rest are submitted by a
    thread standing in for the training loop, which records how far it got."""
    up.submit(windows[0])
    wait_until(lambda: outer.push_attempts, 10, "the first upload to be in flight")
    done = [windows[0]]
    windows = windows[1:]

    def run():
        for w in windows:
            up.submit(w)
            done.append(w)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_windows_behind_a_slow_upload_are_summed_up_to_the_bound_then_training_waits(outer, rig):  # noqa: F811
    outer.push_script.append(HOLD)
    up, sup = rig.uploader(outer, max_coalesce_windows=3)
    windows = [window(float(i)) for i in range(1, 11)]
    tokens = sum(w.tokens for w in windows)
    thread, done = _submit_in_background(up, windows, outer)

    # one delta in flight (held), three windows summed into the queued one, the fifth waits
    wait_until(lambda: len(done) == 4, 10, "four windows to be taken")
    assert not thread.join(0.5) and len(done) == 4, "the training loop must wait once the queued delta is full"
    assert up.pending() == 2  # bounded memory: one in flight, one queued

    outer.release.set()
    thread.join(10)
    assert up.flush(10) and not sup.failed.is_set()
    assert all(a.inner_steps <= 3 * H for a in outer.accepted)  # what the outer optimizer admits
    assert sum(a.tokens for a in outer.accepted) == tokens  # nothing dropped
    sent = sum(a.arrays[0][1] for a in outer.accepted)
    np.testing.assert_array_equal(sent, np.full(8, sum(range(1, 11)), np.float32))
    assert [a.inner_steps for a in outer.accepted[:2]] == [H, 3 * H]


def test_windows_of_different_fragments_are_never_summed_together(outer, rig):  # noqa: F811
    outer.push_script.append(HOLD)
    up, sup = rig.uploader(outer, max_coalesce_windows=64)
    windows = [window(float(i), fragment=i % 3) for i in range(12)]
    thread, done = _submit_in_background(up, windows, outer)
    wait_until(lambda: len(done) == 12, 10, "all windows to be taken")
    outer.release.set()
    assert up.flush(10) and not sup.failed.is_set()
    for fragment in range(3):
        mine = [a for a in outer.accepted if a.fragment == fragment]
        assert all(a.arrays[0][0] == f"w{fragment}" for a in mine)
        np.testing.assert_array_equal(
            sum(a.arrays[0][1] for a in mine), np.full(8, sum(i for i in range(12) if i % 3 == fragment), np.float32)
        )
    assert len(outer.accepted) <= 4  # the held one, then one summed delta per fragment


def test_a_bound_counts_steps_too_so_no_delta_claims_more_than_the_outer_optimizer_admits(outer, rig):  # noqa: F811
    outer.push_script.append(HOLD)
    up, sup = rig.uploader(outer, max_coalesce_windows=4)
    # windows of 2H steps (a learner running a longer H than the run's): two fill the bound
    windows = [window(1.0, steps=2 * H) for _ in range(5)]
    thread, done = _submit_in_background(up, windows, outer)
    wait_until(lambda: len(done) == 3, 10, "three windows to be taken")
    assert not thread.join(0.5) and len(done) == 3
    outer.release.set()
    thread.join(10)
    assert up.flush(10) and not sup.failed.is_set()
    assert [a.inner_steps for a in outer.accepted] == [2 * H, 4 * H, 4 * H]


def test_a_draining_learner_queues_its_last_windows_without_waiting(outer, rig):  # noqa: F811
    outer.push_script.append(HOLD)
    up, sup = rig.uploader(outer, max_coalesce_windows=1)
    draining = threading.Event()
    up.release = draining
    up.submit(window(1.0))
    wait_until(lambda: outer.push_attempts, 10, "the first upload to be in flight")
    up.submit(window(2.0))  # fills the queued delta
    draining.set()
    up.submit(window(3.0))  # would wait; a leaving learner flushes instead
    outer.release.set()
    assert up.flush(10) and not sup.failed.is_set()
    assert [a.inner_steps for a in outer.accepted] == [H, H, H]
