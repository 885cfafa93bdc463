"""``ddiloco chaos`` with two outer shards, one of them SIGKILLed mid-run and restarted: it
comes back from its own checkpoint and journal, the other shard keeps merging meanwhile,
learners keep training and re-send to the restarted shard only what it had not
acknowledged. Nothing acknowledged is lost or applied twice; each fragment's versions only
increase. Real processes, real gRPC with mutual TLS, a real SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import TINY_RUN

from ddiloco.chaos.audit import audit_run
from ddiloco.common.metrics import read_events


def test_a_killed_shard_restarts_alone_and_nothing_is_lost(tmp_path):
    out = tmp_path / "run"
    # A learner trains on while a fragment's uploads are stalled until it holds
    # --max-coalesce-windows windows of that fragment, then waits for them. At the default 4
    # (windows of 5 tiny steps) that is about 0.3 s of the 5 s outage, so whether shard 0
    # merged in that span was a race; at 64 the learners train, and shard 0 merges, through
    # the outage, which is what this test is about.
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "chaos", "--learners", "2", "--fragments", "2", "--outer-shards", "2",
         "--fault", "kill:outer:1@6s+5s", "--max-seconds", "30", "--checkpoint-every", "3", "--out", str(out),
         "--max-coalesce-windows", "64", "--quiet", *TINY_RUN],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(out / "metrics.jsonl")
    kill = next(e for e in events if e["event"] == "fault" and e.get("target") == "outer:1" and e.get("phase") == "inject")
    ready_again = [e for e in events if e["event"] == "outer_ready" and e["source"] == "outer-1" and e["t"] > kill["t"]]
    assert ready_again, "shard 1 did not come back"
    back = ready_again[0]["t"]
    # shard 0 merged while shard 1 was down, and learners had fragment 0's deltas acknowledged
    assert [e for e in events if e["event"] == "merge" and e["source"] == "outer-0" and kill["t"] < e["t"] < back]
    assert [e for e in events if e["event"] == "upload_acked" and e["fragment"] == 0 and kill["t"] < e["t"] < back]
    # shard 0 never restarted; shard 1 restored its own state, and merged again after
    assert len([e for e in events if e["event"] == "outer_ready" and e["source"] == "outer-0"]) == 1
    assert [e for e in events if e["event"] == "merge" and e["source"] == "outer-1" and e["t"] > back]
    audit = audit_run(out)
    assert audit.acked and not audit.acked_lost and not audit.applied_twice
    assert audit.versions_monotonic
    # each shard saw its own steady sequence of every learner's deltas: steps of S = 2
    for source, start in (("outer-0", 1), ("outer-1", 2)):
        for learner in (0, 1):
            seqs = sorted({d[1] for e in events if e["event"] == "merge" and e["source"] == source
                           for d in e["deltas"] if d[0] == learner})
            assert seqs and all(s % 2 == start % 2 for s in seqs), (source, learner, seqs[:10])
    report = json.loads((out / "report.json").read_text())
    assert [s["fragments"] for s in report["outer_shards"]] == [[0], [1]]
    # the goodput accounting reads a sharded run too (it failed on the per-shard first
    # sequence numbers, and report.json then had no goodput), every second in one bucket
    assert 0 < report["goodput"] <= 1
    assert report["goodput"] + sum(report["waste"].values()) == pytest.approx(1.0, abs=1e-3)


def test_a_fault_on_a_shard_the_run_lacks_is_refused(capsys, tmp_path):
    from ddiloco.cli import main

    capsys.readouterr()
    assert main(["chaos", "--learners", "2", "--fragments", "2", "--outer-shards", "2",
                 "--fault", "kill:outer:2@5s+1s", "--out", str(tmp_path / "r")]) == 2
    assert "targets outer:2, but the run has 2 outer shards" in capsys.readouterr().err
