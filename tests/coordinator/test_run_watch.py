"""What the coordinator's status page and metrics read from the shared event log
(ddiloco.coordinator.watch.RunWatch): whole lines only, as they are appended, the eval
curve, the notable events, and a bound on what it holds."""

from __future__ import annotations

import json

from ddiloco.common.config import RunConfig
from ddiloco.coordinator import watch as watch_mod
from ddiloco.coordinator.membership import Membership


def line(**e) -> bytes:
    return (json.dumps({"t": 100.0, "source": "outer", **e}) + "\n").encode()


def make(tmp_path) -> watch_mod.RunWatch:
    # a real membership without a run folder (no outer optimizer registered: nothing to poll)
    return watch_mod.RunWatch(Membership(RunConfig(learners=2), None), 2, tmp_path)


def test_a_line_still_being_written_is_read_once_it_is_complete(tmp_path):
    w = make(tmp_path)
    whole = line(event="eval", version=3, eval_loss=4.2, eval_accuracy=0.1)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(whole[:20])
    w.poll()
    assert w.curve == []
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(whole[20:])
    w.poll()
    w.poll()  # read once, not again
    assert w.curve == [(100.0, 3, 4.2)]


def test_faults_and_refusals_are_kept_as_recent_events(tmp_path):
    w = make(tmp_path)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line(event="delta_refused", code="FAILED_PRECONDITION", reason="delta is stale"))
        f.write(line(event="merge", version=1, deltas=[[0, 1]], staleness=[0.0]))
        f.write(line(event="learner_dead", learner=1, silent_s=10.0, source="coordinator"))
    w.poll()
    assert [e["event"] for e in w.notable] == ["delta_refused", "learner_dead"]


def test_the_events_held_for_goodput_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(watch_mod, "MAX_HELD", 3)
    w = make(tmp_path)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        for i in range(3):
            f.write(line(event="window", learner=0, fragment=0, steps=5, compute_seconds=0.1))
            f.write(line(event="pull", learner=0, fragment=0, version=i, bytes=10, full=False))  # not held
    w.poll()
    assert len(w._events) == 3 and not w.goodput_frozen
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line(event="window", learner=0, fragment=0, steps=5, compute_seconds=0.1))
    w.poll()
    assert w.goodput_frozen and w._events == []


def test_goodput_is_not_shown_until_a_first_window_has_merged(tmp_path):
    w = make(tmp_path)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line(event="learner_registered", learner=0, source="coordinator", t=100.0))
        f.write(line(event="learner_start", learner=0, source="learner-0", first_seq=1, t=100.5))
        f.write(line(event="window", learner=0, source="learner-0", steps=5, compute_seconds=1.0, t=101.5))
        f.write(line(event="upload_acked", learner=0, source="learner-0", seq=1, tokens=2560, compute_seconds=1.0, t=101.7))
    w.poll()
    w._account()
    assert w.goodput is None  # in flight, not "0% goodput"
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line(event="merge", fragment=0, version=1, deltas=[[0, 1]], staleness=[0.0], t=101.8))
    w.poll()
    w._account()
    assert w.goodput is not None and 0 < w.goodput["goodput"] <= 1
