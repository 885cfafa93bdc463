"""bench/wire.py --quick end to end: a payload up and down over the service's gRPC wire and
over raw TCP between two processes, the JSON shaped as the issue asks. The speeds
themselves come from the full run, alone on the machine (docs/wan.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from support import assert_provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_wire_bench_writes_both_directions(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "wire.py"), "--quick", "--chunk-mb", "1", "2",
         "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "wire-quick.json").read_text())
    assert {(r["direction"], r["chunk_mb"]) for r in data["rows"]} == {
        (d, c) for d in ("upload", "download") for c in (1.0, 2.0)
    }
    for r in data["rows"]:
        assert {"payload_mb", "grpc_gb_per_s", "tcp_gb_per_s", "ratio", "bare_grpc_gb_per_s", "bare_ratio",
                "nopool_grpc_gb_per_s", "nopool_ratio"} <= set(r)
        assert r["bare_grpc_gb_per_s"] > 0  # the ceiling of a gRPC data path, measured beside them
        assert r["nopool_grpc_gb_per_s"] > 0  # and the wire without the receive pool
        assert r["payload_mb"] == 8 and r["grpc_gb_per_s"] > 0 and r["tcp_gb_per_s"] > 0
    assert_provenance(data["provenance"])
    assert "| direction |" in proc.stdout
