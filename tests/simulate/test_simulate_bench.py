"""bench/goodput_sim.py: the quick smoke run, and the committed results."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import assert_provenance

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "goodput_sim.json"
ROWS = {"dp", "elastic-dp", "ddiloco-m8", "ddiloco-m16"}


def check_rows(doc):
    rows = doc["rows"]
    assert {r["method"] for r in rows} == ROWS
    assert sorted({r["chips"] for r in rows}) == [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
    assert len(rows) == 20
    assert sum(r["calibrated"] for r in rows) == 3
    for r in rows:
        assert 0 <= r["goodput"] <= 1 and 0 <= r["published"] <= 1
        assert isinstance(r["calibrated"], bool)


def test_quick_bench_prints_a_table_and_writes_json(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "services"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "goodput_sim.py"), "--quick", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    assert "| method | 150k | 300k | 600k | 1.2M | 2.4M |" in proc.stdout
    assert "2.4M chips, one simulated month" in proc.stdout
    doc = json.loads((tmp_path / "goodput_sim.json").read_text())
    check_rows(doc)
    assert_provenance(doc["provenance"])  # the month's CPU seconds are a timing: where and when it ran
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped the PNG" in proc.stdout
    else:
        assert (tmp_path / "goodput_sim.png").stat().st_size > 0


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed results")
def test_committed_results_predict_every_cell_within_three_points():
    doc = json.loads(RESULTS.read_text())
    check_rows(doc)
    for r in doc["rows"]:
        assert abs(r["goodput"] - r["published"]) <= 0.03, r
