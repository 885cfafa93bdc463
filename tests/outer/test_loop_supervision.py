"""The outer optimizer's background loops never die silently.

* An unexpected merge error stops the process with exit status 1, the ``merge_error``
  event naming the fragment and the error (before: exit status 0, so an orchestrator that
  restarts failed processes left it down). Its checkpoint and journal bring it back.
* An unexpected evaluation error is logged with its traceback (``eval_failed``) and the
  next interval tries again; merges and the process go on (before: the evaluation thread
  ended and the run had no more evaluations).

A real coordinator process, the outer optimizer in process; the errors are injected into
the merge and the evaluation (``OuterState.merge``, ``Evaluator.run_once``), which no input
can make raise so.
"""

from __future__ import annotations

import json

import pytest

from support import TINY_RUN, wait_serving, wait_until

from ddiloco.launcher.processes import Cluster
from ddiloco.outer.service import OuterOptions, OuterService


def _events(run_dir, kind):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


@pytest.fixture
def outer(tmp_path):
    cluster = Cluster(tmp_path / "coordinator-run")
    cluster.start_coordinator([*TINY_RUN, "--learners", "1", "--max-seconds", "600"])
    wait_serving(cluster.coordinator_address)
    svc = OuterService(OuterOptions(coordinator=cluster.coordinator_address, run_dir=tmp_path / "outer"))
    yield svc
    svc.stop()
    cluster.stop_all()


def test_an_unexpected_merge_error_stops_the_outer_optimizer_with_exit_status_1(outer, tmp_path):
    outer.start()

    def broken_merge(fragment, force=False):
        raise ArithmeticError("momentum")

    outer.state.merge = broken_merge
    outer.state.due_fragments = lambda live, grace: [0]
    assert outer.wait() == 1
    assert outer.supervisor.failure == "merge: unexpected ArithmeticError: momentum"
    [event] = _events(tmp_path / "outer", "merge_error")
    assert event["fragment"] == 0 and event["reason"] == "ArithmeticError: momentum"


def test_an_unexpected_evaluation_error_is_logged_and_the_next_interval_evaluates_again(outer, tmp_path):
    outer.start()
    real = outer.evaluator.run_once
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("evaluation batch on the wrong device")
        return real()

    outer.evaluator.run_once = failing_once
    wait_until(lambda: _events(tmp_path / "outer", "eval_failed"), 60, "the failed evaluation")
    # the loop lives on: the next interval evaluates again (an unchanged model is not
    # evaluated twice, so the call, not an eval event, is what shows it)
    wait_until(lambda: len(calls) >= 2, 60, "the next evaluation")
    assert not outer.supervisor.failed.is_set() and not outer.stop_event.is_set()
    assert _events(tmp_path / "outer", "eval_failed")[0]["reason"] == "RuntimeError: evaluation batch on the wrong device"
    outer.stop()
    assert outer.wait() == 0
