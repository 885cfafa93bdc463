"""bench/tls_overhead.py --quick: one invocation streams through a plaintext and a mutual-TLS
server and reports both throughputs and the overhead."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_form_measures_both_modes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tls_overhead.py"), "--quick", "--allow-dirty", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| plaintext |" in proc.stdout and "| mtls |" in proc.stdout
    assert "TLS overhead:" in proc.stdout and "median of 2 pairs" in proc.stdout
    assert not (tmp_path / "r.json").exists()  # the smoke form writes no result
