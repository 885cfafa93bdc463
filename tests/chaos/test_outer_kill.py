"""The outer optimizer SIGKILLed while writing a checkpoint: the checkpoint on disk stays
loadable, the restarted process restores it and replays the merges recorded after it,
learners retry and re-send every delta that was not acknowledged, and no delta is applied
twice or lost.

Checkpoints every 3 merges. To land the kill inside a checkpoint write, the test watches the
checkpoint folder for the temporary folder a write uses, SIGSTOPs the outer optimizer the
moment it appears and checks it is still there (the process is frozen mid-write: the
checkpoint LATEST names must load right then), then SIGKILLs it."""

from __future__ import annotations

import os
import signal
import time

from ddiloco.chaos.local import wait_group_stopped

from chaos_helpers import load_latest_checkpoint, system_factory, wait_until  # noqa: F401 - fixture


def _stop_mid_checkpoint(s, attempts: int = 200) -> str:
    """SIGSTOP the outer optimizer while a checkpoint is half-written; returns its temp folder."""
    root = s.out / "outer" / "checkpoints"
    pid = s.backend.pid("outer")
    for _ in range(attempts):
        tmp = wait_until(
            lambda: next((e.name for e in os.scandir(root) if e.name.endswith(".tmp")), None), 120,
            "a checkpoint write", interval=0.0005,
        )
        os.killpg(pid, signal.SIGSTOP)
        # kill(2) returns before a thread on another core has stopped: until every thread is
        # seen stopped the write may still finish (and rename its folder) behind our back
        wait_group_stopped(pid)
        if (root / tmp).exists():
            return tmp
        os.killpg(pid, signal.SIGCONT)  # the write finished first; catch the next one
        wait_until(lambda: not (root / tmp).exists(), 30, "the write to finish")
    raise AssertionError(f"no checkpoint write caught in {attempts} tries")


def test_outer_killed_mid_checkpoint(system_factory):  # noqa: F811
    # room for many coalesced windows: on a loaded machine the outer optimizer falls behind
    # before the kill, and with the default bound (4) a learner's queue could already be full
    # when it dies, so the learner would rightly wait instead of training on
    s = system_factory(learners=2, flags=["--checkpoint-every", "3", "--max-coalesce-windows", "64"])
    wait_until(lambda: len(s.events("merge")) >= 6, 180, "six merges")

    tmp = _stop_mid_checkpoint(s)
    assert s.watch.check_now() is not None, "LATEST must stay loadable while a checkpoint is half-written"
    fid = s.chaos.inject("kill", "outer")
    t_kill = time.time()
    versions_before = [e["version"] for e in s.events("merge")]
    acked_before = {(e["learner"], e["seq"]) for e in s.events("upload_acked")}
    assert (s.out / "outer" / "checkpoints" / tmp).exists(), "the kill left a torn checkpoint write behind"
    assert load_latest_checkpoint(s.out) is not None

    # learners keep training while the outer optimizer is down, and their uploads wait
    wait_until(lambda: len([e for e in s.events("window") if e["t"] > t_kill]) >= 4, 60, "training while the outer is down")
    s.chaos.recover(fid)
    wait_until(lambda: [e for e in s.events("outer_ready") if e["t"] > t_kill], 180, "the outer optimizer to serve again")
    restore = [e for e in s.events("restore") if e["t"] > t_kill][0]
    assert restore["version"] <= versions_before[-1]
    replayed = [e["version"] for e in s.events("merge_replayed") if e["t"] > t_kill]
    # the checkpoint plus the merge journal rebuild exactly the last version it had published
    assert restore["version"] + len(replayed) == versions_before[-1]
    assert replayed == list(range(restore["version"] + 1, versions_before[-1] + 1))

    # learners retried and re-sent what was not acknowledged: both get deltas merged again
    for lid in (0, 1):
        wait_until(lambda: s.merges_with(lid, after=restore["t"]), 120, f"a merge of learner {lid} after the restart")
    after = [e["version"] for e in s.events("merge") if e["t"] > restore["t"]]
    assert after[0] == versions_before[-1] + 1, "the first new merge continues the version sequence"

    s.finish()
    s.assert_invariants()
    # every delta acknowledged before the crash was merged exactly once, and each learner's
    # answered sequence numbers (acknowledged or refused) have no gap: nothing was dropped
    sent = {}
    for e in s.events("upload_acked") + s.events("upload_refused"):
        sent.setdefault(e["learner"], set()).add(e["seq"])
    merged = {(d[0], d[1]) for e in s.events("merge") for d in e["deltas"]} | {
        (d[0], d[1]) for e in s.events("merge_replayed") for d in e["deltas"]
    }
    assert acked_before <= merged
    for lid, seqs in sent.items():
        assert seqs == set(range(1, max(seqs) + 1)), f"learner {lid} skipped sequence numbers"
