"""bench/chaos.py's targeted outer-optimizer kills and its time-to-loss column, on events
whose answers are known (the end-to-end run is tests/bench/test_chaos_quick.py); and the
shared bench helpers' provenance."""

from __future__ import annotations

import pathlib
import threading

import pytest

from support import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    return load_bench(name, f"{name}_bench_t")


def test_targeted_outcomes_before_worst_and_recovery():
    c = _load("chaos")
    f = c.TargetedFault("outer-backlog", 10.0, 5.0, freeze_s=2.0)
    f.record.update({"kind": f.kind, "kill_wall_t": 100.0, "backlog_condition_met": True})
    events = [
        {"event": "eval", "t": 95.0, "eval_loss": 2.5},
        {"event": "eval", "t": 99.0, "eval_loss": 2.4},
        {"event": "journal_replay", "t": 106.0, "deltas": 4},
        {"event": "eval", "t": 107.0, "eval_loss": 2.6},
        {"event": "eval", "t": 110.0, "eval_loss": 2.45},
        {"event": "eval", "t": 113.0, "eval_loss": 2.35},
        {"event": "eval", "t": 120.0, "eval_loss": 2.9},  # after recovery: not the fault's worst
    ]
    (rec,) = c.targeted_outcomes([f], events, learners=4)
    assert rec["eval_loss_before"] == 2.4 and rec["eval_loss_worst_after"] == 2.6
    assert rec["seconds_to_below_pre_kill"] == pytest.approx(13.0)
    assert rec["journal_replayed_deltas"] == 4 and rec["backlog_of_a_round_recovered"] is True
    assert rec["torn_checkpoint_removed"] is False


def test_targeted_outcome_that_never_recovers():
    c = _load("chaos")
    f = c.TargetedFault("outer-checkpoint", 10.0, 5.0, window_s=3.0)
    f.record.update({"kind": f.kind, "kill_wall_t": 100.0, "checkpoint_tmp_seen": True})
    events = [{"event": "eval", "t": 99.0, "eval_loss": 2.4}, {"event": "temporaries_removed", "t": 104.0, "paths": []},
              {"event": "eval", "t": 105.0, "eval_loss": 2.7}, {"event": "eval", "t": 108.0, "eval_loss": 2.5}]
    (rec,) = c.targeted_outcomes([f], events, learners=2)
    assert rec["seconds_to_below_pre_kill"] is None and rec["eval_loss_worst_after"] == 2.7
    assert rec["torn_checkpoint_removed"] is True and rec["journal_replayed_deltas"] == 0


def test_time_to_loss_counts_from_the_schedule_start():
    c = _load("chaos")
    events = [{"event": "learner_start", "t": 5.0}, {"event": "chaos_start", "t": 10.0},
              {"event": "eval", "t": 12.0, "eval_loss": 3.0}, {"event": "eval", "t": 40.0, "eval_loss": 1.99},
              {"event": "eval", "t": 50.0, "eval_loss": 1.5}]
    assert c.time_to_loss(events, 2.0) == pytest.approx(30.0)
    assert c.time_to_loss(events, 1.0) is None
    dp = [{"event": "dp_start", "t": 0.0}, {"event": "eval", "t": 7.0, "eval_loss": 1.0}]
    assert c.time_to_loss(dp, 2.0) == pytest.approx(7.0)


def test_checkpoint_watch_sees_a_temporary_folder(tmp_path):
    c = _load("chaos")
    folder = tmp_path / "outer" / "checkpoints"
    folder.mkdir(parents=True)
    timer = threading.Timer(0.2, lambda: (folder / ".v00000001-g000001.tmp").mkdir())
    timer.start()
    assert c._wait_checkpoint_start(tmp_path, 5.0, threading.Event()) is True
    timer.join()
    assert c._wait_checkpoint_start(tmp_path / "none", 0.3, threading.Event()) is False


def test_provenance_and_dirty_refusal(monkeypatch):
    cb = _load("common_bench")
    state = cb.git_state()
    if (ROOT / ".git").exists():  # a checkout (CI clones one); an exported tree has no revision
        assert len(state["git_rev"]) == 40 and isinstance(state["dirty"], bool)
    assert (state["diff_sha256"] is not None) == state["dirty"]
    dirty = {**state, "dirty": True, "dirty_files": ["services/x.py"], "diff_sha256": "ab" * 32}
    with pytest.raises(SystemExit, match="uncommitted changes"):
        cb.require_clean(dirty, allow_dirty=False, what="bench")
    cb.require_clean(dirty, allow_dirty=True, what="bench")  # marked, not refused
    monkeypatch.setattr(cb, "load_average", lambda: [2.0, 1.0, 0.5])
    monkeypatch.setattr(cb, "git_state", lambda paths=cb.WATCHED: {**state, "dirty": False})
    prov = cb.start_provenance(False, "bench")
    assert prov["load_ok"] is False and prov["load_average_start"] == [2.0, 1.0, 0.5]
    assert cb.first_below([(1, 3.0), (2, 1.9), (3, 1.5)], 2.0) == 2
    assert cb.interpolate([(0, 4.0), (10, 2.0)], 5) == pytest.approx(3.0)


def test_restart_evidence_belongs_to_its_own_kill():
    c = _load("chaos")
    a = c.TargetedFault("outer-backlog", 10.0, 5.0)
    b = c.TargetedFault("outer-checkpoint", 20.0, 5.0)
    a.record.update({"kind": a.kind, "kill_wall_t": 100.0})
    b.record.update({"kind": b.kind, "kill_wall_t": 200.0})
    events = [{"event": "eval", "t": 90.0, "eval_loss": 3.0}, {"event": "temporaries_removed", "t": 204.0, "paths": []},
              {"event": "journal_replay", "t": 105.0, "deltas": 1}]
    ra, rb = c.targeted_outcomes([a, b], events, learners=2)
    assert ra["torn_checkpoint_removed"] is False and rb["torn_checkpoint_removed"] is True
    assert ra["journal_replayed_deltas"] == 1 and rb["journal_replayed_deltas"] == 0
