"""bench/learner_overhead.py --quick end to end: a plain loop and a one-learner ddiloco run
of the same model, and the JSON's shape (not its numbers: the machine is shared)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_overhead_bench_writes_both_rates_and_their_ratio(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learner_overhead.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["plain"]) == 2 and len(result["learners"]) == 1  # plain, learner, plain
    for run in result["plain"] + result["learners"]:
        assert run["tokens"] > 0 and run["tokens_per_second"] > 0
    around = (result["plain"][0]["tokens_per_second"] + result["plain"][1]["tokens_per_second"]) / 2
    assert result["ratios"] == [result["learners"][0]["tokens_per_second"] / around]
    assert result["ratio"] == result["ratios"][0]
    assert result["target"] == 0.95 and isinstance(result["met"], bool)
    assert_provenance(result["provenance"])
    assert "| ratio, median of 1 (target >= 0.95) |" in proc.stdout
