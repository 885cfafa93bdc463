"""bench/outer_scale.py --quick end to end: a real coordinator with one and with two outer
shards, four learner ids driving whole rounds over every fragment, and the JSON's shape and
bookkeeping (not its rates: the machine is shared)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_outer_scale_drives_one_and_two_shards_and_reports_efficiency(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "outer_scale.py"), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "outer_scale-quick.json").read_text())
    assert doc["command"] == "python bench/outer_scale.py --quick"
    assert_provenance(doc)
    rows = doc["rows"]
    assert [(r["model"], r["shards"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    one, two = rows
    assert one["speedup"] == 1.0 and one["scaling_efficiency"] == 1.0
    assert two["speedup"] == round(two["deltas_per_s"] / one["deltas_per_s"], 3)
    assert two["scaling_efficiency"] == round(two["speedup"] / 2, 3)
    for r in rows:
        # two measured rounds of four fragments, each merge one delta of every learner
        assert r["merges_measured"] == 2 * r["fragments"] and r["learners"] == 4
        assert r["deltas_per_s"] > 0 and r["outer_cpu_seconds_per_delta"] > 0
        assert r["accept_to_merge_seconds_p50"] <= r["accept_to_merge_seconds_p95"]
    assert "| model | S | deltas/s |" in proc.stdout
