"""``ddiloco run --outer-shards 2``: the outer optimizer as two processes, each owning half of
the fragments, over real gRPC with mutual TLS. Learners push and pull each fragment to and
from its owner; shard 0 evaluates the global model by reading the other shard's fragments;
the coordinator finalizes both and reports each. Nothing acknowledged is lost or applied
twice, and the run's folder exports as one model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import TINY_RUN

from ddiloco.chaos.audit import audit_run
from ddiloco.common.metrics import read_events


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--learners", "2", "--fragments", "4", "--outer-shards", "2",
         "--max-tokens", str(2 * 60 * 4 * 64), "--max-seconds", "150", "--out", str(out), "--quiet",
         "--no-monitoring", *TINY_RUN],
        capture_output=True, text=True, timeout=400,
    )
    return proc, out


def test_each_shard_merges_its_own_fragments_and_the_model_improves(sharded_run):
    proc, out = sharded_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    shards = report["outer_shards"]
    assert [s["fragments"] for s in shards] == [[0, 2], [1, 3]]
    assert all(s["merges"] > 0 and s["deltas_pending_at_end"] == 0 for s in shards)
    assert report["outer_steps"] == sum(s["merges"] for s in shards)
    assert report["model_parameters"] == sum(s["parameters"] for s in shards)
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    events = read_events(out / "metrics.jsonl")
    merges = {e["source"]: set() for e in events if e["event"] == "merge"}
    for e in events:
        if e["event"] == "merge":
            merges[e["source"]].add(e["fragment"])
    assert merges == {"outer-0": {0, 2}, "outer-1": {1, 3}}
    # shard 0 evaluates the gathered model; its versions count the merges of both shards
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and {e["source"] for e in evals} == {"outer-0"}
    final = [e for e in events if e["event"] == "finalize" and e["source"] == "outer-0"]
    assert final and final[-1]["version"] == report["global_version"]
    for shard in (0, 1):
        assert (out / f"outer-{shard}" / "checkpoints").is_dir()
    assert not (out / "outer").exists()


def test_nothing_acknowledged_is_lost_or_applied_twice(sharded_run):
    _, out = sharded_run
    audit = audit_run(out)
    assert audit.acked and not audit.acked_lost and not audit.applied_twice
    assert audit.versions_monotonic


def test_the_sharded_run_exports_as_one_model(sharded_run, tmp_path):
    from ddiloco.modelio.source import load

    _, out = sharded_run
    model = load(out)
    report = json.loads((out / "report.json").read_text())
    assert model.version == report["global_version"]
    assert sum(t.numel() for t in model.params.values()) == report["model_parameters"]
    model.to_model()  # every tensor of the model present, with its shape


def test_more_shards_than_fragments_is_refused_before_anything_starts(capsys, tmp_path):
    from ddiloco.cli import main

    capsys.readouterr()
    assert main(["run", "--learners", "2", "--fragments", "2", "--outer-shards", "3", "--insecure",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--outer-shards (3) must be at most --fragments (2)" in err
    assert not (tmp_path / "r").exists()
