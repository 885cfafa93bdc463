"""The evaluator's record of the initial loss: only the untrained model's (version 0) counts,
it is kept in a file so that a restarted process reports it without evaluating first, and a
record that cannot be read is said so, not trusted. In process; the restart itself, with
real processes, is tests/outer/test_restart_serves_first.py."""

from __future__ import annotations

import json
import logging

import pytest
from outer_helpers import tiny_config

from ddiloco.common.metrics import MetricsLog
from ddiloco.outer.evaluator import Evaluator
from ddiloco.outer.state import OuterState


@pytest.fixture(scope="module")
def state():
    cfg = tiny_config("evaluator-test")
    cfg.data.max_bytes, cfg.data.eval_windows = 600_000, 4
    return OuterState(cfg, None, MetricsLog(None, "outer"))


def _at(state, version: int):
    """The state's model, reported at ``version``."""
    return lambda: (version, 0, state.snapshot()[2])


def test_the_untrained_models_loss_is_recorded_and_read_back(state, tmp_path):
    path = tmp_path / "initial_eval.json"
    first = Evaluator(state.config, state, state.metrics, source=_at(state, 0), initial_path=path)
    assert first.initial is None
    _, loss, _ = first.run_once()
    assert first.initial[0] == loss
    assert json.loads(path.read_text())["eval_loss"] == loss
    restarted = Evaluator(state.config, state, state.metrics, source=_at(state, 7), initial_path=path)
    assert restarted.initial[0] == loss  # known before any evaluation of its own
    restarted.run_once()
    assert restarted.initial[0] == loss  # and a later evaluation does not replace it


def test_a_first_evaluation_of_a_trained_model_is_not_the_initial_loss(state, tmp_path):
    path = tmp_path / "initial_eval.json"
    ev = Evaluator(state.config, state, state.metrics, source=_at(state, 3), initial_path=path)
    ev.run_once()
    assert ev.initial is None and not path.exists()


def test_an_unreadable_record_is_logged_and_not_trusted(state, tmp_path, caplog):
    path = tmp_path / "initial_eval.json"
    path.write_text('{"eval_loss": "five"')
    with caplog.at_level(logging.WARNING, logger="ddiloco.outer.evaluator"):
        ev = Evaluator(state.config, state, state.metrics, source=_at(state, 3), initial_path=path)
    assert ev.initial is None
    assert "initial evaluation record" in caplog.text and "unreadable" in caplog.text


def test_a_taken_model_is_the_one_evaluated_even_after_the_model_changed(state):
    # a restarted process takes the model it restored before merging; the evaluation that
    # follows reports that model, whatever merges came in between
    current = {"version": 5, "arrays": state.snapshot()[2]}
    ev = Evaluator(state.config, state, state.metrics, source=lambda: (current["version"], 0, current["arrays"]))
    ev.take()
    current["version"], current["arrays"] = 6, [(name, a * 0.0) for name, a in current["arrays"]]
    version, loss, _ = ev.run_once()
    reference = Evaluator(state.config, state, state.metrics, source=_at(state, 5)).run_once()[1]
    assert (version, loss) == (5, reference)
    version, zeroed, _ = ev.run_once()  # the next evaluation reads the model as it is now
    assert version == 6 and zeroed != loss
