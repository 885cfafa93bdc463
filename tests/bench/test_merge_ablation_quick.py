"""bench/merge_ablation.py --quick runs every variant end to end and writes its JSON."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_ablation_writes_every_variant(tmp_path):
    out = tmp_path / "ablation.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "merge_ablation.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["rows"]} == {"sync", "naive", "staleness-gain-2", "ddiloco"}
    assert all(r["tokens"] > 0 for r in data["rows"])
    assert data["command"] == "python bench/merge_ablation.py --quick"
    assert_provenance(data["provenance"])
    assert "| method |" in proc.stdout
