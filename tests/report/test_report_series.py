"""What `ddiloco report` reads from a run's events (ddiloco.report.series): the time axis,
eval loss against the tokens merged by then, cumulative bytes per learner, and faults."""

from __future__ import annotations

from ddiloco.report.series import build

EVENTS = [
    {"t": 99.0, "source": "outer", "event": "eval", "version": 0, "eval_loss": 5.5, "eval_accuracy": 0.0},
    {"t": 100.0, "source": "coordinator", "event": "learner_registered", "learner": 0},
    {"t": 101.0, "source": "learner-0", "event": "upload_acked", "learner": 0, "bytes": 1000},
    {"t": 101.5, "source": "outer", "event": "merge", "version": 1, "tokens_merged": 640, "staleness": [0.0]},
    {"t": 102.0, "source": "learner-0", "event": "pull", "learner": 0, "bytes": 400},
    {"t": 102.5, "source": "outer", "event": "merge", "version": 2, "tokens_merged": 1280, "staleness": [0.5, 1.0]},
    {"t": 103.0, "source": "outer", "event": "eval", "version": 2, "eval_loss": 4.0, "eval_accuracy": 0.1},
    {"t": 104.0, "source": "chaos", "event": "fault", "phase": "inject", "fault_kind": "kill", "target": "learner-0"},
    {"t": 106.0, "source": "chaos", "event": "fault", "phase": "recover", "fault_kind": "kill", "target": "learner-0"},
    {"t": 107.0, "source": "coordinator", "event": "learner_dead", "learner": 1, "silent_s": 10.0},
    {"t": 108.0, "source": "outer", "event": "delta_refused", "code": "FAILED_PRECONDITION", "reason": "delta is stale"},
]


def test_time_starts_when_the_first_learner_joins():
    s = build(EVENTS)
    assert s.t0 == 100.0
    assert s.evals[0][0] == -1.0  # the initial evaluation comes before


def test_each_evaluation_is_placed_at_the_tokens_merged_into_its_version():
    s = build(EVENTS)
    assert [(v, tokens, loss) for _, v, tokens, loss in s.evals] == [(0, 0, 5.5), (2, 1280, 4.0)]


def test_merges_keep_the_staleness_of_every_delta():
    s = build(EVENTS)
    assert [(v, st) for _, v, st in s.merges] == [(1, [0.0]), (2, [0.5, 1.0])]


def test_bytes_are_cumulative_per_learner():
    s = build(EVENTS)
    assert s.bytes[0] == [(1.0, 1000, 0), (2.0, 1000, 400)]


def test_faults_are_marked_when_injected_not_when_recovered():
    s = build(EVENTS)
    assert s.faults == [(4.0, "kill learner-0"), (7.0, "learner dead 1")]
    assert s.refused == 1


def test_events_out_of_order_in_the_file_are_read_in_time_order():
    assert build(list(reversed(EVENTS))).evals == build(EVENTS).evals
