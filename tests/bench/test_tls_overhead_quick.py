"""bench/tls_overhead.py --quick: one invocation streams through a plaintext and a mutual-TLS
server and reports both throughputs and the overhead, over loopback and over a shaped link."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _quick(tmp_path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tls_overhead.py"), "--quick", "--allow-dirty",
         "--out", str(tmp_path / "r.json"), *extra],
        capture_output=True, text=True, timeout=300,
    )


def test_quick_form_measures_both_modes(tmp_path):
    proc = _quick(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "over loopback" in proc.stdout
    assert "| plaintext |" in proc.stdout and "| mtls |" in proc.stdout
    assert "TLS overhead:" in proc.stdout and "median of 2 pairs" in proc.stdout
    assert not (tmp_path / "r.json").exists()  # the smoke form writes no result


@pytest.mark.skipif(os.geteuid() != 0, reason="a shaped link needs root (network namespaces and tc)")
def test_quick_form_over_a_shaped_link_is_bounded_by_the_link(tmp_path):
    proc = _quick(tmp_path, "--rate-mbit", "400")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "over a link shaped to 400 Mbit/s" in proc.stdout
    rows = dict(line.strip("|").split("|")[:2] for line in proc.stdout.splitlines() if line.startswith("| plaintext") or line.startswith("| mtls"))
    # 400 Mbit/s is 50 MB/s: neither mode can beat the link (tbf's burst lets a little through early)
    for mode, mbps in rows.items():
        assert 10 < float(mbps) < 60, (mode, mbps)


def test_a_non_positive_rate_is_refused(tmp_path):
    proc = _quick(tmp_path, "--rate-mbit", "0")
    assert proc.returncode == 2
    assert "--rate-mbit must be a positive number of Mbit/s, got 0.0" in proc.stderr


def test_only_one_mode_uploads_in_that_mode_alone_and_writes_nothing(tmp_path):
    """--only MODE: for a profiler attached from outside, one mode's uploads and no other."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tls_overhead.py"), "--only", "mtls", "--mib", "4", "--reps", "2",
         "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("mtls: 2 uploads of 4 MiB, median ") and "plaintext" not in proc.stdout
    assert not (tmp_path / "r.json").exists()
    refused = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tls_overhead.py"), "--only", "mtls", "--rate-mbit", "100"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 2 and "--only measures loopback" in refused.stderr
