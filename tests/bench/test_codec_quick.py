"""bench/codec.py --quick end to end: every codec and operation timed beside a memory copy,
the JSON shaped as the issue asks. The speeds themselves come from the full run, alone on
the machine (docs/wan.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_codec_bench_writes_every_row(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "codec.py"), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "codec-quick.json").read_text())
    assert data["threads"] == 1 and data["memcpy_gb_per_s"] > 0
    ops = {(r["codec"], r["op"]) for r in data["rows"]}
    for name in ("int8", "int4"):
        assert {(name, op) for op in ("encode", "encode_ef", "decode", "encode_zstd", "decode_zstd")} <= ops
    for r in data["rows"]:
        assert {"codec", "op", "gb_per_s", "vs_memcpy"} <= set(r) and r["gb_per_s"] > 0
    assert_provenance(data["provenance"])
    assert len(data["targets"]) == 6
    assert "| codec | op |" in proc.stdout
