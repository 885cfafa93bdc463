"""A supervised thread never vanishes: dying, by an expected failure (a ``Fatal``, such as
the learner's ``LearnerFailure``) or an unexpected exception, or ending while the service
still runs, fails the process with the cause; only a thread told to stop may end quietly.
The learner, the outer optimizer and the coordinator run their background loops so."""

from __future__ import annotations

import threading

from ddiloco.learner.supervision import LearnerFailure, Supervisor


def _supervisor():
    calls = []
    return Supervisor("learner", on_failure=lambda: calls.append(1)), calls


def test_an_unexpected_exception_fails_the_learner_with_its_cause():
    sup, calls = _supervisor()

    def loop():
        raise KeyError("fragment 3")

    sup.spawn("puller", loop, threading.Event()).join(5)
    assert sup.failed.is_set() and calls == [1]
    assert sup.failure == "puller: unexpected KeyError: 'fragment 3'"
    assert sup.exit_code() == 1


def test_an_expected_failure_keeps_its_precise_message():
    sup, _ = _supervisor()

    def loop():
        raise LearnerFailure("training diverged: tensor 'w' holds NaN or Inf")

    sup.spawn("uploader", loop, threading.Event()).join(5)
    assert sup.failure == "uploader: training diverged: tensor 'w' holds NaN or Inf"


def test_a_thread_that_ends_while_the_learner_runs_is_a_failure():
    sup, _ = _supervisor()
    sup.spawn("heartbeat", lambda: None, threading.Event()).join(5)
    assert sup.failure == "heartbeat: thread ended while the learner was still running"


def test_a_thread_told_to_stop_ends_quietly():
    sup, calls = _supervisor()
    stop = threading.Event()
    t = sup.spawn("puller", lambda: stop.wait(), stop)
    stop.set()
    t.join(5)
    assert not sup.failed.is_set() and calls == [] and sup.exit_code() == 0


def test_the_first_failure_is_the_cause_reported_and_failing_happens_once():
    sup, calls = _supervisor()
    sup.spawn("puller", lambda: (_ for _ in ()).throw(LearnerFailure("first")), threading.Event()).join(5)
    sup.spawn("uploader", lambda: (_ for _ in ()).throw(LearnerFailure("second")), threading.Event()).join(5)
    assert sup.failure == "puller: first" and calls == [1]
