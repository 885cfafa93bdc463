"""bench/outer_throughput.py --quick end to end: a real coordinator and outer optimizer, four
learner ids driven through whole rounds (push, long poll, pull), and the JSON's shape and
bookkeeping (not its rates: the machine is shared)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_outer_throughput_drives_whole_rounds_and_reports_headroom(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "outer_throughput.py"), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "outer_throughput-quick.json").read_text())
    assert doc["command"] == "python bench/outer_throughput.py --quick"
    assert_provenance(doc)
    [row] = doc["rows"]
    assert row["model"] == "tiny" and row["learners"] == 4 and row["rounds"] == 3
    # quorum M: every measured merge holds one delta of each learner, none waits for stragglers
    assert row["deltas_per_merge"] == 4.0 and row["rounds_measured"] == 2
    assert row["deltas_per_s"] > 0 and row["outer_cpu_seconds_per_delta"] > 0
    assert row["accept_to_version_seconds_p50"] <= row["accept_to_version_seconds_p95"]
    # a download is the quantized change, never larger than the upload it answers (+ headers)
    assert 0 < row["pull_bytes_per_delta"] <= 1.05 * row["payload_bytes"]
    assert row["headroom"] == round(row["deltas_per_s"] / row["learners_deltas_per_s"], 3)
    assert "| model | params | M | deltas/s |" in proc.stdout
