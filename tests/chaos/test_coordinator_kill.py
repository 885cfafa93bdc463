"""The coordinator SIGKILLed: learners keep training and uploading and the outer optimizer
keeps merging while it is down; restarted, it rebuilds membership from its persisted
state (``RUN_DIR/coordinator/state.json``) without any learner registering again, and
finishes the run with a complete report (goodput and waste included)."""

from __future__ import annotations

import json
import time

from chaos_helpers import system_factory, wait_until  # noqa: F401 - fixture


def test_coordinator_killed(system_factory):  # noqa: F811
    s = system_factory(learners=2, max_seconds=25)
    wait_until(lambda: s.merges_with(0) and s.merges_with(1), 180, "merges of both learners")
    registered_before = len(s.events("learner_registered"))
    fid = s.chaos.inject("kill", "coordinator")
    t_kill = time.time()

    # the run goes on without it: both learners' deltas are acknowledged and merged
    for lid in (0, 1):
        wait_until(lambda: len(s.merges_with(lid, after=t_kill)) >= 2, 120, f"merges of learner {lid} while the coordinator is down")
        # the learner writes its acknowledgement events itself, after the answer reaches it: a
        # merge of the delta can be recorded first, so the event is waited for, not read once
        wait_until(lambda: [e for e in s.events("upload_acked") if e["learner"] == lid and e["t"] > t_kill], 60,
                   f"an acknowledgement learner {lid} received while the coordinator was down")
    assert s.cluster.membership() is None, "the coordinator really is down"

    s.chaos.recover(fid)
    t_back = time.time()
    m = wait_until(s.cluster.membership, 120, "the coordinator to answer again")
    # membership came back from state.json: both learners, alive, same incarnation
    assert sorted(x.learner_id for x in m.members) == [0, 1]
    assert all(x.alive and x.incarnation == 1 for x in m.members)
    assert m.outer_address == s.cluster.outer_address

    # it drives the run to its end: drain, final merge and evaluation, report
    coord = s.backend.proc("coordinator")
    coord.popen.wait(timeout=180)
    assert coord.returncode() == 0
    assert len(s.events("learner_registered")) == registered_before, "nobody had to register again"
    assert s.merges_with(0, after=t_back) and s.merges_with(1, after=t_back)
    report = json.loads((s.out / "report.json").read_text())
    assert report["state"] == "finished" and report["outer_steps"] > 0
    assert 0 < report["goodput"] <= 1
    assert set(report["waste"]) == {"lost_in_crash", "refused_stale", "waiting", "restarting"}
    assert abs(report["goodput"] + sum(report["waste"].values()) - 1) < 0.01
    s.watch.stop()
    s.assert_invariants()


def test_coordinator_restarted_without_state_rebuilds_membership_from_re_registration(system_factory):  # noqa: F811
    """The other way back: its state file is gone, so the restarted coordinator knows nobody.
    Learners are told NOT_FOUND on their next heartbeat and register again under their ids,
    the outer optimizer registers again, and training goes on."""
    s = system_factory(learners=2)
    wait_until(lambda: s.merges_with(0) and s.merges_with(1), 180, "merges of both learners")
    fid = s.chaos.inject("kill", "coordinator")
    (s.out / "coordinator" / "state.json").unlink()
    t_kill = time.time()
    s.chaos.recover(fid)

    def rebuilt():
        m = s.cluster.membership()
        return m if m is not None and sorted(x.learner_id for x in m.members if x.alive) == [0, 1] and m.outer_address else None

    m = wait_until(rebuilt, 120, "both learners and the outer optimizer to register again")
    assert m.outer_address == s.cluster.outer_address
    again = [e for e in s.events("learner_registered") if e["t"] > t_kill]
    assert sorted(e["learner"] for e in again) == [0, 1]
    t_back = time.time()
    for lid in (0, 1):
        wait_until(lambda: s.merges_with(lid, after=t_back), 120, f"merges of learner {lid} after the rebuild")
    s.finish()
    s.assert_invariants()
