"""bench/chaos.py --quick end to end: real runs (Decoupled DiLoCo with and without faults,
synchronous DiLoCo under faults, a fault-free data-parallel run and the DP fault model),
checked for the JSON's shape and for what must hold whatever the machine's speed: faults
were injected, nothing acknowledged was lost, nothing applied twice, versions only
increased. The numbers themselves come from the full run (docs/chaos.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from support import assert_provenance, load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW_KEYS = {"method", "faults", "goodput", "final_eval_loss", "acked_deltas_lost", "deltas_applied_twice"}


def _load_bench():
    return load_bench("chaos", "chaos_bench")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos-bench")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--results-dir", str(tmp / "results"),
         "--out", str(tmp / "runs")],
        capture_output=True, text=True, timeout=1200,
    )
    return proc, tmp


def test_quick_bench_writes_every_row(quick_run):
    proc, tmp = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| method | faults | goodput |" in proc.stdout and "| method | outer kill |" in proc.stdout
    doc = json.loads((tmp / "results" / "chaos-quick.json").read_text())
    assert doc["command"] == "python bench/chaos.py --quick"
    rows = doc["rows"]
    assert [(r["method"], r["faults"] == "none") for r in rows] == [
        ("ddiloco", True), ("ddiloco", False), ("diloco-sync", False), ("dp", False), ("dp", True)
    ]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert 0.0 <= r["goodput"] <= 1.0
        assert r["final_eval_loss"] > 0
        assert "time_to_sync_final_s" in r  # issue 17 item 6's column
    assert rows[2]["time_to_sync_final_s"] is not None  # diloco-sync reaches its own final loss
    assert rows[3]["time_to_sync_final_s"] is None  # the modelled DP row has no curve
    for r in rows[1:3]:  # the targeted outer-optimizer kills (issue 10), in both runs under the schedule
        assert [t["kind"] for t in r["targeted_faults"]] == ["outer-backlog", "outer-checkpoint"]
        for t in r["targeted_faults"]:
            if "kill_at_s" in t:
                assert t["eval_loss_before"] is None or t["eval_loss_before"] > 0
                assert {"eval_loss_worst_after", "seconds_to_below_pre_kill", "journal_replayed_deltas",
                        "torn_checkpoint_removed"} <= set(t)
    assert rows[0]["targeted_faults"] == []
    assert {"ddiloco_reaches_sync_final_first", "ddiloco_final_le_sync_final_under_chaos"} <= set(doc["checks"])
    assert_provenance(doc["provenance"])


def test_every_measured_row_ran_on_emulated_dedicated_hardware(quick_run):
    _, tmp = quick_run
    doc = json.loads((tmp / "results" / "chaos-quick.json").read_text())
    t = doc["settings"]["step_seconds"]
    assert t == 0.02 and doc["checks"]["step_seconds"] == t
    for r in doc["rows"]:
        if not r["modelled"]:
            # every step at least T (but the one a drain or a kill cuts short)
            assert r["compute_per_step_s"] >= 0.9 * t, r


def test_faults_cost_nothing_acknowledged(quick_run):
    _, tmp = quick_run
    rows = json.loads((tmp / "results" / "chaos-quick.json").read_text())["rows"]
    ddiloco, chaos, sync = rows[:3]
    assert ddiloco["faults_injected"] == 0
    assert chaos["faults_injected"] >= 3 and sync["faults_injected"] >= 3  # two learner kills and the outer kill
    for r in (ddiloco, chaos, sync):
        assert r["acked_deltas_lost"] == 0 and r["deltas_applied_twice"] == 0 and r["versions_monotonic"]
        assert not r["failures"], r["failures"]
        assert set(r["waste"]) == {"lost_in_crash", "refused_stale", "waiting", "restarting"}
    assert chaos["waste"]["restarting"] > 0, "killed learners spent time restarting"
    assert rows[3]["modelled"] and not rows[4]["modelled"]


def test_dp_fault_model_arithmetic():
    bench = _load_bench()
    s = bench.Settings(learners=4, seconds=300, kill_every=60, restart_after=20, outer_kill_at=150, outer_restart_after=5,
                       model="tiny", inner_steps=20, batch_size=8, dp_checkpoint_s=30, device="cpu")
    measured = {"startup_s": 10.0, "steps": 3000, "wall_s": 300.0, "compute_share": 0.5,
                "evals": [(0, 5.0), (1000, 3.0), (3000, 2.0)]}
    row = bench.model_dp_under_faults(s, measured)
    # 4 kills (60..240 s), each: 15 s of progress lost + 20 s down + 10 s start-up = 45 s
    assert row["model"]["kills"] == 4 and row["model"]["productive_s"] == pytest.approx(120.0)
    assert row["goodput"] == pytest.approx(0.5 * 120 / 310, abs=1e-4)
    assert row["final_eval_loss"] == pytest.approx(2.9)  # step 1200: a tenth of the way from 3.0 (step 1000) to 2.0 (step 3000)
    assert bench.loss_at_step(measured["evals"], 10_000) == 2.0
