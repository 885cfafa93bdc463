"""The outer optimizer tells each learner how far ahead of the peers it was merged with it
runs (``FragmentStatus.lead_seconds``): the time its delta waited for the merge's last one.
Learners use it to end their next window later, so equal-speed learners come to send
together (docs/algorithm.md, phase alignment). Arrival times come from an injected clock."""

from __future__ import annotations

import pytest

from outer_helpers import push, tiny_config

from ddiloco.outer.state import OuterState


def test_each_merged_learner_learns_how_long_it_waited_for_the_last_arrival():
    state = OuterState(tiny_config(), None)
    now = {"t": 100.0}
    state.clock = lambda: now["t"]
    push(state, 0, 1, seed=0)
    now["t"] = 100.4
    push(state, 1, 1, seed=1)
    assert state.merge(0, force=True)
    leads = dict(state.status().fragments[0].lead_seconds)
    assert leads[0] == pytest.approx(0.4)
    assert leads[1] == pytest.approx(0.0)


def test_a_learner_merged_alone_has_no_lead_and_the_last_merge_that_held_it_counts():
    state = OuterState(tiny_config(), None)
    now = {"t": 5.0}
    state.clock = lambda: now["t"]
    push(state, 0, 1, seed=0)
    now["t"] = 6.0
    push(state, 1, 1, seed=1)
    state.merge(0, force=True)
    now["t"] = 7.0
    push(state, 0, 2, seed=2)
    state.merge(0, force=True)  # learner 0 alone: nobody to wait for
    leads = dict(state.status().fragments[0].lead_seconds)
    assert leads[0] == pytest.approx(0.0)
    assert leads[1] == pytest.approx(0.0)
